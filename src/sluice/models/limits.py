"""Limits per API key: requests and tokens a minute, streams at once, a token budget, and
the models a key may use (the config file's ``[keys]`` table).

::

    [keys]
    ci = { key = "sk-ci-key-0001", rpm = 60, tpm = 200000, max_streams = 4,
           token_budget = 2000000, budget_period = "day", models = ["qwen-coder"] }

How each limit is counted:

* ``rpm``: requests that reached a model in any 60 seconds (a sliding window: the
  ``rpm + 1``-th within a minute waits until the oldest is a minute old). A request is
  counted once however many model calls it makes (tool rounds, a ``/c1`` turn).
* ``tpm``: prompt and completion tokens of the requests that ended in the last 60
  seconds. A request is admitted while the key is under its limit; its own tokens count
  once it ends (nobody knows them before).
* ``max_streams``: requests in flight at once (a background response counts until it
  ends).
* ``token_budget`` per ``budget_period`` (``"day"`` and ``"month"`` start at midnight
  UTC; ``"total"`` never resets): prompt and completion tokens, from the usage ledger
  (``models/usage.py``), so a restart does not refill it.
* ``models``: the names (or aliases) the key may ask for; any other is answered as the
  dialect answers a model nobody serves.

Past a limit: :class:`~sluice.core.errors.RateLimited` (429, ``Retry-After``), in the
shape of the dialect the request came in on. Rate-limit headers go out on every answer
to a limited key: OpenAI's ``x-ratelimit-*`` and Anthropic's ``anthropic-ratelimit-*``.

With a shared store (PostgreSQL) the minute counters are the database's, and each
stream in flight holds a lease there (:class:`StreamLeases`), so ``rpm``, ``tpm`` and
``max_streams`` hold across every instance on it; otherwise they are kept in memory.

Example::

    limiter = Limiter({"ci": KeyLimits(rpm=5)}, MemoryCounters())
    gate = limiter.gate("ci")          # None for a key without limits
    await gate.admit("qwen-coder")     # RateLimited on the 6th within a minute
    gate.release()                     # the request ended
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sluice.config.file import ConfigError, describe_value
from sluice.core.errors import BudgetSpent, RateLimited, TokensLimited

log = logging.getLogger("sluice.limits")

WINDOW = 60.0  # seconds: rpm and tpm are "a minute"
PERIODS = ("day", "month", "total")
LIMIT_FIELDS = ("rpm", "tpm", "max_streams", "token_budget", "budget_period", "models")


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One key's limits; ``None``: not limited."""

    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None
    token_budget: int | None = None
    budget_period: str = "total"
    models: frozenset[str] | None = None

    def __bool__(self) -> bool:
        return any(
            v is not None
            for v in (self.rpm, self.tpm, self.max_streams, self.token_budget, self.models)
        )

    def allows(self, names: Iterable[str]) -> bool:
        """Whether a request naming (or resolving to) any of ``names`` may go ahead."""
        return self.models is None or any(n in self.models for n in names)


def parse_limits(source: str, name: str, entry: Mapping[str, Any]) -> KeyLimits:
    """The limit fields of a ``[keys]`` entry, checked; a :class:`ConfigError` naming
    ``source`` and the key's name (never the key) for anything wrong."""
    counts: dict[str, int | None] = {}
    for field in ("rpm", "tpm", "max_streams", "token_budget"):
        value = entry.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(
                f"{source}: {name!r}: {field} must be a whole number of at least 1, "
                f"not {describe_value(value)}"
            )
        counts[field] = value
    period = entry.get("budget_period", "total")
    if period not in PERIODS:
        raise ConfigError(
            f"{source}: {name!r}: budget_period must be "
            + ", ".join(f'"{p}"' for p in PERIODS)
            + f", not {describe_value(period)}"
        )
    if "budget_period" in entry and counts["token_budget"] is None:
        raise ConfigError(f"{source}: {name!r} has a budget_period but no token_budget")
    models = entry.get("models")
    if models is not None:
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise ConfigError(
                f"{source}: {name!r} has models = {describe_value(models)}: a list of model names"
            )
        models = frozenset(models)
    return KeyLimits(
        rpm=counts["rpm"],
        tpm=counts["tpm"],
        max_streams=counts["max_streams"],
        token_budget=counts["token_budget"],
        budget_period=period,
        models=models,
    )


