"""The engine loop under load, through real HTTP: batching, capacity, disconnects,
chunked prefill, prefix cache, pings. Timing only through bounded polling."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from openai import OpenAI

from sluice.core.events import Finish
from sluice.engine.engine import _GATHER_SECONDS, Engine
from sluice.engine.types import EngineRequest
from sluice.engine.work import EngineConfig
from tests.support.fakes import EOS, FakeSampler, ScriptedRunner, chat_prompt
from tests.support.helpers import (
    CHAT,
    TEXT,
    StreamResult,
    chat_text,
    finishes,
    health,
    health_when,
    parse_sse,
    post_stream,
    prompt_for,
    raw_post,
    read_until,
    scripted_server,
    served,
    text_text,
    user,
    wait_idle,
    wait_until,
)


class Background:
    """Run a blocking call in a thread; ``result()`` joins (bounded)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in result()
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 20) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "background request did not finish"
        if self._error is not None:
            raise self._error
        return self._value


def sampler_for(runner: ScriptedRunner, prompt: str) -> FakeSampler:
    """The (latest) sampler created for this rendered prompt."""
    tokens = [ord(c) for c in prompt]
    return wait_until(
        lambda: next((s for s in reversed(runner.samplers) if s.prompt == tokens), None)
    )


def seq_entries(runner: ScriptedRunner, first_token: str) -> list[tuple[int, int, int]]:
    """(decode index, seq, n tokens) of batch entries that decode ``first_token``-tokens."""
    t = ord(first_token)
    return [
        (i, e.seq, len(e.tokens))
        for i, entries in enumerate(list(runner.decodes))
        for e in entries
        if e.tokens and e.tokens[0] == t
    ]


def post_beside_a_stream(base: str, prompt: str, max_tokens: int, body: dict[str, Any]) -> None:
    """POST ``body`` (a text completion) once a streamed completion of ``prompt`` is
    generating; both complete."""
    seen: list[str] = []

    def consume() -> None:
        req = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", base + TEXT, json=req, timeout=30) as r:
            seen.extend(r.iter_lines())

    stream = Background(consume)
    wait_until(lambda: len(seen) >= 3)
    assert httpx.post(base + TEXT, json=body, timeout=30).status_code == 200
    stream.result()


# -- batching ----------------------------------------------------------------------------


def test_concurrent_streams_are_batched_not_serialized() -> None:
    scripts = {
        prompt_for(f"c{i}"): [f"<{i}:{k}>".encode() for k in range(12)] + [EOS] for i in range(4)
    }
    runner = ScriptedRunner(scripts, step_delay=0.01)
    with scripted_server(runner, parallel=4, queue=4) as base:
        jobs = [
            Background(
                lambda i=i: post_stream(base, CHAT, {"messages": user(f"c{i}"), "stream": True})
            )
            for i in range(4)
        ]
        results: list[StreamResult] = [job.result() for job in jobs]
        for i, res in enumerate(results):
            assert res.status == 200
            chunks = res.chunks
            assert chat_text(chunks) == "".join(f"<{i}:{k}>" for k in range(12))
            assert finishes(chunks) == {0: ["stop"]}
        per_decode = runner.seqs_per_decode()
        assert max(per_decode) >= 2, per_decode
        # Serialized, four requests of 1 prefill + 12 decodes would need 52 decodes.
        assert len(runner.decodes) < 4 * 13
        wait_idle(base)


def test_active_sequences_are_compacted_onto_consecutive_ids() -> None:
    """llama.cpp runs one ubatch per run of consecutive seq ids: keep them dense."""
    lengths = {0: 60, 1: 4, 2: 60, 3: 6}  # 1 and 3 finish early and leave holes
    scripts = {
        prompt_for(f"d{i}"): [f"<{i}:{k}>".encode() for k in range(n)] + [EOS]
        for i, n in lengths.items()
    }
    runner = ScriptedRunner(scripts, step_delay=0.005)
    with scripted_server(runner, parallel=4, queue=4) as base:
        jobs = []
        for i in range(4):
            # Staggered, so that request i takes seq i: the holes are then at low ids
            # (sent all at once, the short ones could land on the top ids: no hole).
            jobs.append(
                Background(
                    lambda i=i: post_stream(base, CHAT, {"messages": user(f"d{i}"), "stream": True})
                )
            )
            time.sleep(0.04)
        results: list[StreamResult] = [job.result() for job in jobs]
        for i, res in enumerate(results):
            # Moved sequences keep their own output: the KV cache moved with them.
            assert chat_text(res.chunks) == "".join(f"<{i}:{k}>" for k in range(lengths[i]))
        assert runner.moves, "a hole at a low id should have been filled"
        for entries in runner.decodes:
            seqs = sorted({e.seq for e in entries})
            if any(len(e.tokens) == 1 for e in entries):  # every generating seq: 0..n-1
                assert seqs == list(range(len(seqs))), seqs
            else:  # a short prompt's step (generating ones wait): its own seq
                assert len(seqs) == 1, seqs
        wait_idle(base)


