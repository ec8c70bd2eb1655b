"""Mid-stream failover with real processes: two sluice replicas of SmolLM2 behind a
sluice gateway, the replica serving a stream sent SIGKILL after ten chunks.

The other replica continues the answer from what was sent (a final assistant message
to continue, which sluice reads as vLLM and llama-server do). Greedy, on the same
weights, the spliced stream is the answer the first replica would have given: each
client's SDK reads one answer, equal to the unbroken one, with one finish and usage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import pytest
from openai import OpenAI

from tests.support.real_server import QUIET
from tests.support.servers import free_port, serve_process, serve_process_handle

pytestmark = pytest.mark.integration

QUESTION: list[Any] = [{"role": "user", "content": "Tell me a story about a dragon and a knight."}]
TOKENS = 160  # long enough that the replica is still generating when it is killed
KILL_AFTER = 10
MODEL = "fleet-smollm2"  # the gateway's name for the replicas' model


class Fleet:
    """Replicas on fixed ports (a killed one comes back on its own port)."""

    def __init__(self, stack: contextlib.ExitStack, n: int = 2) -> None:
        self.stack = stack
        self.ports = [free_port() for _ in range(n)]
        self.procs: dict[int, Any] = {}
        for port in self.ports:
            self.start(port)

    def start(self, port: int) -> None:
        _, proc = self.stack.enter_context(serve_process_handle(*QUIET, port=port))
        self.procs[port] = proc

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}/v1" for p in self.ports]

    def kill(self, header: str) -> None:
        """SIGKILL the replica an ``x-sluice-slot`` header names."""
        found = re.search(r"replica=http://127\.0\.0\.1:(\d+)", header)
        assert found, header
        proc = self.procs[int(found.group(1))]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def revive(self, gateway: str) -> None:
        """Start again the replicas that were killed (each on its port), and wait for
        the gateway's checks to find every replica healthy again."""
        for port, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.start(port)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = httpx.get(f"{gateway}/v1/info", timeout=10).json()
            states = {
                r["state"]
                for m in info["models"]
                if m["backend"]["type"] == "upstream"
                for r in m["backend"]["replicas"]
            }
            if states == {"healthy"}:
                return
            time.sleep(0.2)
        raise AssertionError(f"the replicas are not healthy again: {states}")


def gateway_over(stack: contextlib.ExitStack, urls: list[str], tmp: str, native: str = "") -> str:
    """A sluice gateway with the replicas at ``urls`` as the slot ``fleet``; ``native``:
    its ``native_apis`` (TOML), the dialects passed through as they are."""
    config = Path(tmp) / f"sluice{native.count(',')}{len(native)}.toml"
    config.write_text(
        f'[[upstreams]]\nname = "fleet"\nurls = {json.dumps(urls)}\n'
        + 'aliases = { "fleet-smollm2" = "smollm2" }\n'
        "timeout = 30\n"
        "health_interval = 60\n" + (f"native_apis = {native}\n" if native else "")
    )
    return stack.enter_context(serve_process("--config", str(config), *QUIET))


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Fleet, str]]:
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        replicas = Fleet(stack)
        yield replicas, gateway_over(stack, replicas.urls, tmp)


@pytest.fixture(scope="module")
def native(fleet: tuple[Fleet, str]) -> Iterator[str]:
    """A second gateway over the same replicas that passes Anthropic's, OpenAI's
    Responses and Gemini's requests through as they are (``native_apis``)."""
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        dialects = '["anthropic", "responses", "gemini"]'
        yield gateway_over(stack, fleet[0].urls, tmp, native=dialects)


@pytest.fixture(scope="module")
def unbroken(fleet: tuple[Fleet, str]) -> tuple[str, int, int]:
    """The greedy answer asked of a replica directly: its text, prompt and completion."""
    replicas, _ = fleet
    client = OpenAI(base_url=replicas.urls[0], api_key="x", max_retries=0)
    done = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=TOKENS,
        temperature=0,
    )
    assert done.usage is not None and done.choices[0].message.content
    return done.choices[0].message.content, done.usage.prompt_tokens, done.usage.completion_tokens


def serving(gateway: str) -> str:
    """The slot header of the one request in flight (for clients that hide headers)."""
    (flight,) = httpx.get(f"{gateway}/v1/requests", timeout=10).json()["data"]
    return f"fleet; replica={flight['replica']}"


def killing(replicas: Fleet, header: Callable[[], str]) -> Callable[[int], None]:
    """Called with each piece's number: the serving replica dies after KILL_AFTER."""

    def at(n: int) -> None:
        if n == KILL_AFTER:
            replicas.kill(header())

    return at