class Counters(Protocol):
    """The minute counters: kept in memory (:class:`MemoryCounters`), or by a shared
    store (PostgreSQL), so that limits hold across the instances that share it."""

    async def take_request(self, key: str, *, limit: int, window: float, now: float) -> float:
        """Record one request of ``key`` at ``now`` if fewer than ``limit`` were taken in
        the last ``window`` seconds (0.0), else the seconds until the oldest leaves it."""
        ...

    async def add_tokens(self, key: str, tokens: int, now: float) -> None: ...

    async def tokens_since(self, key: str, since: float) -> tuple[int, float | None]:
        """Tokens recorded after ``since``, and when the oldest of them was recorded."""
        ...


class StreamLeases(Protocol):
    """Streams in flight counted by a shared store, across the instances on it."""

    async def take_stream(self, key: str, limit: int) -> int | None:
        """A lease on one of ``key``'s ``limit`` streams (its id); None if all are held."""
        ...

    async def drop_stream(self, lease: int) -> None: ...


class MemoryCounters:
    """:class:`Counters` in this process's memory (one instance: the SQLite default).
    Each key's tokens keep a running sum, so a check costs what has expired, not what
    the minute holds."""

    def __init__(self) -> None:
        self._requests: dict[str, deque[float]] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}
        self._token_sums: dict[str, int] = {}

    def requests_in(self, key: str, since: float) -> tuple[int, float | None]:
        """Requests taken after ``since``, and the newest one's time."""
        taken = self._requests.get(key)
        if not taken:
            return 0, None
        _drop_before(taken, since)
        return len(taken), (taken[-1] if taken else None)

    async def take_request(self, key: str, *, limit: int, window: float, now: float) -> float:
        taken = self._requests.setdefault(key, deque())
        _drop_before(taken, now - window)
        if len(taken) >= limit:
            return max(taken[0] + window - now, 0.001)
        taken.append(now)
        return 0.0

    async def add_tokens(self, key: str, tokens: int, now: float) -> None:
        self.note_tokens(key, tokens, now)

    def note_tokens(self, key: str, tokens: int, now: float) -> None:
        if tokens > 0:
            self._tokens.setdefault(key, deque()).append((now, tokens))
            self._token_sums[key] = self._token_sums.get(key, 0) + tokens

    async def tokens_since(self, key: str, since: float) -> tuple[int, float | None]:
        return self.tokens_in(key, since)

    def tokens_in(self, key: str, since: float) -> tuple[int, float | None]:
        """:meth:`tokens_since`, without a wait; also the newest record's time."""
        used = self._tokens.get(key)
        if not used:
            return 0, None
        total = self._token_sums[key]
        while used and used[0][0] <= since:
            total -= used.popleft()[1]
        self._token_sums[key] = total
        return total, (used[0][0] if used else None)


def _drop_before(times: deque[float], since: float) -> None:
    while times and times[0] <= since:
        times.popleft()


def period_start(period: str, now: float) -> str | None:
    """The first day (``YYYY-MM-DD``, UTC) of the budget period that holds ``now``;
    None for ``"total"``."""
    day = datetime.fromtimestamp(now, UTC).date()
    if period == "day":
        return day.isoformat()
    if period == "month":
        return day.replace(day=1).isoformat()
    return None


def period_end(period: str, now: float) -> float | None:
    """When the budget period that holds ``now`` ends (a timestamp); None: never."""
    day = datetime.fromtimestamp(now, UTC).date()
    if period == "day":
        end = day + timedelta(days=1)
    elif period == "month":
        end = (day.replace(day=28) + timedelta(days=4)).replace(day=1)
    else:
        return None
    return datetime(end.year, end.month, end.day, tzinfo=UTC).timestamp()


# What a key has spent since a day ("YYYY-MM-DD"; None: ever): the usage ledger's figure.
Spent = Callable[[str, str | None], Awaitable[int]]


