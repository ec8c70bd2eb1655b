"""Background responses served as one by several instances on a shared store (PostgreSQL).

A run's frames live in the memory of the instance generating it (``server/runs.py``).
On a shared store (``store.shared``) this module also makes them, and its cancel,
reachable through every other instance:

* **The relay** (one per process and store, a task only while it has runs): every
  ``FLUSH_EVERY`` seconds it writes the frames its background runs published since
  its last write, all runs' in one transaction (``add_events``), and every
  ``CANCEL_EVERY`` seconds it asks the store which of them another instance was
  asked to cancel, and cancels those as a local cancel would. A run's end waits for
  its frames to be written (:meth:`Relay.drain`) before its response is stored, so a
  response stored as ended has all its events stored. They are deleted when the
  run's grace ends.
* **Following elsewhere** (:func:`follow_stored`): the stored events after
  ``starting_after``, then the new ones as the store announces them (its listener,
  ``EventWatch``), until the stored response has ended and every event is read: the
  bytes the running instance sends its own followers. Without word it looks anyway
  every ``POLL_EVERY`` seconds while the listener is down, every ``POLL_QUIET`` while
  it is up (word lost in between).
* **Cancels heard at once**: a cancel asked through another instance is announced too,
  and the relay cancels its run when it hears of it; the look every ``CANCEL_EVERY``
  seconds stays, for word lost.
* **Cancelling elsewhere** (:func:`cancel_elsewhere`): the cancel is recorded in the
  store, then the stored response is read until it says it ended (``WAIT_ENDED`` s).

SQLite (one process) never comes here: its runs stay in memory only.

Example::

    relay = relay_for(state.runs, state.store)  # None unless the store is shared
    if relay is not None:
        relay.attach(run)  # before its first publish
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any, cast

from sluice.core.frames import Frame
from sluice.server.runs import Run, Runs
from sluice.server.sse import encode
from sluice.store import ConversationStore, RunEvents

log = logging.getLogger("sluice.api")

FLUSH_EVERY = 0.075  # s between the relay's writes of its runs' new frames
CANCEL_EVERY = 0.25  # s between its looks for cancels asked through other instances
DRAIN_TIMEOUT = 5.0  # s a run's end waits at most for its frames to be written
POLL_EVERY = 0.15  # s between a follower's reads of a run elsewhere, the store deaf
POLL_QUIET = 2.0  # s a follower waits for the store's word before it reads anyway
WAIT_ENDED = 5.0  # s a cancel through another instance waits for the run to end

TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}
_TERMINAL_PREFIXES = tuple(f"event: {kind}\n".encode() for kind in TERMINAL.values())


def terminal_frame(body: dict[str, Any], seq: int) -> bytes:
    """The terminal event of a response whose events are no longer kept (past its grace,
    or left by a stopped server), numbered ``seq``, with the response as it ended."""
    kind = TERMINAL.get(str(body.get("status")), "response.failed")
    return encode(Frame({"type": kind, "sequence_number": seq, "response": body}, event=kind))


def folded(body: dict[str, Any], frames: list[bytes]) -> dict[str, Any]:
    """The response as its events so far tell it: what ``GET /v1/responses/{id}`` answers
    through another instance than the one generating it (status and output so far, as
    that instance would answer, as of its last write of events). ``body``: the stored
    response, used until an event carries the response."""
    response = body
    output: list[dict[str, Any]] = []
    for frame in frames:
        try:
            data = json.loads(frame.split(b"\ndata: ", 1)[1])
        except (IndexError, ValueError):
            continue
        kind = data.get("type")
        if isinstance(data.get("response"), dict):
            response = data["response"]
            output = [dict(item) for item in response.get("output") or []]
            continue
        index = data.get("output_index")
        if not isinstance(index, int) or index < 0:
            continue
        if kind in ("response.output_item.added", "response.output_item.done"):
            while len(output) <= index:
                output.append({})
            output[index] = copy.deepcopy(data.get("item") or {})
            continue
        if index >= len(output):
            continue
        item = output[index]
        if kind == "response.content_part.added":
            parts = item.setdefault("content", [])
            at = data.get("content_index", len(parts))
            if isinstance(at, int) and 0 <= at <= len(parts):
                part = copy.deepcopy(data.get("part") or {})
                parts[at : at + 1] = [part]
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            parts = item.get("content") or []
            at = data.get("content_index", 0)
            if isinstance(at, int) and 0 <= at < len(parts):
                parts[at]["text"] = parts[at].get("text", "") + str(data.get("delta", ""))
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] = item.get("arguments", "") + str(data.get("delta", ""))
    return {**response, "output": output}


def _is_terminal(frame: bytes) -> bool:
    return frame.startswith(_TERMINAL_PREFIXES)


class _Entry:
    __slots__ = ("next_seq", "pending", "run", "waiters")

    def __init__(self, run: Run) -> None:
        self.run = run
        self.next_seq = len(run.frames)  # the sequence number of the next frame to write
        self.pending: list[bytes] = []
        self.waiters: list[asyncio.Future[None]] = []


class Relay:
    """A process's background runs, mirrored to the shared store (see the module)."""

    def __init__(self, store: RunEvents) -> None:
        self._store = store
        self._entries: dict[str, _Entry] = {}
        self._task: asyncio.Task[None] | None = None
        self._asked = 0.0  # when it last asked for cancels (monotonic)
        self._pruning: set[asyncio.Task[None]] = set()
        store.on_cancel(self._cancel_heard)

    def attach(self, run: Run) -> None:
        """Mirror ``run``'s frames from now on (attach it before its first publish)."""
        entry = _Entry(run)
        self._entries[run.id] = entry
        run.tap = entry.pending.extend
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name="sluice-run-relay"
            )

    async def drain(self, run: Run) -> None:
        """Until every frame ``run`` published so far is written (``DRAIN_TIMEOUT`` at
        most: a store that fails does not hold the run's end)."""
        entry = self._entries.get(run.id)
        if entry is None:
            return
        waiter = asyncio.get_running_loop().create_future()
        entry.waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiter), DRAIN_TIMEOUT)

    async def _loop(self) -> None:
        while self._entries:
            await asyncio.sleep(FLUSH_EVERY)
            try:
                await self._flush()
                if time.monotonic() - self._asked >= CANCEL_EVERY:
                    self._asked = time.monotonic()
                    await self._cancel_asked()
            except Exception:
                log.warning("relaying background responses to the store failed", exc_info=True)

    async def _flush(self) -> None:
        entries = list(self._entries.values())
        rows: list[tuple[str, int, bytes]] = []
        for entry in entries:
            for frame in entry.pending:
                rows.append((entry.run.id, entry.next_seq, frame))
                entry.next_seq += 1
            entry.pending.clear()  # (the run's tap extends this very list)
        try:
            await self._store.add_events(rows)
        except Exception as exc:  # noqa: BLE001 - those frames stay in memory only
            log.warning("storing %d event(s) of background responses failed: %s", len(rows), exc)
        loop = asyncio.get_running_loop()
        for entry in entries:
            if entry.pending:  # published while this write went: the next one
                continue
            for waiter in entry.waiters:
                if not waiter.done():
                    waiter.set_result(None)
            entry.waiters.clear()
            if entry.run.done:
                del self._entries[entry.run.id]
                loop.call_later(entry.run.grace, self._prune, entry.run.id)

    async def _cancel_asked(self) -> None:
        running = [i for i, e in self._entries.items() if e.run.background and not e.run.done]
        for response_id in await self._store.cancels_requested(running):
            self._cancel_heard(response_id)

    def _cancel_heard(self, response_id: str) -> None:
        """A cancel of ``response_id`` was asked through another instance: if it runs
        here, it ends as a local cancel would."""
        entry = self._entries.get(response_id)
        if entry is not None and entry.run.background and not entry.run.done:
            log.info("response %s: cancelled through another instance", response_id)
            entry.run.cancel()

    def _prune(self, response_id: str) -> None:
        async def prune() -> None:
            try:
                await self._store.delete_events(response_id)
            except Exception as exc:  # noqa: BLE001 - a heartbeat prunes them later
                log.debug("deleting the events of %s failed: %s", response_id, exc)

        task = asyncio.ensure_future(prune())
        self._pruning.add(task)
        task.add_done_callback(self._pruning.discard)