# -- capacity --------------------------------------------------------------------------------


def test_full_slots_and_queue_answer_503_at_once() -> None:
    # A runs for ~2 s (100 steps of 20 ms): long enough, even on a loaded machine, for
    # the requests below to find the slot and the queue place taken.
    runner = ScriptedRunner(step_delay=0.02)
    runner.scripts["A"] = [b"a"] * 100
    runner.scripts["B"] = [b"b"] * 5
    with scripted_server(runner, parallel=1, queue=1) as base:
        a = Background(
            lambda: post_stream(base, TEXT, {"prompt": "A", "max_tokens": 100, "stream": True})
        )
        wait_until(lambda: health(base)["slots"]["active"] == 1)
        b = Background(
            lambda: httpx.post(base + TEXT, json={"prompt": "B", "max_tokens": 5}, timeout=20)
        )
        h = health_when(base, lambda s: s["queued"] == 1)
        assert h["slots"]["active"] == 1 and h["slots"]["total"] == 1

        t0 = time.monotonic()
        r = httpx.post(base + TEXT, json={"prompt": "C"}, timeout=10)
        assert time.monotonic() - t0 < 2.0  # immediate, not a hang until a slot frees
        assert r.status_code == 503
        assert r.headers["retry-after"].isdigit()
        assert r.json()["error"]["type"] == "server_error"
        res = post_stream(
            base,
            CHAT,
            {"messages": user("C"), "stream": True},
            headers={"Accept": "text/event-stream"},
        )
        assert res.status == 503 and "retry-after" in res.headers
        frames = parse_sse(res.body)
        assert [f.event for f in frames] == ["error"] and b"role" not in res.body
        assert len([s for s in runner.samplers if s.prompt == [ord("C")]]) == 0

        assert text_text(a.result().chunks) == "a" * 100
        rb = b.result()
        assert rb.status_code == 200 and rb.json()["choices"][0]["text"] == "b" * 5
        h = wait_idle(base)
        assert h["slots"]["idle"] == 1
        # Capacity is back: the next request is served.
        assert httpx.post(base + TEXT, json={"prompt": "C"}).status_code == 200


def test_no_slot_shows_idle_while_a_request_waits() -> None:
    """A freed slot is taken by the queued request at once, and /health says so.

    Each step takes 50 ms; a snapshot published only after the next decode would
    show the freed slot idle beside the queued request for that whole step.
    """
    runner = ScriptedRunner(step_delay=0.05)
    runner.scripts["A"] = [b"a"] * 8
    runner.scripts["B"] = [b"b"] * 4
    with scripted_server(runner, parallel=1, queue=2) as base:
        a = Background(lambda: httpx.post(base + TEXT, json={"prompt": "A"}, timeout=20))
        wait_until(lambda: health(base)["slots"]["active"] == 1)
        b = Background(lambda: httpx.post(base + TEXT, json={"prompt": "B"}, timeout=20))
        # (on a loaded machine the loop below may start only after A is done)
        seen: list[dict[str, Any]] = [health_when(base, lambda s: s["queued"] == 1)["slots"]]
        while not b.done():
            seen.append(health(base)["slots"])
        assert a.result().status_code == 200 and b.result().status_code == 200
        assert any(s["queued"] == 1 for s in seen)  # the window was watched
        stale = [s for s in seen if s["idle"] > 0 and s["queued"] > 0]
        assert not stale, stale[:3]


