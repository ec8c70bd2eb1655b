"""Requests in flight: every response being generated now, and a way to stop one.

Every stream a slot opens (``SlotLease.open``, local and upstream alike) is
tracked from the moment it opens until its meter finishes. The dialect that
answers names it with the response id its client already has
(``chatcmpl-...``, ``msg_...``, ``resp_...``) through :func:`identify`; a
stream no dialect names (Ollama's answers carry no id) keeps a ``req_`` id.
Who asked comes from :data:`CALLER`, which the app sets per HTTP request (the
API key's name and the dialect of the path); background work started by a
request (a Responses run) inherits it.

Example::

    flights = Flights()
    stream = flights.track(metered_stream, slot="smollm2")   # in SlotLease.open
    identify(stream, "chatcmpl-abc")                           # in the dialect
    flights.list(key="alice")                                  # what alice has running
    flights.cancel("chatcmpl-abc")                             # ends it with an error
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sluice.core.errors import RequestCancelled, SluiceError
from sluice.core.interrupt import Interrupt
from sluice.models.limits import Gate


class Meter(Protocol):
    """What a flight reads of its meter (``metrics.RequestMeter``)."""

    @property
    def admitted(self) -> float: ...

    @property
    def counted(self) -> int: ...

    @property
    def finished(self) -> bool: ...

    def tokens_per_second(self, now: float) -> float | None: ...


class Live(Protocol):
    """What a request in flight is made of: a metered stream (``metrics.MeteredStream``),
    an upstream's answer passed through unchanged (``upstream.backend.Passthrough``), or
    a request waiting for its model to load (:class:`Waiting`)."""

    on_end: Callable[[], None] | None
    flight: Any

    @property
    def meter(self) -> Meter: ...

    @property
    def model(self) -> str: ...

    @property
    def replica(self) -> str | None: ...

    @property
    def state(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    def cancel(self, error: SluiceError) -> bool: ...


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request came from: the API key's name ("" without keys) and its dialect."""

    key: str = ""
    dialect: str = "internal"
    gate: Gate | None = None  # its key's limits, when the key has any (models/limits.py)


CALLER: ContextVar[Caller] = ContextVar("sluice_caller", default=Caller())  # noqa: B039 - frozen


class Flight:
    """One response in flight: its stream and who asked for it."""

    __slots__ = ("caller", "created_at", "id", "registry", "slot", "stream")

    def __init__(
        self,
        registry: Flights,
        stream: Live,
        slot: str,
        caller: Caller,
        flight_id: str,
    ) -> None:
        self.registry = registry
        self.stream = stream
        self.slot = slot
        self.caller = caller
        self.id = flight_id
        self.created_at = time.time()

    def snapshot(self, now: float) -> dict[str, Any]:
        """The JSON of ``GET /v1/requests``; ``now`` on the metrics' clock."""
        stream = self.stream
        meter = stream.meter
        age = max(now - meter.admitted, 0.0)
        generated = meter.counted
        rate = meter.tokens_per_second(now)
        return {
            "id": self.id,
            "object": "request",
            "model": stream.model,
            "slot": self.slot,
            "replica": stream.replica,
            "dialect": self.caller.dialect,
            "key": self.caller.key,
            "state": stream.state,
            "prompt_tokens": stream.prompt_tokens,
            "generated_tokens": generated,
            "tokens_per_second": None if rate is None else round(rate, 2),
            "age_seconds": round(age, 3),
            "created_at": int(self.created_at),
        }


@dataclass(slots=True)
class _Waited:
    """The meter of a request that has no stream yet: nothing generated."""

    admitted: float
    counted: int = 0
    finished: bool = False

    def tokens_per_second(self, now: float) -> float | None:
        return None


class Waiting:
    """A request waiting for its model to load, before any stream: ``queued``, and
    cancellable (:meth:`wait` raises the error). :meth:`end` when the wait is over.

    Example::

        waiting = Waiting("gemma3-270m", clock)
        flights.track(waiting, "gemma-3-270m")
        try:
            lease = await waiting.wait(lambda: registry.acquire("gemma3-270m"))
        finally:
            waiting.end()
    """

    __slots__ = ("_interrupt", "flight", "meter", "model", "on_end")

    replica = None
    state = "queued"
    prompt_tokens = 0

    def __init__(self, model: str, clock: Callable[[], float]) -> None:
        self.model = model
        self.meter = _Waited(clock())
        self.on_end: Callable[[], None] | None = None
        self.flight: Any = None
        self._interrupt = Interrupt()

    async def wait(self, start: Callable[[], Awaitable[T]]) -> T:
        return await self._interrupt.wait(start)

    def cancel(self, error: SluiceError) -> bool:
        return not self.meter.finished and self._interrupt.fire(error)

    def end(self) -> None:
        if not self.meter.finished:
            self.meter.finished = True
            if self.on_end is not None:
                self.on_end()


class Flights:
    """The registry of requests in flight (event-loop only, like the streams)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._by_id: dict[str, Flight] = {}

    def track(self, stream: Live, slot: str) -> None:
        """List ``stream`` until its meter finishes (its ``on_end``)."""
        if stream.meter.finished:
            return
        flight = Flight(self, stream, slot, CALLER.get(), "req_" + secrets.token_hex(12))
        self._by_id[flight.id] = flight
        stream.flight = flight
        stream.on_end = lambda: self._drop(flight)

    def rename(self, flight: Flight, flight_id: str) -> None:
        """Name ``flight`` by the id its client knows (the last stream named so wins)."""
        if flight.id == flight_id or self._by_id.get(flight.id) is not flight:
            return
        del self._by_id[flight.id]
        flight.id = flight_id
        self._by_id[flight_id] = flight

    def _drop(self, flight: Flight) -> None:
        if self._by_id.get(flight.id) is flight:
            del self._by_id[flight.id]

    def now(self) -> float:
        return self._clock()

    def list(self, key: str | None) -> list[dict[str, Any]]:
        """Every flight, oldest first, or only those of the key named ``key``."""
        now = self._clock()
        flights = [f for f in self._by_id.values() if key is None or f.caller.key == key]
        flights.sort(key=lambda f: f.stream.meter.admitted)
        return [f.snapshot(now) for f in flights]

    def get(self, flight_id: str) -> Flight | None:
        return self._by_id.get(flight_id)

    def cancel(self, flight: Flight, by: str) -> bool:
        """End ``flight``'s stream with a ``request_cancelled`` error; False if it had ended."""
        who = f" by the key '{by}'" if by else ""
        error = RequestCancelled(f"This request was cancelled{who} (POST /v1/requests/.../cancel).")
        return flight.stream.cancel(error)

    def __len__(self) -> int:
        return len(self._by_id)


def identify(stream: object, response_id: str | None) -> None:
    """Name the flight of ``stream`` (from ``SlotLease.open``) by ``response_id``."""
    flight = getattr(stream, "flight", None)
    if response_id and isinstance(flight, Flight):
        flight.registry.rename(flight, response_id)
