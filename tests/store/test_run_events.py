"""A shared store's run events and cancel requests (PostgreSQL only: on SQLite, one
process, a run's events stay in its memory): events are read back in order after a
sequence number, with the response's state read first; a cancel is recorded only for
an unfinished response of its owner; deleting the response deletes its events."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from sluice.dialects.responses import shared
from sluice.store import PostgresStore, StoredResponse


def response(response_id: str, status: str, owner: str = "alice") -> StoredResponse:
    body = {"id": response_id, "object": "response", "status": status, "background": True}
    return StoredResponse(response_id, owner, None, body, [], time.time())


def frame(kind: str, seq: int) -> bytes:
    return f'event: {kind}\ndata: {{"sequence_number":{seq}}}\n\n'.encode()


async def test_events_are_read_after_a_sequence_number(postgres_url: str) -> None:
    async with await PostgresStore.open(postgres_url) as store:
        assert store.shared
        await store.put_response(response("resp_1", "queued"))
        empty = await store.events_after("resp_1", owner="alice", after=-1)
        assert empty is not None and empty.unfinished and empty.frames == [] and empty.last is None

        first = [("resp_1", seq, frame("response.output_text.delta", seq)) for seq in range(3)]
        await store.add_events(first)
        await store.add_events(first[1:])  # a row written again stays as it was
        await store.add_events([("resp_1", 3, frame("response.completed", 3))])
        got = await store.events_after("resp_1", owner="alice", after=0)
        assert got is not None and got.unfinished
        assert [seq for seq, _ in got.frames] == [1, 2, 3]
        assert got.frames[0][1] == first[1][2] and isinstance(got.frames[0][1], bytes)
        assert got.last == (3, frame("response.completed", 3))

        past = await store.events_after("resp_1", owner="alice", after=3)
        assert past is not None and past.frames == [] and past.last is not None
        assert past.last[0] == 3

        await store.put_response(response("resp_1", "completed"))
        ended = await store.events_after("resp_1", owner="alice", after=-1)
        assert ended is not None and not ended.unfinished and len(ended.frames) == 4
        assert ended.body["status"] == "completed"

        # another owner's response is unknown, as is an unknown one
        assert await store.events_after("resp_1", owner="bob", after=-1) is None
        assert await store.events_after("resp_2", owner="alice", after=-1) is None

        await store.delete_events("resp_1")
        pruned = await store.events_after("resp_1", owner="alice", after=-1)
        assert pruned is not None and pruned.frames == [] and pruned.last is None


async def test_deleting_a_response_deletes_its_events(postgres_url: str) -> None:
    async with await PostgresStore.open(postgres_url) as store:
        await store.put_response(response("resp_1", "queued"))
        await store.put_response(response("resp_2", "queued"))
        await store.add_events([("resp_1", 0, b"a"), ("resp_2", 0, b"b")])
        assert not await store.delete_response("resp_1", owner="bob")
        assert await store.delete_response("resp_1", owner="alice")
        kept = await store.events_after("resp_2", owner="alice", after=-1)
        assert kept is not None and kept.frames == [(0, b"b")]
        await store.put_response(response("resp_1", "queued"))
        again = await store.events_after("resp_1", owner="alice", after=-1)
        assert again is not None and again.frames == []


async def test_a_cancel_is_requested_through_another_instance(postgres_url: str) -> None:
    async with (
        await PostgresStore.open(postgres_url) as running,
        await PostgresStore.open(postgres_url) as other,
    ):
        await running.put_response(response("resp_1", "in_progress"))
        await running.put_response(response("resp_2", "queued"))
        await running.put_response(response("resp_3", "completed"))
        assert await running.cancels_requested(["resp_1", "resp_2"]) == []
        assert await running.cancels_requested([]) == []

        assert not await other.request_cancel("resp_1", owner="bob")  # another's
        assert not await other.request_cancel("resp_3", owner="alice")  # ended
        assert not await other.request_cancel("resp_9", owner="alice")  # unknown
        assert await other.request_cancel("resp_1", owner="alice")
        assert await running.cancels_requested(["resp_1", "resp_2", "resp_3"]) == ["resp_1"]

        # the runner stores its end; the response stays what it stored
        await running.put_response(response("resp_1", "cancelled"))
        stored = await other.get_response("resp_1", owner="alice")
        assert stored is not None and stored.body["status"] == "cancelled"
        assert not await other.request_cancel("resp_1", owner="alice")


async def test_the_heartbeat_never_fails_its_own_running_responses(postgres_url: str) -> None:
    # (It did: every heartbeat failed this instance's own unfinished responses, so a
    # background response running more than one heartbeat on PostgreSQL failed.)
    async with await PostgresStore.open(postgres_url, heartbeat=0.05) as store:
        await store.end_unfinished_responses({"code": "server_error", "message": "gone"})
        await store.put_response(response("resp_1", "in_progress"))
        await asyncio.sleep(0.4)  # several heartbeats
        stored = await store.get_response("resp_1", owner="alice")
        assert stored is not None and stored.body["status"] == "in_progress"


async def until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.01)


async def test_another_instance_hears_of_events_and_cancels_at_once(postgres_url: str) -> None:
    """Word goes out at the commit of add_events and request_cancel (NOTIFY), to the
    watches of that response and the cancel callbacks of every instance."""
    async with (
        await PostgresStore.open(postgres_url) as running,
        await PostgresStore.open(postgres_url) as other,
    ):
        heard: list[str] = []
        running.on_cancel(heard.append)
        await running.put_response(response("resp_1", "in_progress"))
        with other.watch("resp_1") as watch, other.watch("resp_2") as elsewhere:
            await until(lambda: watch.live)
            watch.clear()
            elsewhere.clear()  # (both woken as the listener began: word may be lost)
            started = time.monotonic()
            await running.add_events([("resp_1", 0, frame("response.created", 0))])
            assert await watch.wait(5.0)
            took = time.monotonic() - started
            assert took < 1.0, took
            assert not await elsewhere.wait(0.2)  # word of another response only

            assert await other.request_cancel("resp_1", owner="alice")
            await until(lambda: heard == ["resp_1"], timeout=1.0)
            assert not await other.request_cancel("resp_9", owner="alice")  # none: no word
            await asyncio.sleep(0.2)
            assert heard == ["resp_1"]
        # A watch left is forgotten: word no longer reaches it.
        assert not other._listener._watches


async def test_a_listener_whose_connection_died_listens_again(postgres_url: str) -> None:
    async with (
        await PostgresStore.open(postgres_url) as running,
        await PostgresStore.open(postgres_url) as other,
    ):
        with other.watch("resp_1") as watch:
            await until(lambda: watch.live)
            # The server ends the listener's session (what a restart or failover does).
            with psycopg.connect(postgres_url, autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid()"
                )
            await until(lambda: not watch.live)
            # Back: it wakes its watches at once (word may have been lost), then hears.
            await until(lambda: watch.live)
            assert await watch.wait(1.0)
            watch.clear()
            await running.add_events([("resp_1", 0, frame("response.created", 0))])
            assert await watch.wait(5.0)


async def test_a_follower_elsewhere_reads_events_as_they_are_stored(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """follow_stored waits for word, not for its poll: with the poll slowed to 30 s,
    each event still comes within a second, and the stream ends with the run's last
    event, before its response is stored as ended."""
    monkeypatch.setattr(shared, "POLL_QUIET", 30.0)
    async with (
        await PostgresStore.open(postgres_url) as running,
        await PostgresStore.open(postgres_url) as other,
    ):
        await running.put_response(response("resp_1", "in_progress"))
        await until(lambda: other._listener.live)
        got: list[tuple[float, bytes]] = []

        async def follow() -> None:
            async for item in shared.follow_stored(other, "resp_1", "alice", -1):
                got.append((time.monotonic(), item))

        task = asyncio.ensure_future(follow())
        kinds = ["response.created", "response.output_text.delta", "response.completed"]
        lags: list[float] = []
        for seq, kind in enumerate(kinds):
            await asyncio.sleep(0.3)
            sent = time.monotonic()
            await running.add_events([("resp_1", seq, frame(kind, seq))])
            await until(lambda seq=seq: len(got) > seq, timeout=5.0)
            lags.append(got[seq][0] - sent)
        await asyncio.wait_for(task, 5.0)  # ended by the terminal event
        assert [item for _, item in got] == [frame(k, i) for i, k in enumerate(kinds)]
        assert max(lags) < 1.0, lags