def test_the_openai_sdk_reads_one_unbroken_answer(
    fleet: tuple[Fleet, str], unbroken: tuple[str, int, int]
) -> None:
    replicas, gateway = fleet
    replicas.revive(gateway)
    client = OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    at = killing(replicas, lambda: raw.headers["x-sluice-slot"])
    pieces: list[str] = []
    finishes: list[str] = []
    usage: Any = None
    for chunk in raw.parse():
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.delta.content:
                pieces.append(choice.delta.content)
                at(len(pieces))
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        if chunk.usage:
            usage = chunk.usage
    text, prompt, completion = unbroken
    assert len(pieces) > KILL_AFTER + 5  # the kill came well before the end
    assert "".join(pieces) == text
    assert len(finishes) == 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, completion)


def claude_killed(base: str, replicas: Fleet) -> tuple[str, int, int]:
    """The answer the anthropic SDK reads while its replica dies: its text, its whole
    input (a continuing replica that had the question cached reads it from the cache,
    which Anthropic counts apart from ``input_tokens``) and its output tokens."""
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    with claude.messages.stream(
        model=MODEL, max_tokens=TOKENS, messages=QUESTION, extra_body={"temperature": 0}
    ) as stream:
        at = killing(replicas, lambda: stream.response.headers["x-sluice-slot"])
        pieces = []
        for piece in stream.text_stream:
            pieces.append(piece)
            at(len(pieces))
        final = stream.get_final_message()
    usage = final.usage
    read = usage.cache_read_input_tokens or 0
    return "".join(pieces), usage.input_tokens + read, usage.output_tokens


def test_the_anthropic_and_ollama_sdks_read_one_unbroken_answer(
    fleet: tuple[Fleet, str], unbroken: tuple[str, int, int]
) -> None:
    replicas, gateway = fleet
    text, prompt, completion = unbroken
    replicas.revive(gateway)
    assert claude_killed(gateway, replicas) == (text, prompt, completion)
    replicas.revive(gateway)
    # Ollama's client hides the headers: the requests in flight say the replica.
    at = killing(replicas, lambda: serving(gateway))
    parts = []
    for n, part in enumerate(
        ollama.Client(host=gateway).chat(
            model=MODEL,
            messages=QUESTION,
            stream=True,
            options={"temperature": 0, "num_predict": TOKENS},
        ),
        start=1,
    ):
        parts.append(part)
        at(n)
    assert "".join(p.message.content or "" for p in parts) == text
    assert parts[-1].done and parts[-1].eval_count == completion


def test_streams_passed_through_natively_read_one_unbroken_answer(
    fleet: tuple[Fleet, str], native: str, unbroken: tuple[str, int, int]
) -> None:
    """The same through a gateway that passes each dialect through (native_apis):
    Messages continued with Anthropic's prefill; Responses and Gemini, whose APIs have
    none, through the replicas' OpenAI chat, written as the first stream's events."""
    replicas, _ = fleet
    text, prompt, completion = unbroken
    replicas.revive(native)
    assert claude_killed(native, replicas) == (text, prompt, completion)

    replicas.revive(native)
    client = OpenAI(base_url=f"{native}/v1", api_key="x", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=QUESTION[0]["content"],
        max_output_tokens=TOKENS,
        temperature=0,
        stream=True,
    )
    at = killing(replicas, lambda: raw.headers["x-sluice-slot"])
    deltas: list[str] = []
    events = []
    for event in raw.parse():
        events.append(event)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
            at(len(deltas))
    assert "".join(deltas) == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ended: Any = events[-1].response  # type: ignore[union-attr]
    assert ended.output_text == text and ended.status in ("completed", "incomplete")
    assert (ended.usage.input_tokens, ended.usage.output_tokens) == (prompt, completion)

    replicas.revive(native)
    from google import genai
    from google.genai import types

    gemini = genai.Client(
        api_key="x", http_options=types.HttpOptions(base_url=native, api_version="v1beta")
    )
    config = types.GenerateContentConfig(temperature=0, max_output_tokens=TOKENS)
    at = killing(replicas, lambda: serving(native))
    records = []
    for n, record in enumerate(
        gemini.models.generate_content_stream(
            model=MODEL, contents=QUESTION[0]["content"], config=config
        ),
        start=1,
    ):
        records.append(record)
        at(n)
    assert "".join(r.text or "" for r in records) == text
    usage = records[-1].usage_metadata
    assert usage is not None
    assert (usage.prompt_token_count, usage.candidates_token_count) == (prompt, completion)
