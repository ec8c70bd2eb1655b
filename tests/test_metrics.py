"""Per-slot metrics: the window, TTFT, bookkeeping, the stream wrapper, the tap, /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from sluice.core.backend import StreamMeta
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from sluice.dialects.ops import metrics as metrics_endpoint
from sluice.metrics import Metrics, OpenAIChunkTap, metered


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(window: float = 10.0) -> tuple[Metrics, Clock]:
    clock = Clock()
    return Metrics(window=window, clock=clock), clock


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.render()
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


# -- tokens per second ----------------------------------------------------------------


def test_burst_right_after_start_is_divided_by_its_own_span() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    meter = slot.request()
    for _ in range(50):
        meter.tokens(1)
        clock.advance(0.02)
    assert clock.now == pytest.approx(1001.0)
    assert slot.snapshot()["tokens_per_second"] == pytest.approx(50.0)
    # Idle afterwards: the same 50 tokens over a growing span, then gone.
    clock.advance(4.0)
    assert slot.snapshot()["tokens_per_second"] == pytest.approx(10.0)
    clock.advance(60.0)
    assert slot.snapshot()["tokens_per_second"] == 0.0


def test_steady_rate_over_the_full_window() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    meter = slot.request()
    for _ in range(300):  # 10 tok/s for 30 s
        meter.tokens(1)
        clock.advance(0.1)
    assert slot.tokens_per_second() == pytest.approx(10.0, rel=0.02)
    clock.now = 1030.5  # mid-bucket: the partial bucket and its span both count
    assert slot.tokens_per_second() == pytest.approx(300 / 30 * 9.0 / 9.5, rel=0.02)


def test_first_token_alone_reads_at_most_one_bucket() -> None:
    metrics, _ = make()
    slot = metrics.slot("a", "local")
    slot.request().tokens(3)
    assert slot.tokens_per_second() == 3.0  # divided by one second, not by ~0


def test_new_burst_after_idle_restarts_the_span() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    meter = slot.request()
    meter.tokens(5)
    clock.advance(60.0)
    for _ in range(20):
        meter.tokens(1)
        clock.advance(0.1)
    # 20 tokens in 2 s; the old burst neither counts nor stretches the span.
    assert slot.tokens_per_second() == pytest.approx(10.0)


# -- TTFT -----------------------------------------------------------------------------


def test_ttft_percentiles_over_the_window() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "upstream")
    assert slot.snapshot()["ttft_ms"] == {"last": None, "p50": None, "p95": None}
    for ms in [7, 3, 20, 1, 15, 9, 11, 2, 18, 5, 13, 4, 6, 17, 8, 19, 10, 16, 12, 14]:
        meter = slot.request()
        clock.advance(ms / 1000)
        meter.first_token()
        meter.first_token()  # idempotent: no second observation
        meter.finish()
    assert slot.snapshot()["ttft_ms"] == {"last": 14.0, "p50": 10.0, "p95": 19.0}
    assert sample(metrics, "sluice_time_to_first_token_seconds_count", slot="a") == 20
    clock.advance(10.0)
    assert slot.snapshot()["ttft_ms"] == {"last": None, "p50": None, "p95": None}


# -- bookkeeping ----------------------------------------------------------------------


def test_in_flight_and_queued() -> None:
    metrics, _ = make()
    slot = metrics.slot("a", "local")
    first, second = slot.request(), slot.request()
    assert (slot.in_flight, slot.queued) == (2, 2)
    first.first_token()
    assert (slot.in_flight, slot.queued) == (2, 1)
    second.finish(error=True)  # never started: leaves the queue too
    assert (slot.in_flight, slot.queued) == (1, 0)
    second.finish()
    second.first_token()
    second.tokens(4)
    assert (slot.in_flight, slot.queued, slot.requests, slot.errors) == (1, 0, 1, 1)
    assert slot.tokens_out == 0
    first.finish(prompt_tokens=9)
    first.finish(prompt_tokens=9)
    snap = slot.snapshot()
    assert (snap["in_flight"], snap["queued"], snap["requests"], snap["errors"]) == (0, 0, 2, 1)
    assert snap["tokens_in"] == 9


def test_tokens_imply_the_first_token() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    meter = slot.request()
    clock.advance(0.25)
    meter.tokens(2)
    assert slot.queued == 0
    assert slot.snapshot()["ttft_ms"]["last"] == 250.0


def test_usage_corrects_the_live_count_upwards() -> None:
    metrics, _ = make()
    slot = metrics.slot("a", "local")
    meter = slot.request()
    meter.tokens(5)
    meter.finish(prompt_tokens=4, completion_tokens=8)
    assert slot.tokens_out == 8
    assert slot.tokens_per_second() == 8.0
    assert sample(metrics, "sluice_tokens_total", slot="a", direction="out") == 8
    assert sample(metrics, "sluice_tokens_total", slot="a", direction="in") == 4


def test_usage_corrects_downwards_and_the_counter_never_drops() -> None:
    metrics, _ = make()
    slot = metrics.slot("a", "local")
    meter = slot.request()
    meter.tokens(5)
    assert sample(metrics, "sluice_tokens_total", slot="a", direction="out") == 5
    meter.finish(completion_tokens=3)
    assert slot.snapshot()["tokens_out"] == 3
    assert slot.tokens_per_second() == 3.0
    assert sample(metrics, "sluice_tokens_total", slot="a", direction="out") == 5
    slot.request().tokens(4)  # the true total (7) passes the high-water mark
    assert sample(metrics, "sluice_tokens_total", slot="a", direction="out") == 7


# -- metered() ------------------------------------------------------------------------


class Scripted:
    """A ResponseStream replaying events, the clock moving 0.1 s before each."""

    def __init__(
        self,
        events: list[Event],
        clock: Clock,
        *,
        choices: int = 1,
        owners: frozenset[int] = frozenset({0}),
        raise_at_end: Exception | None = None,
    ) -> None:
        self.meta = StreamMeta(model="m", choices=choices, prompt_owners=owners, slot="a")
        self.events = events
        self.clock = clock
        self.closed = 0
        self.raise_at_end = raise_at_end

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._run()

    async def _run(self) -> AsyncIterator[Event]:
        for event in self.events:
            self.clock.advance(0.1)
            yield event
        if self.raise_at_end is not None:
            raise self.raise_at_end

    async def aclose(self) -> None:
        self.closed += 1


async def test_metered_counts_a_whole_stream() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    events: list[Event] = [
        Start(0, 7),
        Start(1, 7),
        Progress(0, "prompt_processing", 7, 7),
        TextDelta(0, "echoed prompt", token_count=3, echo=True),
        ReasoningDelta(0, "hm"),  # the first token: 0.5 s after admission
        ReasoningDelta(0, "m"),
        TextDelta(0, "Hi there", token_count=2),
        TextDelta(1, "Yo", token_count=1),
        ToolCallStart(1, 0, "call_1", "f"),
        ToolCallDelta(1, 0, '{"a"'),
        ToolCallDelta(1, 0, ": 1}"),
        ToolCallEnd(1, 0),
        Finish(0, "stop", Usage(0, 7, 4)),
        Finish(1, "tool_calls", Usage(1, 7, 9)),
    ]
    inner = Scripted(events, clock, choices=2, owners=frozenset({0}))
    stream = metered(inner, slot.request())
    assert stream.meta is inner.meta
    seen = [event async for event in stream]
    assert seen == events
    snap = slot.snapshot()
    assert snap["ttft_ms"]["last"] == pytest.approx(500.0)
    assert snap["tokens_out"] == 13  # usage: 4 + 9 (counted live: 2 + 2 + 1 + 2 = 7)
    assert snap["tokens_in"] == 7  # one prompt owner
    assert (snap["requests"], snap["errors"], snap["in_flight"], snap["queued"]) == (1, 0, 0, 0)
    await stream.aclose()  # after the end: passes through, counts nothing twice
    assert inner.closed == 1
    assert slot.snapshot()["requests"] == 1
    assert sample(metrics, "sluice_request_duration_seconds_sum", slot="a") == pytest.approx(1.4)


async def test_metered_live_count_without_usage() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    events: list[Event] = [
        Start(0, 5),
        TextDelta(0, "ab", token_count=2),
        ReasoningDelta(0, "c"),
        Finish(0, "stop"),
    ]
    _ = [event async for event in metered(Scripted(events, clock), slot.request())]
    assert (slot.tokens_out, slot.tokens_in, slot.requests, slot.errors) == (3, 5, 1, 0)


async def test_metered_error_event_is_a_slot_error() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "upstream")
    events: list[Event] = [Start(0, 3), ErrorEvent(RuntimeError("upstream died"))]
    stream = metered(Scripted(events, clock), slot.request())
    async for event in stream:
        if isinstance(event, ErrorEvent):
            # finished at the error itself, before the consumer reacts
            assert (slot.requests, slot.errors, slot.in_flight, slot.queued) == (1, 1, 0, 0)
    await stream.aclose()
    assert (slot.requests, slot.errors, slot.tokens_in) == (1, 1, 3)
    assert sample(metrics, "sluice_requests_total", slot="a", outcome="error") == 1
    assert sample(metrics, "sluice_requests_total", slot="a", outcome="ok") == 0


async def test_metered_backend_exception_is_a_slot_error() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "upstream")
    inner = Scripted([Start(0, 3)], clock, raise_at_end=RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        _ = [event async for event in metered(inner, slot.request())]
    assert (slot.requests, slot.errors, slot.in_flight) == (1, 1, 0)


async def test_metered_early_aclose_is_not_an_error() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    events: list[Event] = [
        Start(0, 6),
        TextDelta(0, "a", token_count=1),
        TextDelta(0, "b", token_count=1),
        TextDelta(0, "c", token_count=1),
        Finish(0, "stop", Usage(0, 6, 3)),
    ]
    inner = Scripted(events, clock)
    stream = metered(inner, slot.request())
    async for event in stream:
        if isinstance(event, TextDelta) and event.text == "b":
            break  # the client went away
    await stream.aclose()
    await stream.aclose()
    assert inner.closed == 2
    snap = slot.snapshot()
    assert (snap["requests"], snap["errors"], snap["in_flight"], snap["queued"]) == (1, 0, 0, 0)
    assert (snap["tokens_in"], snap["tokens_out"]) == (6, 2)  # Start's prompt, live count


async def test_metered_aclose_before_any_token_leaves_the_queue() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    stream = metered(Scripted([Start(0, 2)], clock), slot.request())
    await stream.aclose()
    assert (slot.queued, slot.in_flight, slot.requests, slot.errors) == (0, 0, 1, 0)
    assert slot.snapshot()["ttft_ms"]["last"] is None


async def test_metered_partial_usage_keeps_the_live_count() -> None:
    metrics, clock = make()
    slot = metrics.slot("a", "local")
    events: list[Event] = [
        TextDelta(0, "a", token_count=2),
        TextDelta(1, "b", token_count=3),
        Finish(0, "stop", Usage(0, 4, 10)),
    ]
    stream = metered(Scripted(events, clock, choices=2), slot.request())
    _ = [event async for event in stream]
    # choice 1 never reported usage: 10 + ? is unknown, so the live 5 stands
    assert (slot.tokens_out, slot.tokens_in) == (5, 4)


# -- OpenAIChunkTap -------------------------------------------------------------------


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "chat",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def test_tap_keys_ttft_to_content_not_the_role_chunk() -> None:
    metrics, clock = make()
    slot = metrics.slot("up", "upstream")
    tap = OpenAIChunkTap(slot.request())
    clock.advance(0.2)
    tap.chunk(chat_chunk({"role": "assistant", "content": ""}))
    assert slot.queued == 1
    clock.advance(0.3)
    tap.chunk(chat_chunk({"content": "Hello"}))
    tap.chunk(chat_chunk({"content": " world"}))
    tap.chunk(chat_chunk({}, finish="stop"))
    assert slot.tokens_out == 2
    usage_chunk = chat_chunk({})
    usage_chunk["choices"] = []
    usage_chunk["usage"] = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    tap.chunk(usage_chunk)
    tap.finish()
    tap.finish()
    snap = slot.snapshot()
    assert snap["ttft_ms"]["last"] == pytest.approx(500.0)
    assert (snap["tokens_in"], snap["tokens_out"]) == (11, 3)
    assert (snap["requests"], snap["errors"], snap["in_flight"], snap["queued"]) == (1, 0, 0, 0)


def test_tap_counts_reasoning_tool_calls_and_choices() -> None:
    metrics, _ = make()
    slot = metrics.slot("up", "upstream")
    tap = OpenAIChunkTap(slot.request())
    tap.chunk(chat_chunk({"reasoning_content": "think"}))
    tap.chunk(chat_chunk({"reasoning": "more"}))
    tap.chunk(chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}))
    tap.chunk(chat_chunk({"tool_calls": []}))  # nothing in it
    two = chat_chunk({"content": "a"})
    two["choices"].append({"index": 1, "delta": {"content": "b"}, "finish_reason": None})
    two["choices"].append({"index": 2, "delta": {"role": "assistant"}, "finish_reason": None})
    tap.chunk(two)
    tap.finish()
    assert slot.tokens_out == 5  # no usage: the live count stands
    assert slot.tokens_in == 0


def test_tap_completions_text() -> None:
    metrics, clock = make()
    slot = metrics.slot("up", "upstream")
    tap = OpenAIChunkTap(slot.request())
    for text in ["", "Once", " upon"]:
        clock.advance(0.1)
        tap.chunk({"object": "text_completion", "choices": [{"index": 0, "text": text}]})
    tap.finish()
    assert slot.tokens_out == 2
    assert slot.snapshot()["ttft_ms"]["last"] == pytest.approx(200.0)


def test_tap_error_object_is_an_error() -> None:
    metrics, _ = make()
    slot = metrics.slot("up", "upstream")
    tap = OpenAIChunkTap(slot.request())
    tap.chunk(chat_chunk({"content": "a"}))
    tap.chunk({"error": {"message": "out of memory", "type": "server_error"}})
    tap.finish()
    assert (slot.requests, slot.errors) == (1, 1)
    tap2 = OpenAIChunkTap(slot.request())
    tap2.finish(error=True)  # a transport failure
    assert (slot.requests, slot.errors, slot.queued) == (2, 2, 0)


def test_tap_non_streaming_body() -> None:
    metrics, clock = make()
    slot = metrics.slot("up", "upstream")
    tap = OpenAIChunkTap(slot.request())
    clock.advance(1.5)
    tap.body(
        {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32},
        }
    )
    tap.finish()
    snap = slot.snapshot()
    assert snap["ttft_ms"]["last"] == pytest.approx(1500.0)
    assert (snap["tokens_in"], snap["tokens_out"], snap["errors"]) == (20, 12, 0)
    assert snap["tokens_per_second"] == 12.0


# -- Prometheus -----------------------------------------------------------------------


def test_prometheus_exposition() -> None:
    metrics, clock = make()
    local = metrics.slot("qwen", "local")
    up = metrics.slot("llama", "upstream")
    meter = local.request()
    clock.advance(0.03)
    meter.first_token()
    meter.tokens(4)
    clock.advance(0.97)
    meter.finish(prompt_tokens=10)
    up.request().finish(error=True)
    up.request()  # still queued
    found = samples(metrics)

    def get(name: str, **labels: str) -> float:
        return found[(name, tuple(sorted(labels.items())))]

    assert get("sluice_requests_total", slot="qwen", outcome="ok") == 1
    assert get("sluice_requests_total", slot="llama", outcome="error") == 1
    assert get("sluice_tokens_total", slot="qwen", direction="in") == 10
    assert get("sluice_tokens_total", slot="qwen", direction="out") == 4
    assert get("sluice_in_flight", slot="llama") == 1
    assert get("sluice_queued", slot="llama") == 1
    assert get("sluice_in_flight", slot="qwen") == 0
    assert get("sluice_tokens_per_second", slot="qwen") == pytest.approx(4.0)
    assert get("sluice_slot_info", slot="llama", kind="upstream") == 1
    assert get("sluice_time_to_first_token_seconds_count", slot="qwen") == 1
    assert get("sluice_time_to_first_token_seconds_sum", slot="qwen") == pytest.approx(0.03)
    assert get("sluice_time_to_first_token_seconds_bucket", slot="qwen", le="0.025") == 0
    assert get("sluice_time_to_first_token_seconds_bucket", slot="qwen", le="0.05") == 1
    assert get("sluice_request_duration_seconds_count", slot="qwen") == 1
    assert get("sluice_request_duration_seconds_sum", slot="qwen") == pytest.approx(1.0)
    assert get("sluice_request_duration_seconds_count", slot="llama") == 1


def test_each_app_has_its_own_registry() -> None:
    first, _ = make()
    second, _ = make()
    first.slot("a", "local").request().finish()
    assert ("sluice_requests_total", (("outcome", "ok"), ("slot", "a"))) not in samples(second)
    assert first.slot("a", "upstream").kind == "upstream"  # get, not a second slot
    assert list(first.snapshot()) == ["a"]


def test_metrics_endpoint() -> None:
    metrics, _ = make()
    metrics.slot("a", "local").request().finish(prompt_tokens=2)
    app = Starlette(routes=[Route("/metrics", metrics_endpoint)])
    app.state.sluice = SimpleNamespace(metrics=metrics)
    with TestClient(app) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert families["sluice_tokens"].samples[0].value == 2