_relays: weakref.WeakKeyDictionary[Runs, Relay] = weakref.WeakKeyDictionary()


def shared(store: ConversationStore) -> RunEvents | None:
    """``store`` as the run events it keeps, if it is shared; None on SQLite."""
    return cast(RunEvents, store) if store.shared else None


def relay_for(runs: Runs, store: ConversationStore) -> Relay | None:
    """The relay of this process's ``runs`` on ``store``; None unless ``store`` is shared."""
    events = shared(store)
    if events is None:
        return None
    relay = _relays.get(runs)
    if relay is None:
        relay = _relays[runs] = Relay(events)
    return relay


async def follow_stored(
    events: RunEvents, response_id: str, owner: str, starting_after: int
) -> AsyncIterator[bytes]:
    """The events after ``starting_after`` of a response another instance generates (or
    generated), as its own followers get them, to its end."""
    after = starting_after
    with events.watch(response_id) as watch:
        while True:
            watch.clear()  # before the read: word of what comes during it is kept
            got = await events.events_after(response_id, owner=owner, after=after)
            if got is None:  # deleted meanwhile
                return
            for seq, frame in got.frames:
                yield frame
                after = seq
            if got.frames and _is_terminal(got.frames[-1][1]):
                return  # the run's last event (its response may not read ended yet)
            if not got.unfinished:  # (read before the events: they are all here)
                if got.last is not None and after >= got.last[0] and _is_terminal(got.last[1]):
                    return
                # Its events are pruned, or its instance died before its end was written.
                yield terminal_frame(got.body, after + 1)
                return
            await watch.wait(POLL_QUIET if watch.live else POLL_EVERY)


async def cancel_elsewhere(
    store: ConversationStore, events: RunEvents, response_id: str, owner: str
) -> dict[str, Any] | None:
    """Ask the instance running ``response_id`` to cancel it; the stored response once it
    ended (or as it is after ``WAIT_ENDED`` s). None if it is not running (any more)."""
    if not await events.request_cancel(response_id, owner=owner):
        return None
    deadline = time.monotonic() + WAIT_ENDED
    while True:
        stored = await store.get_response(response_id, owner=owner)
        if stored is None:
            return None
        if stored.body.get("status") not in ("queued", "in_progress"):
            return stored.body
        if time.monotonic() >= deadline:
            log.warning("response %s: no instance ended it within %gs", response_id, WAIT_ENDED)
            return stored.body
        await asyncio.sleep(0.1)
