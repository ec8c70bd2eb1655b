"""Requests in flight, on scripted streams: state, counts, naming, and cancelling a
stream whether its consumer is waiting for the next event or busy elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from sluice.core.backend import StreamMeta
from sluice.core.errors import RequestCancelled
from sluice.core.events import ErrorEvent, Event, Finish, Progress, Start, TextDelta, Usage
from sluice.metrics import Metrics, metered
from sluice.models.flights import CALLER, Caller, Flights, identify


class Gated:
    """A ResponseStream that yields each event only when the test lets it through."""

    def __init__(self) -> None:
        self.meta = StreamMeta(model="m", choices=1, prompt_owners=frozenset({0}), slot="s")
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.closed = 0

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._run()

    async def _run(self) -> AsyncIterator[Event]:
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, Finish):
                return

    async def aclose(self) -> None:
        self.closed += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[Flights, Metrics, Clock]:
    clock = Clock()
    metrics = Metrics(clock=clock)
    return Flights(metrics.clock), metrics, clock


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_flight_goes_queued_prefilling_generating_then_away() -> None:
    flights, metrics, clock = make()
    inner = Gated()
    token = CALLER.set(Caller("alice", "openai"))
    try:
        stream = metered(inner, metrics.slot("s", "local").request())
        flights.track(stream, "s")
    finally:
        CALLER.reset(token)
    identify(stream, "chatcmpl-1")
    seen: list[Event] = []

    async def consume() -> None:
        async for event in stream:
            seen.append(event)

    task = asyncio.create_task(consume())
    (entry,) = flights.list(None)
    assert (entry["id"], entry["key"], entry["dialect"], entry["state"]) == (
        "chatcmpl-1",
        "alice",
        "openai",
        "queued",
    )
    inner.queue.put_nowait(Start(0, 12))
    inner.queue.put_nowait(Progress(0, "prompt_processing", 0, 12))
    await settle()
    assert flights.list("alice")[0]["state"] == "prefilling"
    assert flights.list("alice")[0]["prompt_tokens"] == 12
    assert flights.list("bob") == []
    for _ in range(5):
        clock.now += 0.5
        inner.queue.put_nowait(TextDelta(0, "x", token_count=1))
        await settle()
    (entry,) = flights.list("alice")
    assert entry["state"] == "generating" and entry["generated_tokens"] == 5
    assert entry["tokens_per_second"] == pytest.approx(2.0)  # 4 tokens after the first in 2 s
    assert entry["age_seconds"] == pytest.approx(2.5)
    inner.queue.put_nowait(Finish(0, "stop", Usage(0, 12, 5)))
    await task
    assert flights.list(None) == [] and flights.get("chatcmpl-1") is None


async def test_cancel_while_the_consumer_waits_ends_it_with_an_error_at_once() -> None:
    flights, metrics, _ = make()
    inner = Gated()
    slot = metrics.slot("s", "local")
    stream = metered(inner, slot.request())
    flights.track(stream, "s")
    identify(stream, "msg_1")
    seen: list[Event] = []

    async def consume() -> None:
        async for event in stream:
            seen.append(event)

    task = asyncio.create_task(consume())
    inner.queue.put_nowait(Start(0, 3))
    await settle()  # the consumer now waits for an event that never comes
    flight = flights.get("msg_1")
    assert flight is not None
    assert flights.cancel(flight, by="admin")
    await asyncio.wait_for(task, 1)
    assert isinstance(seen[-1], ErrorEvent) and isinstance(seen[-1].error, RequestCancelled)
    assert "by the key 'admin'" in str(seen[-1].error)
    assert inner.closed == 1  # the backend was aborted
    assert flights.get("msg_1") is None
    assert slot.snapshot()["in_flight"] == 0 and slot.snapshot()["errors"] == 1
    assert not flights.cancel(flight, by="admin")  # once


async def test_cancel_while_the_consumer_is_busy_ends_it_at_its_next_read() -> None:
    flights, metrics, _ = make()
    inner = Gated()
    stream = metered(inner, metrics.slot("s", "local").request())
    flights.track(stream, "s")
    iterator = aiter(stream)
    inner.queue.put_nowait(Start(0, 3))
    assert isinstance(await anext(iterator), Start)
    # The consumer is between reads (sending the last frame, say): nothing to interrupt.
    flight = flights.get(stream.flight.id)
    assert flight is not None and flights.cancel(flight, by="")
    inner.queue.put_nowait(TextDelta(0, "late", token_count=1))
    last = await anext(iterator)
    assert isinstance(last, ErrorEvent) and isinstance(last.error, RequestCancelled)
    with pytest.raises(StopAsyncIteration):
        await anext(iterator)
    assert inner.closed == 1


async def test_a_cancellation_from_elsewhere_still_propagates() -> None:
    flights, metrics, _ = make()
    inner = Gated()
    stream = metered(inner, metrics.slot("s", "local").request())
    flights.track(stream, "s")

    async def consume() -> None:
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    await settle()
    task.cancel()  # the client went away: not ours to swallow
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(flights) == 0


async def test_the_last_stream_named_keeps_the_name() -> None:
    flights, metrics, _ = make()
    slot = metrics.slot("s", "local")
    first = metered(Gated(), slot.request())
    flights.track(first, "s")
    identify(first, "resp_1")
    await first.aclose()  # a tool round ended
    second = metered(Gated(), slot.request())
    flights.track(second, "s")
    identify(second, "resp_1")
    flight = flights.get("resp_1")
    assert flight is not None and flight.stream is second
    await second.aclose()
    assert len(flights) == 0
