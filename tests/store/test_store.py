"""The conversation store: CRUD, ownership, pagination, branching, durability, the writer.

Each test taking ``store`` or ``backend`` runs on SQLite and on PostgreSQL (conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from sluice.store import (
    MIGRATIONS,
    ROOT,
    DuplicateMessageId,
    InvalidParent,
    NewMessage,
    SQLiteStore,
    StoreClosed,
    StoreFailed,
    UnknownConversation,
)
from tests.store.conftest import Backend, Store


def user(text: Any, **fields: Any) -> NewMessage:
    return NewMessage(role="user", content=text, **fields)


def assistant(text: Any, **fields: Any) -> NewMessage:
    return NewMessage(role="assistant", content=text, **fields)


async def test_crud_round_trips_every_field(store: Store) -> None:
    conv = await store.create_conversation(owner="alice", user_id="u1", model="smol")
    assert conv.id.startswith("conv_") and len(conv.id) == 5 + 24
    assert (conv.head_id, conv.message_count, conv.model) == (None, 0, "smol")

    parts = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": "x"}},
    ]
    first = await store.add_message(conv.id, user(parts))
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    second = await store.add_message(
        conv.id,
        NewMessage(
            role="assistant",
            content=None,
            tool_calls=calls,
            reasoning="thinking…",
            model="smol",
            usage={"prompt_tokens": 3, "completion_tokens": 5},
            finish_reason="tool_calls",
        ),
    )
    third = await store.add_message(
        conv.id, NewMessage(role="tool", content="42", tool_call_id="call_1", name="f")
    )
    failed = await store.add_message(
        conv.id, assistant("partial", status="failed", error="engine_error: boom")
    )
    assert first.id.startswith("msg_") and first.parent_id is None
    assert (second.parent_id, third.parent_id, failed.parent_id) == (first.id, second.id, third.id)

    stored = [first, second, third, failed]
    assert await store.messages(conv.id) == stored
    for message in stored:
        assert await store.get_message(message.id) == message
    assert (await store.get_message(second.id)).tool_calls == calls
    assert (await store.get_message(first.id)).content == parts

    again = await store.get_conversation(conv.id, owner="alice", user_id="u1")
    assert again is not None
    assert (again.head_id, again.message_count) == (failed.id, 4)
    assert again.updated_at > conv.updated_at and again.created_at == conv.created_at

    assert await store.delete_conversation(conv.id, owner="alice", user_id="u1") is True
    assert await store.get_conversation(conv.id, owner="alice", user_id="u1") is None
    assert await store.messages(conv.id) == []
    assert await store.get_message(first.id) is None
    assert await store.delete_conversation(conv.id, owner="alice", user_id="u1") is False


async def test_ownership_isolates_keys_and_users(store: Store) -> None:
    mine = await store.create_conversation(owner="alice", user_id=None, model=None)
    alice_u1 = await store.create_conversation(owner="alice", user_id="u1", model=None)
    bob = await store.create_conversation(owner="bob", user_id=None, model=None)

    assert await store.get_conversation(mine.id, owner="alice", user_id=None) == mine
    assert await store.get_conversation(mine.id, owner="bob", user_id=None) is None
    assert await store.get_conversation(mine.id, owner="alice", user_id="u1") is None
    # user_id None matches only conversations made without one
    assert await store.get_conversation(alice_u1.id, owner="alice", user_id=None) is None
    assert await store.get_conversation(alice_u1.id, owner="alice", user_id="u2") is None
    assert await store.get_conversation(alice_u1.id, owner="alice", user_id="u1") == alice_u1
    assert await store.get_conversation(bob.id, owner="alice", user_id=None) is None
    assert await store.get_conversation("conv_nope", owner="alice", user_id=None) is None

    assert await store.list_conversations(owner="alice", user_id=None, limit=10, offset=0) == (
        [mine],
        1,
    )
    assert await store.list_conversations(owner="alice", user_id="u1", limit=10, offset=0) == (
        [alice_u1],
        1,
    )
    assert await store.list_conversations(owner="carol", user_id=None, limit=10, offset=0) == (
        [],
        0,
    )

    assert await store.delete_conversation(mine.id, owner="bob", user_id=None) is False
    assert await store.delete_conversation(alice_u1.id, owner="alice", user_id=None) is False
    assert await store.get_conversation(mine.id, owner="alice", user_id=None) is not None
    assert await store.get_conversation(alice_u1.id, owner="alice", user_id="u1") is not None


async def test_pagination_newest_first(store: Store) -> None:
    convs = [await store.create_conversation(owner="k", user_id=None, model=None) for _ in range(5)]
    await store.create_conversation(owner="other", user_id=None, model=None)
    ids = [c.id for c in reversed(convs)]

    async def page(limit: int, offset: int) -> tuple[list[str], int]:
        found, total = await store.list_conversations(
            owner="k", user_id=None, limit=limit, offset=offset
        )
        return [c.id for c in found], total

    assert await page(2, 0) == (ids[0:2], 5)
    assert await page(2, 2) == (ids[2:4], 5)
    assert await page(2, 4) == (ids[4:], 5)
    assert await page(2, 10) == ([], 5)
    assert await page(0, 0) == ([], 5)

    # a new message makes the oldest conversation the newest
    await store.add_message(convs[0].id, user("hi"))
    assert (await page(10, 0))[0] == [convs[0].id, *ids[:4]]


async def test_branches_and_paths(store: Store) -> None:
    conv = await store.create_conversation(owner="k", user_id=None, model=None)
    u1 = await store.add_message(conv.id, user("q1"))
    a1 = await store.add_message(conv.id, assistant("r1"))
    # main line: continues from the head
    f1 = await store.add_message(conv.id, user("follow-up A"))
    a2 = await store.add_message(conv.id, assistant("answer A"))
    # a second follow-up of a1, off the main line
    f2 = await store.add_message(conv.id, user("follow-up B", parent_id=a1.id), advance_head=False)
    b2 = await store.add_message(
        conv.id, assistant("answer B", parent_id=f2.id), advance_head=False
    )

    assert (f1.parent_id, f2.parent_id) == (a1.id, a1.id)
    assert [m.id for m in await store.path(a2.id)] == [u1.id, a1.id, f1.id, a2.id]
    assert [m.id for m in await store.path(b2.id)] == [u1.id, a1.id, f2.id, b2.id]
    assert [m.id for m in await store.path(u1.id)] == [u1.id]
    assert await store.path("msg_unknown") == []
    # paths asked at once (PostgreSQL reads them in one query) each get their own
    together = await asyncio.gather(
        *(store.path(m) for m in (a2.id, b2.id, "msg_unknown", a2.id, u1.id))
    )
    assert [[m.id for m in path] for path in together] == [
        [u1.id, a1.id, f1.id, a2.id],
        [u1.id, a1.id, f2.id, b2.id],
        [],
        [u1.id, a1.id, f1.id, a2.id],
        [u1.id],
    ]
    assert together[0] == await store.path(a2.id) and together[0] is not together[3]
    assert [m.id for m in await store.messages(conv.id)] == [
        u1.id,
        a1.id,
        f1.id,
        a2.id,
        f2.id,
        b2.id,
    ]
    now = await store.get_conversation(conv.id, owner="k", user_id=None)
    assert now is not None and (now.head_id, now.message_count) == (a2.id, 6)

    # the branch becomes the main line when a turn continues it with advance_head
    b3 = await store.add_message(conv.id, user("on B", parent_id=b2.id))
    now = await store.get_conversation(conv.id, owner="k", user_id=None)
    assert now is not None and now.head_id == b3.id

    # caller-given ids (LM Studio's resp_...), and a chain stored in one transaction
    chain = await store.add_messages(
        conv.id, [user("x"), assistant("y", id="resp_0123", status="incomplete")]
    )
    assert chain[0].parent_id == b3.id and chain[1].parent_id == chain[0].id
    assert (await store.get_message("resp_0123")) == chain[1]


async def test_invalid_writes_are_refused_and_change_nothing(
    store: Store, backend: Backend
) -> None:
    conv = await store.create_conversation(owner="k", user_id=None, model=None)
    other = await store.create_conversation(owner="k", user_id=None, model=None)
    foreign = await store.add_message(other.id, user("elsewhere"))
    root = await store.add_message(conv.id, user("root", id="resp_a"))

    with pytest.raises(UnknownConversation):
        await store.add_message("conv_missing", user("x"))
    with pytest.raises(InvalidParent):
        await store.add_message(conv.id, user("x", parent_id=foreign.id))
    with pytest.raises(InvalidParent):
        await store.add_message(conv.id, user("x", parent_id="msg_missing"))
    with pytest.raises(DuplicateMessageId):
        await store.add_message(other.id, user("x", id="resp_a"))
    with pytest.raises(TypeError):
        await store.add_message(conv.id, user(object()))
    # all or none: the bad second message takes the good first one with it
    with pytest.raises(InvalidParent):
        await store.add_messages(conv.id, [user("ok"), user("bad", parent_id="msg_missing")])
    # a failing write batched with good ones fails alone: the store's writer is held
    # busy first, so all three wait and go into one transaction
    busy = asyncio.ensure_future(store._call(backend.hold(0.05), writes=True))
    await asyncio.sleep(0.01)
    results: tuple[Any, ...] = await asyncio.gather(
        store.add_message(conv.id, assistant("good 1")),
        store.add_message("conv_missing", user("x")),
        store.add_message(conv.id, assistant("good 2")),
        return_exceptions=True,
    )
    good_1, missing, good_2 = results
    await busy
    assert isinstance(missing, UnknownConversation)
    assert good_2.parent_id == good_1.id
    assert [m.content for m in await store.messages(conv.id)] == ["root", "good 1", "good 2"]
    now = await store.get_conversation(conv.id, owner="k", user_id=None)
    assert now is not None and now.message_count == 3 and now.head_id == good_2.id
    assert root.parent_id is None


async def test_close_finishes_queued_writes_then_refuses(backend: Backend) -> None:
    store = await backend.open()
    conv = await store.create_conversation(owner="k", user_id=None, model=None)
    pending = [asyncio.ensure_future(store.add_message(conv.id, user(str(i)))) for i in range(50)]
    await asyncio.sleep(0)  # every write is queued before close
    await store.close()
    assert all(task.done() and not task.exception() for task in pending)
    with pytest.raises(StoreClosed):
        await store.add_message(conv.id, user("late"))
    await store.close()  # twice is fine

    async with await backend.open() as reopened:
        assert len(await reopened.messages(conv.id)) == 50


async def test_migrations_run_once_and_atomically(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    async with await SQLiteStore.open(path) as store:
        conv = await store.create_conversation(owner="k", user_id=None, model=None)
        await store.add_message(conv.id, user("kept"))

    def pragma(name: str) -> Any:
        with sqlite3.connect(path) as conn:
            return conn.execute(f"PRAGMA {name}").fetchone()[0]

    assert pragma("user_version") == len(MIGRATIONS)
    assert pragma("journal_mode") == "wal"

    extra = "CREATE TABLE extra (n INTEGER); INSERT INTO extra VALUES (1);"
    for _ in range(2):  # the second open must not run it again
        async with await SQLiteStore.open(path, migrations=[*MIGRATIONS, extra]) as store:
            assert [m.content for m in await store.messages(conv.id)] == ["kept"]
    assert pragma("user_version") == len(MIGRATIONS) + 1
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM extra").fetchone()[0] == 1

    broken = "CREATE TABLE half (n INTEGER); INSERT INTO no_such_table VALUES (1);"
    with pytest.raises(StoreFailed):
        await SQLiteStore.open(path, migrations=[*MIGRATIONS, extra, broken])
    assert pragma("user_version") == len(MIGRATIONS) + 1
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert "half" not in tables

    # a file from a newer sluice is refused, not silently used
    with pytest.raises(StoreFailed):
        await SQLiteStore.open(path, migrations=MIGRATIONS)


async def test_in_memory_store() -> None:
    async with await SQLiteStore.open(":memory:") as store:
        conv = await store.create_conversation(owner="", user_id=None, model=None)
        message = await store.add_message(conv.id, user("hi"))
        assert await store.path(message.id) == [message]


async def test_connection_pragmas(sqlite_store: SQLiteStore) -> None:
    def read(conn: sqlite3.Connection) -> tuple[Any, ...]:
        return tuple(
            conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("journal_mode", "synchronous", "foreign_keys")
        )

    assert await sqlite_store._call(read, writes=False) == ("wal", 2, 1)  # 2: FULL


async def test_acknowledged_means_committed(store: Store, backend: Backend) -> None:
    """Another connection sees each write the moment its caller is told it is done."""
    conv = await store.create_conversation(owner="k", user_id=None, model=None)

    async def write(n: int) -> None:
        for i in range(20 if backend.name == "sqlite" else 5):
            message = await store.add_message(conv.id, user(f"{n}.{i}"))
            found = backend.query("SELECT 1 FROM messages WHERE id = ?", (message.id,))
            assert found

    await asyncio.gather(*(write(n) for n in range(10)))


async def test_concurrent_writers_keep_order_and_lose_nothing(store: Store) -> None:
    conv = await store.create_conversation(owner="k", user_id=None, model=None)
    called: list[str] = []

    async def writer(n: int) -> None:
        for i in range(25):
            text = f"{n}.{i}"
            called.append(text)  # add_message queues before its first await
            await store.add_message(conv.id, user(text))
            if i % 5 == n % 5:
                await asyncio.sleep(0)

    await asyncio.gather(*(writer(n) for n in range(20)))
    stored = await store.messages(conv.id)
    assert [m.content for m in stored] == called
    assert len(stored) == 500
    now = await store.get_conversation(conv.id, owner="k", user_id=None)
    assert now is not None and now.message_count == 500 and now.head_id == stored[-1].id
    # each took the head as it was when its turn came: one unbroken chain
    assert await store.path(stored[-1].id) == stored


@pytest.mark.perf  # the longest gap between 2 ms ticks under 0.1 s
async def test_event_loop_keeps_running_during_slow_writes(store: Store, backend: Backend) -> None:
    conv = await store.create_conversation(owner="k", user_id=None, model=None)
    ticks: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.002)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    writes = [store.add_message(conv.id, user(str(i))) for i in range(250)]
    writes.append(store._call(backend.hold(0.3), writes=True))  # a write stuck on a slow disk
    writes.extend(store.add_message(conv.id, user(str(i))) for i in range(250, 500))
    await asyncio.gather(*writes)
    elapsed = time.perf_counter() - start
    stop.set()
    await task

    during = [t for t in ticks if t >= start]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert elapsed >= 0.3
    assert len(during) >= 50, (len(during), elapsed)
    assert max(gaps) < 0.1, max(gaps)
    assert len(await store.messages(conv.id)) == 500


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from sluice.store import NewMessage, open_store

    async def main() -> None:
        store = await open_store(sys.argv[1])
        conv = await store.create_conversation(owner="k", user_id=None, model=None)
        print("acked", conv.id, flush=True)

        async def writer(n: int) -> None:
            i = 0
            while True:
                m = await store.add_message(conv.id, NewMessage(role="user", content=f"{n}.{i}"))
                print("acked", m.id, flush=True)
                i += 1

        await asyncio.gather(*(writer(n) for n in range(4)))

    asyncio.run(main())
    """
)