def test_more_choices_than_capacity_is_400() -> None:
    with scripted_server(ScriptedRunner(), parallel=1, queue=1) as base:
        r = httpx.post(base + TEXT, json={"prompt": "x", "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = httpx.post(base + TEXT, json={"prompt": "x", "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


# -- disconnects ------------------------------------------------------------------------------


def assert_aborted(
    base: str, runner: ScriptedRunner, sampler: FakeSampler, decodes_at_close: int
) -> None:
    wait_until(lambda: sampler.freed, timeout=3)
    h = wait_idle(base, timeout=3)
    assert h["slots"]["idle"] == h["slots"]["total"]
    settled = len(runner.decodes)
    time.sleep(0.1)  # a few steps' worth: nothing more may be decoded for it
    assert len(runner.decodes) == settled
    assert settled - decodes_at_close <= 3, (decodes_at_close, settled)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_generating(stream: bool) -> None:
    runner = ScriptedRunner(step_delay=0.01)
    runner.scripts[prompt_for("long answer")] = [b"t"] * 200
    with scripted_server(runner, parallel=2) as base:
        sock = raw_post(base, CHAT, {"messages": user("long answer"), "stream": stream})
        sampler = sampler_for(runner, prompt_for("long answer"))
        if stream:
            read_until(sock, b'"content":"t"')
        wait_until(lambda: sampler.pos >= 5)
        n = len(runner.decodes)
        sock.close()
        assert_aborted(base, runner, sampler, n)
        assert sampler.pos < 50  # it did not run on to the end of its script
        # The slot serves the next request normally.
        r = httpx.post(base + CHAT, json={"messages": user("next")}, timeout=10)
        assert r.json()["choices"][0]["message"]["content"] == "Hello world!"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_prefilling(stream: bool) -> None:
    runner = ScriptedRunner(n_batch=4, step_delay=0.01)
    prompt = "P" * 200  # 50 prefill decodes
    with scripted_server(runner, parallel=2) as base:
        sock = raw_post(base, TEXT, {"prompt": prompt, "stream": stream})
        sampler = sampler_for(runner, prompt)
        wait_until(lambda: len(runner.decodes) >= 3)
        h = health(base)
        assert h["slots"]["prefilling"] == 1 and h["slots"]["generating"] == 0
        n = len(runner.decodes)
        sock.close()
        assert_aborted(base, runner, sampler, n)
        assert sampler.pos == 0  # never reached its first token
        assert len(runner.decodes) < 20
        assert sum(len(e.tokens) for d in runner.decodes for e in d) < len(prompt)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_queued(stream: bool) -> None:
    runner = ScriptedRunner(step_delay=0.01)
    runner.scripts["busy"] = [b"x"] * 300
    with scripted_server(runner, parallel=1, queue=4) as base:
        holder = raw_post(base, TEXT, {"prompt": "busy", "max_tokens": 300, "stream": True})
        read_until(holder, b'"text":"x"')
        waiting = raw_post(base, TEXT, {"prompt": "QQQQ", "stream": stream})
        wait_until(lambda: health(base)["slots"]["queued"] == 1)
        queued_sampler = sampler_for(runner, "QQQQ")
        waiting.close()
        wait_until(lambda: queued_sampler.freed, timeout=3)
        h = health_when(base, lambda s: s["queued"] == 0)
        assert h["slots"]["active"] == 1  # the other request is untouched
        assert queued_sampler.pos == 0
        assert seq_entries(runner, "Q") == []  # never admitted, never decoded
        n = len(runner.decodes)
        holder_sampler = sampler_for(runner, "busy")
        holder.close()
        assert_aborted(base, runner, holder_sampler, n)


def test_one_disconnect_does_not_disturb_the_others() -> None:
    runner = ScriptedRunner(step_delay=0.01)
    runner.scripts[prompt_for("leaver")] = [b"L"] * 100
    runner.scripts[prompt_for("stayer")] = [b"s"] * 30 + [EOS]
    with scripted_server(runner, parallel=2) as base:
        leaver = raw_post(base, CHAT, {"messages": user("leaver"), "stream": True})
        read_until(leaver, b'"content":"L"')
        stayer = Background(
            lambda: post_stream(base, CHAT, {"messages": user("stayer"), "stream": True})
        )
        wait_until(lambda: sampler_for(runner, prompt_for("stayer")).pos >= 3)
        leaver.close()
        wait_until(lambda: sampler_for(runner, prompt_for("leaver")).freed)
        res = stayer.result()
        assert chat_text(res.chunks) == "s" * 30
        assert finishes(res.chunks) == {0: ["stop"]}
        wait_idle(base)


# -- chunked prefill ------------------------------------------------------------------------------


def test_long_prefill_is_chunked_beside_a_generating_sequence() -> None:
    runner = ScriptedRunner(n_batch=8, step_delay=0.005)
    # Long enough to generate through the whole paced prefill (a third of the time).
    runner.scripts["short"] = [b"s"] * 300 + [EOS]
    runner.scripts["L" * 200] = [b"long", EOS]
    arrivals: dict[str, list[float]] = {"short": [], "long": []}

    def consume(name: str, prompt: str, max_tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", base + TEXT, json=body, timeout=20) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text":""' not in line:
                    arrivals[name].append(time.monotonic())

    with scripted_server(runner, parallel=2) as base:
        short = Background(lambda: consume("short", "short", 300))
        wait_until(lambda: len(arrivals["short"]) >= 2)
        long = Background(lambda: consume("long", "L" * 200, 5))
        # /health and /v1/models answer while the long prompt is being prefilled.
        wait_until(lambda: health(base)["slots"]["prefilling"] == 1)
        assert httpx.get(base + "/v1/models", timeout=2).status_code == 200
        long.result()
        short.result()

        prefill = seq_entries(runner, "L")
        assert len(prefill) >= 200 // 8  # several decodes, never more than n_batch at once
        assert sum(n for _, _, n in prefill) == 200
        assert all(n <= 7 for _, _, n in prefill)
        prefill_decodes = {i for i, _, _ in prefill}
        short_seq = seq_entries(runner, "s")[0][1]
        # In every decode that prefilled the long prompt the short one got its next token.
        for i in prefill_decodes:
            assert any(e.seq == short_seq and len(e.tokens) == 1 for e in runner.decodes[i])
        # So the short one's tokens kept arriving before the long one's first token.
        first_long = arrivals["long"][0]
        during = [t for t in arrivals["short"] if t < first_long]
        assert len(during) >= 10


def test_long_prefill_beside_a_generating_sequence_is_paced_by_time() -> None:
    """Beside a generating sequence, a long prompt earns a share of the time (PrefillPacer)
    and spends it in whole chunks of at least the runner's minimum, not a sliver a step."""
    runner = ScriptedRunner(n_batch=64, step_delay=0.004, token_delay=0.001, min_prefill_chunk=16)
    runner.scripts["short"] = [b"s"] * 400 + [EOS]
    runner.scripts["L" * 220] = [b"long", EOS]
    with scripted_server(runner, parallel=2, prefill_budget=0.5) as base:
        post_beside_a_stream(base, "short", 400, {"prompt": "L" * 220, "max_tokens": 5})
    short_seq = seq_entries(runner, "s")[0][1]
    chunks = seq_entries(runner, "L")
    assert sum(n for _, _, n in chunks) == 220
    for k, (i, _, n) in enumerate(chunks):
        assert any(e.seq == short_seq and len(e.tokens) == 1 for e in runner.decodes[i])
        # The first chunk is the minimum (it measures the speed); then ~0.5 s of prefill
        # at 1 ms a token, bounded by the batch; the last one ends the prompt.
        assert n >= 16 or k == len(chunks) - 1
    assert chunks[0][2] == 16
    # The batch less the decode token (63), in whole tiles of 16 (the runner's minimum).
    assert [n for _, _, n in chunks[1:-1]] == [48] * (len(chunks) - 2)
    # Between two chunks of ~50 ms, decode-only steps of ~5 ms earn 0.5x their time:
    # about 25 of them (fewer would mean the share is not kept); the 15-token tail waits
    # for less.
    between = [b[0] - a[0] - 1 for a, b in itertools.pairwise(chunks)]
    assert min(between[1:-1]) >= 15, between


def test_a_short_prompt_is_prefilled_in_a_step_of_its_own() -> None:
    """The generating sequence sits out that one step (its token would have waited for
    the prompt's graph run anyway) and is in the next one, with the new sequence."""
    runner = ScriptedRunner(step_delay=0.003)
    runner.scripts["gen"] = [b"g"] * 200 + [EOS]
    runner.scripts["question"] = [b"a", b"b", EOS]
    with scripted_server(runner, parallel=2) as base:
        post_beside_a_stream(base, "gen", 200, {"prompt": "question", "max_tokens": 3})
    gen_seq = seq_entries(runner, "g")[0][1]
    [(i, seq, n)] = seq_entries(runner, "q")
    assert n == len("question")
    assert [e.seq for e in runner.decodes[i]] == [seq]
    assert sorted(e.seq for e in runner.decodes[i + 1]) == sorted([gen_seq, seq])
    assert any(e.seq == gen_seq for e in runner.decodes[i - 1])


# -- prefix cache --------------------------------------------------------------------------------


def second_turn_prompt() -> str:
    return chat_prompt(("user", "hello"), ("assistant", "Hello world!"), ("user", "and more"))


def test_prefix_cache_reused_and_reported() -> None:
    runner = ScriptedRunner()
    with scripted_server(runner, parallel=2) as base:
        first = httpx.post(base + CHAT, json={"messages": user("hello")}).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        n_before = len(runner.decodes)
        messages = [
            *user("hello"),
            {"role": "assistant", "content": "Hello world!"},
            *user("and more"),
        ]
        res = post_stream(
            base,
            CHAT,
            {"messages": messages, "stream": True, "stream_options": {"include_usage": True}},
        )
        usage = res.chunks[-1]["usage"]
        shared = len(prompt_for("hello"))
        assert usage["prompt_tokens"] == len(second_turn_prompt())
        assert usage["prompt_tokens_details"]["cached_tokens"] == shared
        # Only the suffix was decoded for the prompt: it starts where the cache ends.
        prefill = [e for d in runner.decodes[n_before:] for e in d if len(e.tokens) > 1]
        assert prefill[0].pos0 == shared
        decoded = [t for e in prefill for t in e.tokens]
        assert decoded == [ord(c) for c in second_turn_prompt()[shared:]]
        # The same prompt again: all but the last token come from the cache.
        again = httpx.post(base + CHAT, json={"messages": messages}).json()
        assert (
            again["usage"]["prompt_tokens_details"]["cached_tokens"]
            == len(second_turn_prompt()) - 1
        )
        health_engine = health(base)["engine"]
        assert health_engine["cached_tokens_reused"] >= shared


def test_prefix_cache_not_reported_when_not_kept() -> None:
    runner = ScriptedRunner(partial_keep=False)
    with scripted_server(runner, parallel=1) as base:
        httpx.post(base + CHAT, json={"messages": user("hello")})
        n_before = len(runner.decodes)
        messages = [
            *user("hello"),
            {"role": "assistant", "content": "Hello world!"},
            *user("and more"),
        ]
        body = httpx.post(base + CHAT, json={"messages": messages}).json()
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert type(cached) is int and cached == 0
        first = runner.decodes[n_before][0]
        assert first.pos0 == 0


# -- pings and first bytes ---------------------------------------------------------------------


def test_pings_during_slow_steps_and_sdk_still_parses() -> None:
    runner = ScriptedRunner(step_delay=0.25)
    runner.scripts[prompt_for("slow")] = [b"a", b"b", EOS]
    with scripted_server(runner, ping_interval=0.05) as base:
        body = {"messages": user("slow"), "stream": True}
        with httpx.stream("POST", base + CHAT, json=body, timeout=20) as r:
            # Headers and the role frame go out before the first decode has finished.
            chunks = r.iter_raw()
            first = next(chunks)
            assert first.startswith(b"data: ") and b'"role":"assistant"' in first
            assert len(runner.decodes) == 0
            raw = first + b"".join(chunks)
        frames = parse_sse(raw)
        pings = [f for f in frames if f.comments]
        assert pings and all(f.comments == [": ping"] and f.data is None for f in pings)
        assert b": ping\n\n" in raw
        data = [f.json() for f in frames if f.data and f.data != "[DONE]"]
        assert chat_text(data) == "ab"
        client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model="m", messages=user("slow"), stream=True)
        got = [c for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in got) == "ab"
        assert got[-1].choices[0].finish_reason == "stop"


def test_echo_logprobs_across_prefill_chunks() -> None:
    runner = ScriptedRunner(n_batch=4)
    prompt = "0123456789"
    runner.scripts[prompt] = [b"!", b"?", EOS]
    with scripted_server(runner) as base:
        res = post_stream(
            base, TEXT, {"prompt": prompt, "echo": True, "logprobs": 1, "stream": True}
        )
        chunks = res.chunks
        lps = [c["choices"][0]["logprobs"] for c in chunks]
        tokens = [t for lp in lps for t in lp["tokens"]]
        values = [v for lp in lps for v in lp["token_logprobs"]]
        offsets = [o for lp in lps for o in lp["text_offset"]]
        assert tokens == list(prompt) + ["!", "?"]  # one entry per prompt token, in order
        assert values[0] is None and all(isinstance(v, float) for v in values[1:])
        assert offsets == list(range(12))
        assert text_text(chunks) == prompt + "!?"
        # The prompt went through in several chunks of at most n_batch tokens.
        prefill = [e for d in runner.decodes for e in d if e.tokens[0] < 0x200000]
        assert [len(e.tokens) for e in prefill[:3]] == [4, 4, 2]


# -- a burst of requests ------------------------------------------------------------------


class ListSink:
    """A plain thread-safe sink: the engine's deliveries, in order."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self._lock = threading.Lock()

    def put_many(self, events: list[Any]) -> None:
        with self._lock:
            self.events.extend(events)

    def backlog(self) -> int:
        return 0

    def pause(self, resume_at: int, wake: Callable[[], None]) -> None:
        raise AssertionError("never paused: the backlog is 0")

    def finished(self) -> bool:
        with self._lock:
            return any(isinstance(e, Finish) for e in self.events)


def burst(engine: Any, runner: ScriptedRunner, n: int, *, announce: bool) -> None:
    """``n`` requests reaching submit 30 ms apart (as templating them one by one does)."""
    arrivals = [engine.expect() for _ in range(n)] if announce else []
    sinks = []
    for i in range(n):
        if i:
            time.sleep(0.03)
        sink = ListSink()
        tokens = runner.tokenize(f"burst {i}", add_special=False)
        engine.submit([EngineRequest(prompt_tokens=tokens, max_tokens=2)], sink)
        if announce:
            arrivals[i].done()
        sinks.append(sink)
    wait_until(lambda: all(s.finished() for s in sinks))


@pytest.mark.parametrize("announce", [True, False])
def test_announced_requests_prefill_together_on_an_idle_engine(
    announce: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sluice.engine.engine._GATHER_SECONDS", 5.0)  # timing-proof here
    runner = ScriptedRunner(step_delay=0.02)
    engine = Engine(runner, EngineConfig(n_parallel=4))
    engine.start()
    try:
        burst(engine, runner, 3, announce=announce)
    finally:
        engine.stop()
    first = runner.seqs_per_decode()[0]
    # Unannounced, the first request is prefilled alone and the others wait for that
    # step (the behaviour the announcement removes).
    assert first == (3 if announce else 1), runner.seqs_per_decode()


def test_an_announced_request_that_never_comes_delays_the_others_only_briefly() -> None:
    runner = ScriptedRunner()
    engine = Engine(runner, EngineConfig(n_parallel=4))
    engine.start()
    try:
        lost = engine.expect()  # its client went away before it was prepared, say
        abandoned = engine.expect()
        sink = ListSink()
        started = time.monotonic()
        engine.submit([EngineRequest(prompt_tokens=runner.tokenize("x", add_special=False))], sink)
        abandoned.done()
        abandoned.done()  # idempotent: the counter is not decremented twice
        wait_until(lambda: runner.decodes)
        waited = time.monotonic() - started
        assert _GATHER_SECONDS * 0.8 <= waited < _GATHER_SECONDS + 0.5, waited
        lost.done()  # the last one: nothing is announced any more
        assert engine._arriving == 0
    finally:
        engine.stop()


def test_concurrent_requests_are_announced_and_prefilled_in_one_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests sent together, one 300 ms slower to prepare than the other (both
    are slow enough that each has come in before the first is prepared): the quick one
    would reach the idle engine alone, but every request announces itself as it comes
    in, and the engine waits for the slow one."""
    monkeypatch.setattr("sluice.engine.engine._GATHER_SECONDS", 5.0)  # a slow CI machine
    runner = ScriptedRunner(step_delay=0.01, tokenize_delays={"quick": 0.1, "slow": 0.4})
    with scripted_server(runner, parallel=4, queue=4) as base:
        jobs = [
            Background(
                lambda text=text: post_stream(base, CHAT, {"messages": user(text), "stream": True})
            )
            for text in ("quick", "slow")
        ]
        for job in jobs:
            assert job.result().status == 200
    assert runner.seqs_per_decode()[0] == 2, runner.seqs_per_decode()


def test_a_request_that_fails_before_submit_is_no_longer_announced() -> None:
    runner = ScriptedRunner(n_ctx_seq=64)
    with served(runner) as (base, engine):
        too_long = {"messages": user("word " * 200), "stream": True}
        assert httpx.post(base + CHAT, json=too_long, timeout=10).status_code == 400
        ok = post_stream(base, CHAT, {"messages": user("hi"), "stream": True})
        assert ok.status == 200
        assert engine._arriving == 0