class Limiter:
    """Every key's limits and their counters.

    ``spent(key, since_day)`` reads a key's tokens from the usage ledger (budgets);
    ``shared``: the counters are a store's that other instances write too, so the
    budget is re-read every ``refresh`` seconds rather than kept in memory.
    """

    def __init__(
        self,
        limits: Mapping[str, KeyLimits],
        counters: Counters,
        spent: Spent | None = None,
        *,
        shared: bool = False,
        clock: Callable[[], float] = time.time,
        refresh: float = 2.0,
    ) -> None:
        self.limits = {name: lim for name, lim in limits.items() if lim}
        self.counters = counters
        self.spent = spent
        self.shared = shared
        self._clock = clock
        self._refresh = refresh
        self._streams: dict[str, int] = {}
        # key -> [period's first day, tokens spent in it, when read]
        self._budgets: dict[str, list[Any]] = {}
        self._local = counters if isinstance(counters, MemoryCounters) else MemoryCounters()
        self._unsent: list[tuple[str, int, float]] = []
        # Set with a shared store: max_streams then holds across its instances too.
        self.leases: StreamLeases | None = None
        self._dropping: set[asyncio.Task[None]] = set()

    def __bool__(self) -> bool:
        return bool(self.limits)

    def gate(self, key: str, dialect: str = "") -> Gate | None:
        """A request's pass through ``key``'s limits; None when the key has none.
        ``dialect`` (as the requests in flight name it) picks the headers' style."""
        limits = self.limits.get(key)
        return None if limits is None else Gate(self, key, limits, STYLES.get(dialect, ""))

    def streams(self, key: str) -> int:
        return self._streams.get(key, 0)

    def charge(self, key: str, tokens: int) -> None:
        """``key`` used ``tokens`` (a request ended): its minute and its budget. A shared
        store hears of them at the next :meth:`flush`."""
        limits = self.limits.get(key)
        if limits is None or tokens <= 0:
            return
        now = self._clock()
        if limits.tpm is not None:
            self._local.note_tokens(key, tokens, now)
            if self._local is not self.counters:
                self._unsent.append((key, tokens, now))
        budget = self._budgets.get(key)
        if budget is not None:
            budget[1] += tokens

    async def flush(self) -> None:
        """Tell a shared store's counters the tokens of the requests that ended since."""
        unsent, self._unsent = self._unsent, []
        for key, tokens, at in unsent:
            await self.counters.add_tokens(key, tokens, at)

    async def _admit(self, gate: Gate) -> None:
        key, limits = gate.key, gate.limits
        now = self._clock()
        if limits.max_streams is not None and self.streams(key) >= limits.max_streams:
            raise RateLimited(
                f"The key '{key}' has {limits.max_streams} request(s) in flight, its "
                "max_streams; retry when one ends.",
                1.0,
                self.headers(gate.style, key, limits, now),
            )
        # Held before the checks that wait for a store, so two at once cannot both pass.
        self._streams[key] = self.streams(key) + 1
        try:
            if limits.max_streams is not None and self.leases is not None:
                gate.lease = await self.leases.take_stream(key, limits.max_streams)
                if gate.lease is None:
                    raise RateLimited(
                        f"The key '{key}' has {limits.max_streams} request(s) in flight "
                        "across the sluice instances, its max_streams; retry when one ends.",
                        1.0,
                        self.headers(gate.style, key, limits, now),
                    )
            await self._check(gate, now)
        except BaseException:
            self._release(gate)
            raise
        gate.headers = self.headers(gate.style, key, limits, now)

    async def _check(self, gate: Gate, now: float) -> None:
        key, limits = gate.key, gate.limits
        if limits.token_budget is not None:
            spent = await self._budget(key, limits, now)
            if spent >= limits.token_budget:
                end = period_end(limits.budget_period, now)
                when = "" if end is None else " until the period ends"
                raise BudgetSpent(
                    f"The key '{key}' has spent its token budget ({spent} of "
                    f"{limits.token_budget} tokens, per {limits.budget_period}){when}.",
                    None if end is None else end - now,
                    self.headers(gate.style, key, limits, now),
                )
        if limits.tpm is not None:
            used, oldest = await self.counters.tokens_since(key, now - WINDOW)
            if used >= limits.tpm:
                wait = (oldest or now) + WINDOW - now
                raise TokensLimited(
                    f"The key '{key}' used {used} tokens in the last minute, its tpm "
                    f"limit is {limits.tpm}; retry in {wait:.1f}s.",
                    wait,
                    self.headers(gate.style, key, limits, now),
                )
        if limits.rpm is not None:
            wait = await self.counters.take_request(key, limit=limits.rpm, window=WINDOW, now=now)
            if wait > 0:
                raise RateLimited(
                    f"The key '{key}' made {limits.rpm} requests in the last minute, its "
                    f"rpm limit; retry in {wait:.1f}s.",
                    wait,
                    self.headers(gate.style, key, limits, now),
                )
            if self._local is not self.counters:  # this instance's view, for the headers
                await self._local.take_request(key, limit=1 << 30, window=WINDOW, now=now)

    def _release(self, gate: Gate) -> None:
        key = gate.key
        left = self.streams(key) - 1
        if left > 0:
            self._streams[key] = left
        else:
            self._streams.pop(key, None)
        lease, gate.lease = gate.lease, None
        if lease is not None and self.leases is not None:
            task = asyncio.ensure_future(self._drop(self.leases, lease))
            self._dropping.add(task)
            task.add_done_callback(self._dropping.discard)

    @staticmethod
    async def _drop(leases: StreamLeases, lease: int) -> None:
        try:
            await leases.drop_stream(lease)
        except Exception:
            log.warning("a stream's lease could not be dropped", exc_info=True)

    async def settle(self) -> None:
        """Until the leases of the streams that ended are dropped (shutdown)."""
        while self._dropping:
            await asyncio.gather(*self._dropping, return_exceptions=True)

    async def _budget(self, key: str, limits: KeyLimits, now: float) -> int:
        since = period_start(limits.budget_period, now)
        budget = self._budgets.get(key)
        stale = budget is None or budget[0] != since
        if not stale and self.shared and now - budget[2] > self._refresh:  # type: ignore[index]
            stale = True
        if stale:
            spent = 0 if self.spent is None else await self.spent(key, since)
            budget = self._budgets[key] = [since, spent, now]
        assert budget is not None
        return int(budget[1])

    def headers(self, style: str, key: str, limits: KeyLimits, now: float) -> dict[str, str]:
        """The rate-limit headers of ``style`` (``"openai"``, ``"anthropic"``; else
        none) for ``key`` now: this instance's view of its minute."""
        if style not in ("openai", "anthropic") or (limits.rpm is None and limits.tpm is None):
            return {}
        out: dict[str, str] = {}
        if limits.rpm is not None:
            count, newest = self._local.requests_in(key, now - WINDOW)
            reset = 0.0 if newest is None else max(newest + WINDOW - now, 0.0)
            _put(out, style, "requests", limits.rpm, limits.rpm - count, reset, now)
        if limits.tpm is not None:
            used, _ = self._local.tokens_in(key, now - WINDOW)
            records = self._local._tokens.get(key)
            reset = max(records[-1][0] + WINDOW - now, 0.0) if records else 0.0
            _put(out, style, "tokens", limits.tpm, limits.tpm - used, reset, now)
        return out


