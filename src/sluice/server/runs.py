"""Generations that outlive their request: a replayable log of encoded frames per run.

A *run* is a response generating on the server whatever its clients do: a
background response (the create call returned at once), or a stored stream whose
client may drop and come back. Its frames are kept in order, frame N being the
event of sequence number N, so a client can follow it from any point
(``follow(starting_after)``): the frames already made, then the new ones as they
come. A run ends once; its log is kept ``grace`` seconds more, then forgotten.

A foreground run (not ``background``) whose last follower leaves keeps generating
``grace`` seconds for a follower to come back, then is cancelled: nobody would read
it.

Example::

    run = runs.start("resp_1", owner="alice", background=False, work=generate)
    async for chunk in run.follow(-1):       # from the first frame
        ...
    run = runs.get("resp_1", owner="alice")  # later, on another connection
    async for chunk in run.follow(41):       # frames 42, 43, ...
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sluice.models.flights import CALLER

log = logging.getLogger("sluice.api")


class Run:
    """One run: its frames so far, whether it ended, who follows it."""

    def __init__(
        self, run_id: str, owner: str, background: bool, grace: float, state: Any = None
    ) -> None:
        self.id = run_id
        self.state = state  # what the dialect keeps with the run (its formatter, say)
        self.owner = owner
        self.background = background
        self.grace = grace
        self.frames: list[bytes] = []
        self.done = False
        self.task: asyncio.Task[None] | None = None
        # Given each publish's frames too (a shared store's copy of the events), if set.
        self.tap: Callable[[list[bytes]], None] | None = None
        self._changed = asyncio.Event()
        self._followers = 0
        self._orphaned: asyncio.TimerHandle | None = None

    def publish(self, chunks: list[bytes]) -> None:
        """Append frames (encoded, in sequence order) and wake the followers."""
        if chunks:
            self.frames.extend(chunks)
            if self.tap is not None:
                self.tap(chunks)
            self._wake()

    def finish(self) -> None:
        self.done = True
        if self._orphaned is not None:
            self._orphaned.cancel()
        self._wake()

    def _wake(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[bytes]:
        """Frames ``starting_after + 1`` on: those made so far, then the new ones live,
        to the run's end."""
        index = max(0, starting_after + 1)
        self._followers += 1
        if self._orphaned is not None:
            self._orphaned.cancel()
            self._orphaned = None
        try:
            while True:
                while index < len(self.frames):
                    yield self.frames[index]
                    index += 1
                if self.done:
                    return
                await self._changed.wait()
        finally:
            self._followers -= 1
            if self._followers == 0 and not self.done and not self.background:
                # Nobody reads it now: a client may come back within the grace period.
                loop = asyncio.get_running_loop()
                self._orphaned = loop.call_later(self.grace, self._abandon)

    def _abandon(self) -> None:
        if not self.done and self._followers == 0:
            log.info("response %s: no client came back within %gs, cancelled", self.id, self.grace)
            self.cancel()

    def cancel(self) -> None:
        """Stop the generation (its work stores what it made and ends the run)."""
        if not self.done and self.task is not None:
            self.task.cancel()

    async def wait(self) -> None:
        """Until the run ended."""
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self.task)
        while not self.done:
            await self._changed.wait()


class Runs:
    """The runs of the server, by id, each visible to its owner only."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}
        self._closing = False

    def start(
        self,
        run_id: str,
        *,
        owner: str,
        background: bool,
        grace: float,
        work: Callable[[Run], Awaitable[None]],
        state: Any = None,
    ) -> Run:
        """A new run doing ``work(run)`` as a task; forgotten ``grace`` s after it ends.
        ``state``: the dialect's, kept with the run (``run.state``)."""
        run = Run(run_id, owner, background, grace, state)
        self._runs[run_id] = run
        # The run outlives its request: it holds the key's place among its streams.
        gate = CALLER.get().gate
        if gate is not None:
            gate.hold()

        async def main() -> None:
            try:
                await work(run)
            except asyncio.CancelledError:
                pass  # cancelled: work stored what it had
            except Exception:
                log.exception("response %s failed", run_id)
            finally:
                if gate is not None:
                    gate.release()
                run.finish()
                if not self._closing:
                    asyncio.get_running_loop().call_later(grace, self._runs.pop, run_id, None)

        run.task = asyncio.ensure_future(main())
        return run

    def get(self, run_id: str, *, owner: str) -> Run | None:
        run = self._runs.get(run_id)
        return run if run is not None and run.owner == owner else None

    def forget(self, run_id: str) -> None:
        """Drop a run's log now (its response was deleted)."""
        self._runs.pop(run_id, None)

    async def close(self) -> None:
        """Cancel every run still generating, and wait for them (server shutdown)."""
        self._closing = True
        for run in list(self._runs.values()):
            run.cancel()
        for run in list(self._runs.values()):
            await run.wait()
        self._runs.clear()
