"""Property-based hardening on the real model: no 5xx, no hang, no leaked slot.

The strategies and checks of ``tests.support.properties`` (bodies from the
wire schemas, valid bodies, tree and byte mutations; the explicit examples of
bodies that once broke the server), sent to a real ``sluice serve`` on the embedded
SmolLM2 over HTTP: llama.cpp's tokenizer, grammar parser and samplers
(penalties, logit bias, grammars from random JSON schemas) see every body
that validation lets through.

Each example stays cheap: generated bodies ask for at most 4 tokens and 2
choices, and the server has 2 slots of 512 tokens; only a mutation of
``max_tokens`` (or its deletion) lets a request run to the end of its
context. A body that kills the server fails with the exit status, and the
server is restarted for the next example (so shrinking still works).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.support.properties import (
    PROPERTY,
    Case,
    Failure,
    Profile,
    Server,
    Strategies,
    fresh_client,
    run_case,
    with_regressions,
)
from tests.support.servers import serve_process_handle

pytestmark = pytest.mark.integration

FLAGS = ("--parallel", "2", "--ctx", "512", "--threads", "1", "--log-level", "warning")

MODEL = Profile(
    max_tokens=st.integers(1, 4),
    n=st.integers(1, 2),
    text_size=24,
    vocab=49152,  # SmolLM2's
    huge_bodies=True,
    max_body_bytes=8 * 1024 * 1024,  # the server's default
    answer_within=60.0,
    idle_within=30.0,
    always=("max_tokens",),
)


class ModelServer:
    """``sluice serve`` in its own process, restarted when a request kills it."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.proc: subprocess.Popen[bytes] | None = None
        self.server = Server("", fresh_client())
        self.deaths: list[str] = []
        self.start()

    def start(self) -> None:
        self._stack = contextlib.ExitStack()
        base, self.proc = self._stack.enter_context(serve_process_handle(*FLAGS))
        self.server.base = base

    def close(self) -> None:
        self._stack.close()
        self.server.client.close()

    def run(self, case: Case) -> None:
        try:
            run_case(self.server, case, MODEL)
        except BaseException:
            assert self.proc is not None
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.deaths.append(f"exit {code}: {case!r}")
                self._stack.close()
                self.start()
                raise Failure(f"the server died (exit status {code}) on {case!r}") from None
            raise


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    srv = ModelServer()
    try:
        yield srv
    finally:
        srv.close()


S = Strategies(MODEL)
# No explain phase: it re-runs a failing example many times, each a real generation.
ON_MODEL = settings(
    PROPERTY, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
)


@settings(ON_MODEL, phases=[Phase.explicit])
@given(case=S.schema_cases())
@with_regressions
def test_hostile_bodies_that_once_broke_the_server(model: ModelServer, case: Case) -> None:
    model.run(case)


@settings(ON_MODEL, max_examples=100)
@given(case=S.schema_cases())
def test_bodies_from_the_wire_schemas(model: ModelServer, case: Case) -> None:
    model.run(case)


@settings(ON_MODEL, max_examples=80)
@given(case=S.structured_cases())
def test_random_json_schemas_in_tools_and_response_format(model: ModelServer, case: Case) -> None:
    model.run(case)


@settings(ON_MODEL, max_examples=50)
@given(case=S.valid_cases())
def test_valid_bodies_get_a_well_formed_200(model: ModelServer, case: Case) -> None:
    model.run(case)


@settings(ON_MODEL, max_examples=120)
@given(case=S.tree_cases())
def test_mutated_bodies(model: ModelServer, case: Case) -> None:
    model.run(case)


@settings(ON_MODEL, max_examples=50)
@given(case=S.byte_cases())
def test_byte_mutated_bodies(model: ModelServer, case: Case) -> None:
    model.run(case)