def _put(
    out: dict[str, str],
    style: str,
    what: str,
    limit: int,
    remaining: int,
    reset: float,
    now: float,
) -> None:
    remaining = max(remaining, 0)
    if style == "openai":
        out[f"x-ratelimit-limit-{what}"] = str(limit)
        out[f"x-ratelimit-remaining-{what}"] = str(remaining)
        out[f"x-ratelimit-reset-{what}"] = duration(reset)
    else:
        at = datetime.fromtimestamp(math.ceil(now + reset), UTC)
        out[f"anthropic-ratelimit-{what}-limit"] = str(limit)
        out[f"anthropic-ratelimit-{what}-remaining"] = str(remaining)
        out[f"anthropic-ratelimit-{what}-reset"] = at.isoformat().replace("+00:00", "Z")


def duration(seconds: float) -> str:
    """OpenAI's reset format: ``"0s"``, ``"250ms"``, ``"12.5s"``, ``"1m0s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


# The rate-limit headers' style by dialect (as models.flights.Caller names it).
STYLES = {"openai": "openai", "responses": "openai", "gateway": "openai", "anthropic": "anthropic"}


class Gate:
    """One HTTP request's pass through its key's limits.

    :meth:`admit` is called where a request reaches a model (the dispatcher); only the
    first call counts (a request with several model calls is one request). The server
    :meth:`release`\\ s it when the response has been sent; whoever carries the work on
    past that (a background response) :meth:`hold`\\ s it first and releases it at its end.
    ``headers``: the rate-limit headers for the answer, once admitted.
    """

    __slots__ = ("_holds", "admitted", "headers", "key", "lease", "limiter", "limits", "style")

    def __init__(self, limiter: Limiter, key: str, limits: KeyLimits, style: str = "") -> None:
        self.limiter = limiter
        self.key = key
        self.limits = limits
        self.style = style
        self.admitted = False
        self.headers: dict[str, str] = {}
        self.lease: int | None = None  # its stream's, with a shared store
        self._holds = 1

    async def admit(self) -> None:
        if self.admitted:
            return
        await self.limiter._admit(self)
        self.admitted = True

    def hold(self) -> None:
        self._holds += 1

    def release(self) -> None:
        self._holds -= 1
        if self._holds == 0 and self.admitted:
            self.limiter._release(self)
