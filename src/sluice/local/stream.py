"""The async side of a generation: engine events arrive on the event loop.

Example::

    stream = EventStream.open(engine, requests, echo_texts={})
    try:
        async for event in stream:
            ...
    finally:
        stream.close()   # aborts the engine work if the client went away
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from sluice.core.events import ErrorEvent, Event, Finish, Start, TextDelta
from sluice.engine.engine import EngineHandle
from sluice.engine.types import EngineRequest, EventSink


class Submitter(Protocol):
    """The part of a backend a stream needs (the local engine, or an upstream)."""

    def submit(self, requests: list[EngineRequest], sink: EventSink) -> EngineHandle: ...

    def abort(self, handle: EngineHandle) -> None: ...


class _Mailbox:
    """One per event loop: the engine's deliveries of a step cost one wake-up.

    The first delivery after a drain schedules the drain; the rest of the
    step's deliveries (one per request) only append.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[_LoopSink, list[Event]]] = []
        self._armed = False

    def post(self, sink: _LoopSink, events: list[Event]) -> None:
        with self._lock:
            self._items.append((sink, events))
            if self._armed:
                return
            self._armed = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._armed = self._items, [], False
        for sink, events in items:
            sink._arrived(events)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
    weakref.WeakKeyDictionary()
)


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = _Mailbox(loop)
    return box


def _no_wake() -> None:
    pass


class _LoopSink:
    """Receives events on the engine thread, hands them to the event loop.

    Backpressure without a lock: two counters, each with one writer (the
    engine thread counts deliveries, the loop counts what it took), so the
    backlog is their difference. Likewise the engine counts its pauses and the
    loop the wake-ups it sent: a pause not yet answered is a difference too,
    and a wake-up is sent at most once per pause, from the loop, when the
    backlog has fallen to ``resume_at``.
    """

    __slots__ = (
        "_loop",
        "_mailbox",
        "_pauses",
        "_posted",
        "_ready",
        "_resume_at",
        "_taken",
        "_waiter",
        "_wake",
        "_wakes",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._mailbox = _mailbox(loop)
        # Deliveries on the loop, and the one reader's future while it waits (a plain
        # deque and future: an asyncio.Queue costs ~10% of the loop's time per token).
        self._ready: deque[list[Event]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._posted = 0  # engine thread
        self._taken = 0  # event loop
        self._pauses = 0  # engine thread
        self._wakes = 0  # event loop
        self._resume_at = 0
        self._wake: Callable[[], None] = _no_wake

    # -- engine thread --------------------------------------------------------

    def put_many(self, events: list[Event]) -> None:
        self._posted += 1
        self._mailbox.post(self, events)

    def backlog(self) -> int:
        return self._posted - self._taken

    def pause(self, resume_at: int, wake: Callable[[], None]) -> None:
        self._resume_at = resume_at
        self._wake = wake
        self._pauses += 1  # last: the loop reads it first
        if self._posted - self._taken <= resume_at:  # the loop caught up meanwhile
            wake()

    # -- event loop -------------------------------------------------------------

    def _arrived(self, events: list[Event]) -> None:
        self._ready.append(events)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> list[Event]:
        while not self._ready:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = self._ready.popleft()
        self._taken += 1
        if self._pauses != self._wakes and self._posted - self._taken <= self._resume_at:
            self._wakes = self._pauses
            self._wake()
        return events


class EventStream:
    """All choices of one response, merged, as one async stream of events.

    Opening submits to the backend at once (so a full queue is an error
    before the first byte); iteration yields :class:`Start` for each choice,
    then the backend's events, and ends after the last :class:`Finish` or the
    first :class:`ErrorEvent`.
    """

    def __init__(
        self,
        backend: Submitter,
        handle: EngineHandle,
        sink: _LoopSink,
        choices: list[tuple[int, int]],
        echo_texts: Mapping[int, str],
    ) -> None:
        self._backend = backend
        self._handle = handle
        self._sink = sink
        self._choices = choices
        self._echo_texts = echo_texts
        self._open = {choice for choice, _ in choices}
        self._done = False

    @classmethod
    def open(
        cls,
        backend: Submitter,
        requests: list[EngineRequest],
        echo_texts: Mapping[int, str] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> EventStream:
        """Submit ``requests``; events arrive on ``loop`` (default: the running one).

        Safe to call from a worker thread when ``loop`` is given, so that
        sampler and grammar set-up stay off the event loop.
        """
        sink = _LoopSink(loop or asyncio.get_running_loop())
        handle = backend.submit(requests, sink)
        choices = [(r.choice, len(r.prompt_tokens)) for r in requests]
        return cls(backend, handle, sink, choices, echo_texts or {})

    async def __aiter__(self) -> AsyncIterator[Event]:
        for choice, n_prompt in self._choices:
            yield Start(choice, n_prompt)
            echo = self._echo_texts.get(choice)
            if echo:
                yield TextDelta(choice, echo, 0, None, echo=True)
        while self._open:
            for event in await self._sink.get():
                yield event
                if isinstance(event, ErrorEvent):
                    # Not done: close() aborts the other choices, which may be paused
                    # (nobody will read them now) rather than failed with this one.
                    return
                if isinstance(event, Finish):
                    self._open.discard(event.choice)
        self._done = True

    def close(self) -> None:
        """Abort whatever is still running (idempotent)."""
        if not self._done:
            self._done = True
            self._backend.abort(self._handle)
