"""What only the PostgreSQL store does: migrate once among many, share one database between
processes (conversations, responses, limits), tell live instances from gone ones, and never
show a password."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sluice.store import (
    DuplicateMessageId,
    NewMessage,
    PostgresStore,
    SQLiteStore,
    StoredResponse,
    StoreFailed,
    open_store,
)
from sluice.store.postgres_schema import MIGRATIONS, describe
from tests.support.postgres import PASSWORD, PostgresServer


def query(url: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql.encode())
        return list(cursor.fetchall()) if cursor.description else []


async def test_a_fresh_database_migrates_once(postgres_url: str) -> None:
    async with await PostgresStore.open(postgres_url) as store:
        conv = await store.create_conversation(owner="k", user_id=None, model=None)
        await store.add_message(conv.id, NewMessage(role="user", content="kept"))
    assert query(postgres_url, "SELECT version FROM sluice_schema") == [(len(MIGRATIONS),)]

    extra = "CREATE TABLE extra (n INTEGER); INSERT INTO extra VALUES (1);"
    for _ in range(2):  # the second open must not run it again
        async with await PostgresStore.open(postgres_url, migrations=[*MIGRATIONS, extra]) as s:
            assert [m.content for m in await s.messages(conv.id)] == ["kept"]
    assert query(postgres_url, "SELECT version FROM sluice_schema") == [(len(MIGRATIONS) + 1,)]
    assert query(postgres_url, "SELECT COUNT(*) FROM extra") == [(1,)]

    broken = "CREATE TABLE half (n INTEGER); INSERT INTO no_such_table VALUES (1);"
    with pytest.raises(StoreFailed):
        await PostgresStore.open(postgres_url, migrations=[*MIGRATIONS, extra, broken])
    assert query(postgres_url, "SELECT version FROM sluice_schema") == [(len(MIGRATIONS) + 1,)]
    assert query(postgres_url, "SELECT to_regclass('half')") == [(None,)]

    # a database of a newer sluice is refused, not silently used
    with pytest.raises(StoreFailed, match="newer"):
        await PostgresStore.open(postgres_url)


async def test_stores_opening_at_once_migrate_once(postgres_url: str) -> None:
    extra = "CREATE TABLE extra (n INTEGER); INSERT INTO extra VALUES (1);"
    stores = await asyncio.gather(
        *(PostgresStore.open(postgres_url, migrations=[*MIGRATIONS, extra]) for _ in range(4))
    )
    try:
        assert query(postgres_url, "SELECT COUNT(*) FROM extra") == [(1,)]
        assert query(postgres_url, "SELECT version FROM sluice_schema") == [(len(MIGRATIONS) + 1,)]
        assert len({s.instance for s in stores}) == 4
        assert query(postgres_url, "SELECT COUNT(*) FROM instances") == [(4,)]
    finally:
        for store in stores:
            await store.close()
    assert query(postgres_url, "SELECT COUNT(*) FROM instances") == [(0,)]  # unregistered


async def test_open_store_chooses_by_the_location(postgres_url: str, tmp_path: Path) -> None:
    store = await open_store(postgres_url)
    assert isinstance(store, PostgresStore) and store.shared
    await store.close()
    store = await open_store("postgres://" + postgres_url.removeprefix("postgresql://"))
    assert isinstance(store, PostgresStore)
    await store.close()
    for location in (tmp_path / "a.db", str(tmp_path / "b.db"), ":memory:"):
        store = await open_store(location)
        assert isinstance(store, SQLiteStore) and not store.shared
        await store.close()


async def test_no_password_in_errors_or_logs(
    postgres_server: PostgresServer, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    database = postgres_url.rsplit("/", 1)[1]
    wrong = postgres_server.url(database, password="hunter2-wrong")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StoreFailed) as refused:
        await open_store(wrong)
    message = str(refused.value)
    assert f"127.0.0.1:{postgres_server.port}/{database}" in message, message
    assert "password authentication failed" in message
    assert "hunter2" not in message and refused.value.__cause__ is None

    with pytest.raises(StoreFailed, match="Could not open"):  # nobody listens there
        await open_store("postgresql://u:hunter2-nobody@127.0.0.1:1/nothing")

    async with await PostgresStore.open(postgres_url) as store:
        assert store.location == f"postgresql://sluice@127.0.0.1:{postgres_server.port}/{database}"
        await store.create_conversation(owner="k", user_id=None, model=None)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "migrated" in logged and store.location in logged
    for secret in ("hunter2", PASSWORD):
        assert secret not in logged
    assert describe("postgresql://a:b%40c@h/d?sslmode=require") == "postgresql://a@h/d"


async def test_a_conversation_continues_through_another_instance(postgres_url: str) -> None:
    async with (
        await PostgresStore.open(postgres_url) as one,
        await PostgresStore.open(postgres_url) as two,
    ):
        conv = await one.create_conversation(owner="alice", user_id=None, model="m")
        assert await two.get_conversation(conv.id, owner="alice", user_id=None) == conv

        async def turns(store: PostgresStore, name: str) -> None:
            for i in range(15):
                await store.add_message(conv.id, NewMessage(role="user", content=f"{name}{i}"))

        # both append to the one conversation at once: one unbroken chain of 30
        await asyncio.gather(turns(one, "a"), turns(two, "b"))
        stored = await one.messages(conv.id)
        assert len(stored) == 30
        assert await two.path(stored[-1].id) == stored
        now = await two.get_conversation(conv.id, owner="alice", user_id=None)
        assert now is not None and now.message_count == 30 and now.head_id == stored[-1].id


async def test_turns_through_two_instances_chain_as_the_gateway_stores_them(
    postgres_url: str,
) -> None:
    # each turn as /c1 stores it: the user's message on the head, then the answer
    # naming it as its parent, through either instance, all at once
    async with (
        await PostgresStore.open(postgres_url) as one,
        await PostgresStore.open(postgres_url) as two,
    ):
        conv = await one.create_conversation(owner="alice", user_id=None, model="m")

        async def turns(store: PostgresStore, name: str) -> None:
            for i in range(10):
                asked = await store.add_message(conv.id, NewMessage(role="user", content=name))
                answer = NewMessage(role="assistant", content=f"{name}{i}", parent_id=asked.id)
                await store.add_message(conv.id, answer)

        await asyncio.gather(*(turns(s, n) for s, n in [(one, "a"), (two, "b")] * 2))
        stored = await two.messages(conv.id)
        assert len(stored) == 80
        # each question continues the head (the message stored just before it), each
        # answer its question: one tree, every head moved under the row lock
        by_id = {m.id: m for m in stored}
        for before, message in zip([None, *stored], stored, strict=False):
            if message.role == "user":
                assert message.parent_id == (before and before.id)
            else:
                assert message.parent_id is not None
                assert by_id[message.parent_id].content == message.content[0]
        assert (await one.path(stored[-1].id))[-1] == stored[-1]
        now = await one.get_conversation(conv.id, owner="alice", user_id=None)
        assert now is not None and (now.message_count, now.head_id) == (80, stored[-1].id)


async def test_a_batch_whose_statement_fails_runs_again_one_write_at_a_time(
    postgres_url: str,
) -> None:
    # The writer sends a batch's writes at once; one failing in the database (here a
    # trigger refuses it) rolls the batch back, and it runs again write by write: the
    # failing one fails alone, the others keep their order and their chain.
    store = await PostgresStore.open(postgres_url)
    query(
        postgres_url,
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF NEW.content = '\"refused\"' THEN RAISE EXCEPTION 'refused'; END IF;"
        " RETURN NEW; END $$;"
        " CREATE TRIGGER refuse BEFORE INSERT ON messages"
        " FOR EACH ROW EXECUTE FUNCTION refuse()",
    )
    async with store:
        conv = await store.create_conversation(owner="k", user_id=None, model=None)
        one_by_one = store._one_by_one
        batches: list[int] = []

        async def counted(conn: Any, batch: list[Any]) -> Any:
            batches.append(len(batch))
            return await one_by_one(conn, batch)

        store._one_by_one = counted  # type: ignore[method-assign]
        busy = asyncio.ensure_future(store._call(lambda conn: asyncio.sleep(0.05), writes=True))
        await asyncio.sleep(0.01)
        results: tuple[Any, ...] = await asyncio.gather(
            store.add_message(conv.id, NewMessage(role="user", content="first")),
            store.add_message(conv.id, NewMessage(role="user", content="refused")),
            store.rename_conversation(conv.id, owner="k", user_id=None, title="named"),
            store.add_message(conv.id, NewMessage(role="user", content="second")),
            return_exceptions=True,
        )
        await busy
        assert batches == [1, 4]  # the held write (no pipelined form), then the retry
        first, refused, renamed, second = results
        assert isinstance(refused, StoreFailed)
        assert second.parent_id == first.id and renamed.title == "named"
        assert [m.content for m in await store.messages(conv.id)] == ["first", "second"]
        # and the writer goes on pipelining: writes refused before they are sent (an id
        # twice, content that is no JSON) fail alone there, between good ones
        busy = asyncio.ensure_future(store._call(lambda conn: asyncio.sleep(0.05), writes=True))
        await asyncio.sleep(0.01)
        twice = [NewMessage(role="user", content="a", id="x"), NewMessage(role="user", id="x")]
        again: tuple[Any, ...] = await asyncio.gather(
            store.add_message(conv.id, NewMessage(role="user", content="third")),
            store.add_messages(conv.id, twice),
            store.add_message(conv.id, NewMessage(role="user", content=object())),
            store.add_message(conv.id, NewMessage(role="user", content="fourth")),
            return_exceptions=True,
        )
        await busy
        third, duplicate, not_json, fourth = again
        assert isinstance(duplicate, DuplicateMessageId) and isinstance(not_json, TypeError)
        assert (third.parent_id, fourth.parent_id) == (second.id, third.id)
        assert batches == [1, 4, 1]  # only the held write ran on its own
        assert [m.content for m in await store.messages(conv.id)][2:] == ["third", "fourth"]

        # the failure seen while the batch is still being sent (here a write that takes
        # its time to send lets the refusal arrive first): rolled back all the same
        async def slow(conn: Any) -> Any:
            await asyncio.sleep(0.05)
            cursor = await conn.execute("SELECT 1")
            return lambda: cursor.fetchone()

        busy = asyncio.ensure_future(store._call(lambda conn: asyncio.sleep(0.05), writes=True))
        await asyncio.sleep(0.01)
        late: tuple[Any, ...] = await asyncio.gather(
            store.add_message(conv.id, NewMessage(role="user", content="refused")),
            store._write(slow),
            store.add_message(conv.id, NewMessage(role="user", content="fifth")),
            return_exceptions=True,
        )
        await busy
        assert isinstance(late[0], StoreFailed) and late[1] == (1,)
        assert late[2].parent_id == fourth.id and batches == [1, 4, 1, 1, 3]

        # a batch of add_messages only (one call, committed by the pipeline's Sync)
        busy = asyncio.ensure_future(store._call(lambda conn: asyncio.sleep(0.05), writes=True))
        await asyncio.sleep(0.01)
        adds: tuple[Any, ...] = await asyncio.gather(
            store.add_message(conv.id, NewMessage(role="user", content="sixth")),
            store.add_message(conv.id, NewMessage(role="user", content="refused")),
            store.add_message(conv.id, NewMessage(role="user", content="seventh")),
            return_exceptions=True,
        )
        await busy
        assert isinstance(adds[1], StoreFailed) and adds[0].parent_id == late[2].id
        assert adds[2].parent_id == adds[0].id and batches == [1, 4, 1, 1, 3, 1, 3]
        stored = [m.content for m in await store.messages(conv.id)]
        assert stored == ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"]


def _response(response_id: str, status: str) -> StoredResponse:
    body = {"id": response_id, "object": "response", "status": status, "output": []}
    return StoredResponse(response_id, "alice", None, body, [], 1.0)


async def test_a_live_instances_background_responses_are_not_ended(postgres_url: str) -> None:
    error = {"code": "server_error", "message": "the server stopped"}
    live = await PostgresStore.open(postgres_url, heartbeat=0.1, dead_after=2.0)
    await live.put_response(_response("resp_live", "in_progress"))
    await live.put_response(_response("resp_done", "completed"))

    # a response of an instance that is gone, and one of an instance not seen for long
    gone = await PostgresStore.open(postgres_url, heartbeat=60.0)
    await gone.put_response(_response("resp_gone", "queued"))
    await gone.close()
    stale = await PostgresStore.open(postgres_url, heartbeat=60.0)
    await stale.put_response(_response("resp_stale", "in_progress"))
    query(
        postgres_url,
        f"UPDATE instances SET last_seen = now() - interval '1 hour' WHERE id = '{stale.instance}'",
    )

    async with await PostgresStore.open(postgres_url, heartbeat=0.1, dead_after=2.0) as new:
        assert await new.end_unfinished_responses(error) == 2

        async def status(response_id: str) -> str:
            found = await new.get_response(response_id, owner="alice")
            assert found is not None
            return str(found.body["status"])

        assert await status("resp_gone") == "failed"
        assert await status("resp_stale") == "failed"
        gone_now = await new.get_response("resp_gone", owner="alice")
        assert gone_now is not None and gone_now.body["error"] == error
        assert list(gone_now.body) == ["id", "object", "status", "output", "error"]
        assert await status("resp_live") == "in_progress"  # its instance is alive
        assert await status("resp_done") == "completed"
        # the live one finishes through its own instance
        await live.put_response(_response("resp_live", "completed"))
        await live.put_response(_response("resp_live2", "in_progress"))
        # ... and when an instance stops with one unfinished, the others' heartbeat ends it
        await live.close()
        for _ in range(100):
            if await status("resp_live2") == "failed":
                break
            await asyncio.sleep(0.05)
        assert await status("resp_live2") == "failed"
        assert await status("resp_live") == "completed"
    await stale.close()


async def test_its_own_instance_id_is_ended_at_start(postgres_url: str) -> None:
    first = await PostgresStore.open(postgres_url, instance="gateway-1")
    await first.put_response(_response("resp_a", "in_progress"))
    await first.close()
    query(postgres_url, "INSERT INTO instances (id) VALUES ('gateway-1')")  # still "live"
    async with await PostgresStore.open(postgres_url, instance="gateway-1") as again:
        assert await again.end_unfinished_responses({"message": "stopped"}) == 1


async def test_two_stores_admit_exactly_the_limit(postgres_url: str) -> None:
    async with (
        await PostgresStore.open(postgres_url) as one,
        await PostgresStore.open(postgres_url) as two,
    ):
        for start in (5000.0, 5100.0, 5200.0, 5300.0, 5400.0):  # a race shows in some rounds
            results = await asyncio.gather(
                *(
                    store.take_request("ci", limit=10, window=60.0, now=start)
                    for store in [one, two] * 6
                )
            )
            assert results.count(0.0) == 10, start


async def test_stream_leases_hold_the_limit_across_instances(postgres_url: str) -> None:
    """max_streams across instances: leases of live instances count, a dropped one frees
    a place, and those of an instance that stopped (or died) do not count."""
    async with await PostgresStore.open(postgres_url) as one:
        two = await PostgresStore.open(postgres_url)
        taken = await asyncio.gather(
            *(store.take_stream("ci", 3) for store in [one, two] * 3)  # a race
        )
        granted = [lease for lease in taken if lease is not None]
        assert len(granted) == 3
        for lease in granted:
            await one.drop_stream(lease)
        first, second = await two.take_stream("ci", 3), await two.take_stream("ci", 3)
        assert first is not None and second is not None
        assert await one.take_stream("ci", 3) is not None
        assert await one.take_stream("ci", 3) is None  # two's two and one's one
        await two.drop_stream(first)
        assert await one.take_stream("ci", 3) is not None  # the place it freed
        assert await one.take_stream("ci", 3) is None
        await two.close()  # its lease goes with it
        assert await one.take_stream("ci", 3) is not None
        # a dead instance's leases (no heartbeat for dead_after) do not count either
        query(
            postgres_url,
            "INSERT INTO instances (id, last_seen) VALUES ('dead', now() - interval '1 hour');"
            "INSERT INTO stream_leases (key, instance) VALUES ('other', 'dead')",
        )
        assert await one.take_stream("other", 1) is not None


_TAKER = textwrap.dedent(
    """
    import asyncio, sys, time
    from sluice.store import open_store

    async def main() -> None:
        store = await open_store(sys.argv[1])
        print("ready", flush=True)
        sys.stdin.readline()  # both start at once
        results = await asyncio.gather(
            *(store.take_request("ci", limit=10, window=60.0, now=time.time()) for _ in range(6))
        )
        print(sum(1 for r in results if r == 0.0), flush=True)
        await store.close()

    asyncio.run(main())
    """
)


def _two_processes_take(url: str) -> int:
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _TAKER, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        return sum(int(child.communicate(timeout=60)[0].strip()) for child in children)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


async def test_two_processes_admit_exactly_the_limit(postgres_url: str) -> None:
    assert await asyncio.to_thread(_two_processes_take, postgres_url) == 10
    assert query(postgres_url, "SELECT COUNT(*) FROM rate_requests") == [(10,)]


async def test_a_writer_whose_connection_died_reconnects(postgres_url: str) -> None:
    async with await PostgresStore.open(postgres_url) as store:
        conv = await store.create_conversation(owner="k", user_id=None, model=None)
        # the server ends every session of this database (a restart, a failover)
        database = postgres_url.rsplit("/", 1)[1]
        query(
            postgres_url.rsplit("/", 1)[0] + "/postgres",
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'",
        )
        await asyncio.sleep(0.1)
        message = await store.add_message(conv.id, NewMessage(role="user", content="after"))
        assert [m.id for m in await store.messages(conv.id)] == [message.id]
