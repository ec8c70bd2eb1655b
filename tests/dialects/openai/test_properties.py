"""Property-based hardening over real HTTP, on the scripted runner: no 5xx, no hang,
no leaked slot.

Hypothesis builds request bodies for ``/v1/chat/completions`` and
``/v1/completions`` five ways (``tests.support.properties``: from the wire
schemas, random JSON schemas in tools and ``response_format``, valid bodies,
tree and byte mutations) and sends each to the real app (engine, formatters,
HTTP; the scripted runner in place of the model). The explicit examples of
bodies that once broke the server run apart from the search, so that one
still failing does not stop it. Runs are deterministic (``derandomize``, no
example database).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import Phase, given, settings

from tests.support.helpers import scripted_server
from tests.support.properties import (
    PROPERTY,
    UNIT,
    Case,
    Server,
    Strategies,
    TotalRunner,
    fresh_client,
    run_case,
    with_regressions,
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    runner = TotalRunner(n_ctx_seq=1024)
    with (
        scripted_server(runner, max_body_bytes=UNIT.max_body_bytes) as base,
        fresh_client() as client,
    ):
        yield Server(base, client, runner)


S = Strategies(UNIT)


@settings(PROPERTY, phases=[Phase.explicit])
@given(case=S.schema_cases())
@with_regressions
def test_hostile_bodies_that_once_broke_the_server(server: Server, case: Case) -> None:
    """The explicit examples only (each failing one is reported), apart from the search."""
    run_case(server, case, UNIT)


@settings(PROPERTY, max_examples=200)
@given(case=S.schema_cases())
def test_bodies_from_the_wire_schemas(server: Server, case: Case) -> None:
    run_case(server, case, UNIT)


@settings(PROPERTY, max_examples=150)
@given(case=S.structured_cases())
def test_random_json_schemas_in_tools_and_response_format(server: Server, case: Case) -> None:
    run_case(server, case, UNIT)


@settings(PROPERTY, max_examples=100)
@given(case=S.valid_cases())
def test_valid_bodies_get_a_well_formed_200(server: Server, case: Case) -> None:
    run_case(server, case, UNIT)


@settings(PROPERTY, max_examples=300)
@given(case=S.tree_cases())
def test_mutated_bodies(server: Server, case: Case) -> None:
    run_case(server, case, UNIT)


@settings(PROPERTY, max_examples=200)
@given(case=S.byte_cases())
def test_byte_mutated_bodies(server: Server, case: Case) -> None:
    run_case(server, case, UNIT)
