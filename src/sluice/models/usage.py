"""The usage ledger: requests, prompt, cached and completion tokens and errors per API
key, model and day (UTC), kept in the store so they survive restarts.

Every request that reached a model is counted when it ends, with the token counts the
client was sent (a local model's ``usage``; an upstream's, as the slot's metrics read
them). Counts gather in memory and are written every ``interval`` seconds, at
shutdown, and before every read (:meth:`UsageLedger.rows`), so what ``GET /v1/usage``
answers includes the request that just ended. A killed process loses at most the last
interval's counts.

Example::

    ledger = UsageLedger(store, limiter)
    metrics.on_end = ledger.record          # every request's end, from its meter
    await ledger.start()
    ...
    rows = await ledger.rows(key="alice")   # [UsageRow(key="alice", model=..., ...)]
    await ledger.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from sluice.models.limits import Limiter
from sluice.store import ConversationStore, UsageRow

log = logging.getLogger("sluice.usage")

_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")


def day_of(at: float) -> str:
    """``at`` (a timestamp) as its UTC day, ``YYYY-MM-DD``."""
    return _day(int(at // 86400))


@functools.lru_cache(maxsize=4)
def _day(days: int) -> str:  # days since the epoch: every request asks for today's
    return datetime.fromtimestamp(days * 86400, UTC).date().isoformat()


class UsageLedger:
    """Usage counted per (key, model, day), written to ``store`` in batches; each
    request's tokens are charged to its key's limits (``limiter``) as it ends."""

    def __init__(
        self,
        store: ConversationStore,
        limiter: Limiter | None = None,
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._limiter = limiter
        self._interval = interval
        self._clock = clock
        self._pending: dict[tuple[str, str, str], list[int]] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def record(
        self, key: str, model: str, prompt: int, cached: int, completion: int, error: bool
    ) -> None:
        """One request ended (``Metrics.on_end``): count it, charge its key."""
        counts = self._pending.get((key, model, day := day_of(self._clock())))
        if counts is None:
            counts = self._pending[(key, model, day)] = [0, 0, 0, 0, 0]
        counts[0] += 1
        counts[1] += prompt
        counts[2] += cached
        counts[3] += completion
        counts[4] += error
        if self._limiter is not None:
            self._limiter.charge(key, prompt + completion)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sluice-usage")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
            except Exception:  # logged; the counts stay pending for the next try
                log.exception("writing usage failed; retrying in %.0fs", self._interval)

    async def flush(self) -> None:
        """Write what has gathered (one transaction), and the limits' shared counters."""
        async with self._lock:
            pending, self._pending = self._pending, {}
            rows = [UsageRow(k, m, d, *counts) for (k, m, d), counts in pending.items()]
            try:
                if rows:
                    await self._store.add_usage(rows)
            except BaseException:
                for row in rows:  # kept for the next flush: nothing is counted twice
                    self._merge(row)
                raise
            if self._limiter is not None:
                await self._limiter.flush()

    def _merge(self, row: UsageRow) -> None:
        counts = self._pending.setdefault((row.key, row.model, row.day), [0, 0, 0, 0, 0])
        for i, field in enumerate(_FIELDS):
            counts[i] += getattr(row, field)

    async def rows(
        self,
        *,
        key: str | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> list[UsageRow]:
        """The stored totals (after a flush), one row per (key, model, day)."""
        await self.flush()
        return await self._store.usage(key=key, since=since, until=until)

    async def spent(self, key: str, since: str | None) -> int:
        """``key``'s prompt and completion tokens from day ``since`` on (None: ever),
        stored and pending (a :data:`~sluice.models.limits.Spent`)."""
        stored = await self._store.usage(key=key, since=since)
        total = sum(r.prompt_tokens + r.completion_tokens for r in stored)
        for (k, _, day), counts in self._pending.items():
            if k == key and (since is None or day >= since):
                total += counts[1] + counts[3]
        return total

    async def close(self) -> None:
        """Stop the writer and write what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self.flush()
        except Exception:
            log.exception("writing the last usage failed")