def _write_until_killed(location: str, kill_after: int) -> list[str]:
    """Run the writing child, SIGKILL it after ``kill_after`` acks; every id it acknowledged."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, location],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    acked: list[str] = []
    try:
        while len(acked) < kill_after:
            line = child.stdout.readline()
            assert line, child.stderr.read() if child.stderr else "child died"
            acked.append(line.split()[1])
        os.kill(child.pid, signal.SIGKILL)  # mid-stream: the child is still writing
        rest, _ = child.communicate(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    # Whatever it printed before dying was acknowledged too; the text after the last
    # newline is a line the kill cut short (seen: "acked " without its id), not an ack.
    complete = rest.split("\n")[:-1]
    return acked + [line.split()[1] for line in complete if line.startswith("acked ")]


@pytest.mark.parametrize("kill_after", [1, 7, 60, 200])
async def test_sigkill_loses_no_acknowledged_write(backend: Backend, kill_after: int) -> None:
    conv_id, *message_ids = await asyncio.to_thread(
        _write_until_killed, backend.location, kill_after
    )
    async with await backend.open() as store:
        conv = await store.get_conversation(conv_id, owner="k", user_id=None)
        assert conv is not None
        stored = await store.messages(conv_id)
        stored_ids = {m.id for m in stored}
        assert [m for m in message_ids if m not in stored_ids] == []
        assert conv.message_count == len(stored)
        assert conv.head_id == (stored[-1].id if stored else None)


async def test_the_migration_log_names_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "named.db"
    with caplog.at_level(logging.INFO, logger="sluice.store"):
        async with await SQLiteStore.open(path):
            pass
    lines = [r.getMessage() for r in caplog.records if "migrated" in r.getMessage()]
    assert lines and all(str(path) in line for line in lines), lines
    assert not any("Connection" in line for line in lines), lines


async def test_rename_keeps_the_order_and_is_owner_checked(store: Store) -> None:
    older = await store.create_conversation(owner="alice", user_id=None, model="m")
    newer = await store.create_conversation(owner="alice", user_id=None, model="m")
    renamed = await store.rename_conversation(older.id, owner="alice", user_id=None, title="Plans")
    assert renamed is not None and renamed.title == "Plans"
    assert renamed.updated_at == older.updated_at  # a name is not a turn
    page, _ = await store.list_conversations(owner="alice", user_id=None, limit=5, offset=0)
    assert [c.id for c in page] == [newer.id, older.id]
    assert page[1].title == "Plans" and page[0].title is None
    assert await store.rename_conversation(older.id, owner="bob", user_id=None, title="x") is None
    assert await store.rename_conversation(older.id, owner="alice", user_id="u", title="x") is None
    cleared = await store.rename_conversation(older.id, owner="alice", user_id=None, title=None)
    assert cleared is not None and cleared.title is None


async def test_a_new_root_branches_from_the_start(store: Store) -> None:
    conv = await store.create_conversation(owner="a", user_id=None, model="m")
    first = await store.add_message(conv.id, user("one"))
    await store.add_message(conv.id, assistant("two"))
    again = await store.add_message(conv.id, user("one, edited", parent_id=ROOT))
    assert again.parent_id is None
    now = await store.get_conversation(conv.id, owner="a", user_id=None)
    assert now is not None and now.head_id == again.id and now.message_count == 3
    assert [m.id for m in await store.path(again.id)] == [again.id]
    assert first.parent_id is None


async def test_a_database_of_the_previous_schema_gains_titles(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    async with await SQLiteStore.open(path, migrations=MIGRATIONS[:2]):
        pass
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(
            "INSERT INTO conversations (id, owner, model, created_at, updated_at, message_count)"
            " VALUES ('conv_old', 'a', 'm', 1, 1, 0)"
        )
    async with await SQLiteStore.open(path) as store:
        got = await store.get_conversation("conv_old", owner="a", user_id=None)
        assert got is not None and got.title is None
        renamed = await store.rename_conversation("conv_old", owner="a", user_id=None, title="t")
        assert renamed is not None and renamed.title == "t"
