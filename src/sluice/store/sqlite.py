"""The conversation store in SQLite: one thread owns the connection.

Why one thread: SQLite allows one writer at a time anyway, and a connection
used from one thread needs no locks. Every call, write or read, becomes an
operation on a queue; the thread runs them in order and hands each result
back to the caller's event loop with ``call_soon_threadsafe``. The loop
never touches the database, so a slow fsync never stalls a stream.

Why reads go through the same thread instead of a second, read-only
connection: they are indexed lookups of one conversation (well under a
millisecond) made once per request, never per token; and queueing them
behind the writes gives read-your-writes for free (a read called after an
acknowledged write sees it), with no second WAL snapshot to reason about.
The price is that a read may wait for one commit's fsync.

Group commit: the thread takes every operation already waiting (up to
``_MAX_BATCH``) into one transaction, each write inside its own savepoint so
a failing one is rolled back alone, then commits once and only then
resolves the futures. Many concurrent turns thus share one fsync, and no
caller is told "done" before its data is on disk.

Example::

    store = await SQLiteStore.open("~/.local/share/sluice/conversations.db")
    conversation = await store.create_conversation(owner="alice", user_id=None, model="m")
    await store.add_message(conversation.id, NewMessage(role="user", content="Hi"))
    await store.close()
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from sluice.store.common import (
    ADD_USAGE,
    ADVANCE,
    CONVERSATION_COLUMNS,
    INSERT_CONVERSATION,
    INSERT_MESSAGE,
    MESSAGE_COLUMNS,
    PATH,
    SELECT_RESPONSE,
    SELECT_USAGE,
    TOKENS_SINCE,
    Clock,
    Pruner,
    check_page,
    check_statuses,
    check_window,
    failed_body,
    from_json,
    merge_usage,
    message_from_row,
    message_row,
    new_conversation,
    plan_messages,
    response_from_row,
    retry_after,
    to_json,
    usage_params,
)
from sluice.store.models import (
    Conversation,
    Message,
    NewMessage,
    StoreClosed,
    StoredResponse,
    StoreFailed,
    UnknownConversation,
    UsageRow,
)
from sluice.store.schema import MIGRATIONS, connect

log = logging.getLogger("sluice.store")

T = TypeVar("T")

# Enough to share one fsync among every turn that ends at about the same time,
# small enough that one transaction never holds the writer for long.
_MAX_BATCH = 256


class _Op:
    """One queued operation: ``work`` runs on the store thread, its outcome goes to ``future``."""

    __slots__ = ("durable", "future", "loop", "work", "writes")

    def __init__(
        self,
        work: Callable[[sqlite3.Connection], Any] | None,
        writes: bool,
        future: asyncio.Future[Any],
        loop: asyncio.AbstractEventLoop,
        durable: bool = True,
    ) -> None:
        self.work = work  # None: the close marker
        self.writes = writes
        self.future = future
        self.loop = loop
        self.durable = durable  # False: a power cut may lose it (never a process crash)


_Outcome = tuple[_Op, Any, BaseException | None]


class SQLiteStore:
    """:class:`~sluice.store.repository.ConversationStore` on one SQLite file.

    Open it with :meth:`open` (not the constructor); ``":memory:"`` gives a
    private in-memory database (tests).

    Example::

        async with await SQLiteStore.open(tmp_path / "c.db") as store:
            conversation = await store.create_conversation(owner="", user_id=None, model=None)
            print(await store.messages(conversation.id))  # []
    """

    shared = False  # one process's store: the limits' counters may as well be kept in memory

    def __init__(self, path: str) -> None:
        self.location = path  # the file, or ":memory:"
        self._queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._closing = False
        self._closed: asyncio.Future[None] | None = None
        self._clock = Clock()  # only used on the store thread
        self._pruner = Pruner()  # only used on the store thread

    @classmethod
    async def open(
        cls, path: str | os.PathLike[str], *, migrations: Sequence[str] = MIGRATIONS
    ) -> SQLiteStore:
        """Open (creating the file and its folder) and migrate; ready when this returns.

        ``migrations`` replaces :data:`MIGRATIONS` (tests of the migration runner).
        """
        name = os.fspath(path)
        if name != ":memory:" and not name.startswith("file:"):
            name = str(Path(name).expanduser())
        store = cls(name)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        thread = threading.Thread(
            target=store._main,
            args=(_Op(None, False, ready, loop), tuple(migrations)),
            name="sluice-store",
            # A daemon: a stuck fsync must not keep the process from exiting, and
            # nothing a daemon could lose was acknowledged yet.
            daemon=True,
        )
        thread.start()
        await ready
        return store

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the repository -------------------------------------------------

    async def create_conversation(
        self, *, owner: str, user_id: str | None, model: str | None
    ) -> Conversation:
        def work(conn: sqlite3.Connection) -> Conversation:
            conversation, values = new_conversation(owner, user_id, model, self._clock.now())
            conn.execute(INSERT_CONVERSATION, values)
            return conversation

        return await self._call(work, writes=True)

    async def get_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None
    ) -> Conversation | None:
        def work(conn: sqlite3.Connection) -> Conversation | None:
            row = conn.execute(
                f"SELECT {CONVERSATION_COLUMNS} FROM conversations"
                " WHERE id = ? AND owner = ? AND user_id IS ?",
                (conversation_id, owner, user_id),
            ).fetchone()
            return None if row is None else Conversation(*row)

        return await self._call(work, writes=False)

    async def list_conversations(
        self, *, owner: str, user_id: str | None, limit: int, offset: int
    ) -> tuple[list[Conversation], int]:
        check_page(limit, offset)

        def work(conn: sqlite3.Connection) -> tuple[list[Conversation], int]:
            # rowid breaks ties of updated_at, so pages never overlap or skip
            rows = conn.execute(
                f"SELECT {CONVERSATION_COLUMNS} FROM conversations"
                " WHERE owner = ? AND user_id IS ?"
                " ORDER BY updated_at DESC, rowid DESC LIMIT ? OFFSET ?",
                (owner, user_id, limit, offset),
            ).fetchall()
            (total,) = conn.execute(
                "SELECT COUNT(*) FROM conversations WHERE owner = ? AND user_id IS ?",
                (owner, user_id),
            ).fetchone()
            return [Conversation(*row) for row in rows], int(total)

        return await self._call(work, writes=False)

    async def delete_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None
    ) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            # the messages go by ON DELETE CASCADE (foreign keys are on)
            cursor = conn.execute(
                "DELETE FROM conversations WHERE id = ? AND owner = ? AND user_id IS ?",
                (conversation_id, owner, user_id),
            )
            return cursor.rowcount > 0

        return await self._call(work, writes=True)

    async def rename_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None, title: str | None
    ) -> Conversation | None:
        def work(conn: sqlite3.Connection) -> Conversation | None:
            # A new name is not a new turn: updated_at (the list's order) stays.
            row = conn.execute(
                "UPDATE conversations SET title = ? WHERE id = ? AND owner = ? AND user_id IS ?"
                f" RETURNING {CONVERSATION_COLUMNS}",
                (title, conversation_id, owner, user_id),
            ).fetchone()
            return None if row is None else Conversation(*row)

        return await self._call(work, writes=True)

    async def add_message(
        self, conversation_id: str, message: NewMessage, *, advance_head: bool = True
    ) -> Message:
        """See :meth:`ConversationStore.add_message`. A caller cancelled while
        waiting does not undo it: the write was queued and still happens (a turn
        the client cut off is still recorded)."""
        (stored,) = await self.add_messages(conversation_id, (message,), advance_head=advance_head)
        return stored

    async def add_messages(
        self,
        conversation_id: str,
        messages: Sequence[NewMessage],
        *,
        advance_head: bool = True,
    ) -> list[Message]:
        batch = check_statuses(messages)
        if not batch:
            return []

        def work(conn: sqlite3.Connection) -> list[Message]:
            return self._insert_messages(conn, conversation_id, batch, advance_head)

        return await self._call(work, writes=True)

    async def messages(self, conversation_id: str) -> list[Message]:
        def work(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
            return [message_from_row(row) for row in rows]

        return await self._call(work, writes=False)

    async def path(self, message_id: str) -> list[Message]:
        def work(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                PATH,
                (message_id,),
            ).fetchall()
            return [message_from_row(row) for row in rows]

        return await self._call(work, writes=False)

    async def get_message(self, message_id: str) -> Message | None:
        def work(conn: sqlite3.Connection) -> Message | None:
            row = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,)
            ).fetchone()
            return None if row is None else message_from_row(row)

        return await self._call(work, writes=False)

    async def put_response(self, response: StoredResponse) -> None:
        def work(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT OR REPLACE INTO responses"
                " (id, owner, conversation_id, created_at, body, input_items)"
                " VALUES (?,?,?,?,?,?)",
                (
                    response.id,
                    response.owner,
                    response.conversation_id,
                    response.created_at,
                    to_json(response.body),
                    to_json(response.input_items),
                ),
            )

        await self._call(work, writes=True)

    async def get_response(self, response_id: str, *, owner: str) -> StoredResponse | None:
        def work(conn: sqlite3.Connection) -> StoredResponse | None:
            row = conn.execute(SELECT_RESPONSE, (response_id, owner)).fetchone()
            return None if row is None else response_from_row(row)

        return await self._call(work, writes=False)

    async def end_unfinished_responses(self, error: dict[str, Any]) -> int:
        def work(conn: sqlite3.Connection) -> int:
            rows = conn.execute(
                "SELECT id, body FROM responses"
                " WHERE json_extract(body, '$.status') IN ('queued', 'in_progress')"
            ).fetchall()
            ended = [(id_, from_json(text)) for id_, text in rows]
            conn.executemany(
                "UPDATE responses SET body = ? WHERE id = ?",
                [(to_json(failed_body(body, error)), id_) for id_, body in ended],
            )
            return len(ended)

        return await self._call(work, writes=True)

    async def delete_response(self, response_id: str, *, owner: str) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            )
            return cursor.rowcount > 0

        return await self._call(work, writes=True)

    async def add_usage(self, rows: Sequence[UsageRow]) -> None:
        values = merge_usage(rows)
        if not values:
            return

        def work(conn: sqlite3.Connection) -> None:
            conn.executemany(ADD_USAGE, values)

        await self._call(work, writes=True)

    async def usage(
        self, *, key: str | None = None, since: str | None = None, until: str | None = None
    ) -> list[UsageRow]:
        params = usage_params(key, since, until)

        def work(conn: sqlite3.Connection) -> list[UsageRow]:
            rows = conn.execute(SELECT_USAGE, params).fetchall()
            return [UsageRow(*row) for row in rows]

        return await self._call(work, writes=False)

    async def take_request(self, key: str, *, limit: int, window: float, now: float) -> float:
        check_window(limit, window)

        def work(conn: sqlite3.Connection) -> float:
            self._prune(conn, now)
            start = now - window
            (count,) = conn.execute(
                "SELECT COUNT(*) FROM rate_requests WHERE key = ? AND at > ?", (key, start)
            ).fetchone()
            if count < limit:
                conn.execute("INSERT INTO rate_requests (key, at) VALUES (?, ?)", (key, now))
                return 0.0
            # the one whose leaving brings the count under the limit
            row = conn.execute(
                "SELECT at FROM rate_requests WHERE key = ? AND at > ? ORDER BY at LIMIT 1 OFFSET ?",
                (key, start, count - limit),
            ).fetchone()
            return retry_after(None if row is None else row[0], window, now)

        return await self._call(work, writes=True, durable=False)

    async def add_tokens(self, key: str, tokens: int, now: float) -> None:
        def work(conn: sqlite3.Connection) -> None:
            self._prune(conn, now)
            conn.execute(
                "INSERT INTO rate_tokens (key, at, tokens) VALUES (?, ?, ?)", (key, now, tokens)
            )

        await self._call(work, writes=True, durable=False)

    async def tokens_since(self, key: str, since: float) -> tuple[int, float | None]:
        def work(conn: sqlite3.Connection) -> tuple[int, float | None]:
            total, oldest = conn.execute(TOKENS_SINCE, (key, since)).fetchone()
            return int(total), oldest

        return await self._call(work, writes=False)

    async def close(self) -> None:
        if self._closed is None:
            self._closing = True
            loop = asyncio.get_running_loop()
            self._closed = loop.create_future()
            self._queue.put(_Op(None, False, self._closed, loop))
        await asyncio.shield(self._closed)

    # -- the store thread -----------------------------------------------

    async def _call(
        self, work: Callable[[sqlite3.Connection], T], *, writes: bool, durable: bool = True
    ) -> T:
        if self._closing:
            raise StoreClosed()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        # Queued now, at call time: the order of calls is the order of writes.
        self._queue.put(_Op(work, writes, future, loop, durable))
        result: T = await future
        return result

    def _prune(self, conn: sqlite3.Connection, now: float) -> None:
        cutoff = self._pruner.due(now)
        if cutoff is not None:
            conn.execute("DELETE FROM rate_requests WHERE at <= ?", (cutoff,))
            conn.execute("DELETE FROM rate_tokens WHERE at <= ?", (cutoff,))

    def _insert_messages(
        self,
        conn: sqlite3.Connection,
        conversation_id: str,
        batch: tuple[NewMessage, ...],
        advance_head: bool,
    ) -> list[Message]:
        row = conn.execute(
            "SELECT head_id FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise UnknownConversation(conversation_id)

        def parent_conversation(message_id: str) -> str | None:
            found = conn.execute(
                "SELECT conversation_id FROM messages WHERE id = ?", (message_id,)
            ).fetchone()
            return None if found is None else str(found[0])

        def taken(message_id: str) -> bool:
            found = conn.execute("SELECT 1 FROM messages WHERE id = ?", (message_id,))
            return found.fetchone() is not None

        stored = plan_messages(
            conversation_id,
            head=row[0],
            batch=batch,
            parent_conversation=parent_conversation,
            taken=taken,
            now=self._clock.now,
        )
        conn.executemany(INSERT_MESSAGE, [message_row(message) for message in stored])
        conn.execute(
            ADVANCE,
            (self._clock.now(), len(stored), advance_head, stored[-1].id, conversation_id),
        )
        return stored

    def _main(self, ready: _Op, migrations: tuple[str, ...]) -> None:
        try:
            conn = connect(self.location, migrations)
        except BaseException as exc:  # noqa: BLE001 - handed to open()'s caller
            _settle([(ready, None, _as_store_error(exc))])
            return
        _settle([(ready, None, None)])
        try:
            while True:
                batch, stop = self._take()
                if batch:
                    _settle(_run_batch(conn, batch))
                if stop is not None:
                    break
        finally:
            # Closing the last connection checkpoints the WAL into the main file.
            conn.close()
        # Anything queued after the close marker raced close(): refuse it.
        finished: list[_Outcome] = [(stop, None, None)]
        while True:
            try:
                finished.append((self._queue.get_nowait(), None, StoreClosed()))
            except queue.Empty:
                break
        _settle(finished)

    def _take(self) -> tuple[list[_Op], _Op | None]:
        """The next batch: what is waiting now, up to the close marker (returned apart)."""
        batch: list[_Op] = []
        op = self._queue.get()
        while True:
            if op.work is None:
                return batch, op
            batch.append(op)
            if len(batch) >= _MAX_BATCH:
                return batch, None
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return batch, None


def _run_batch(conn: sqlite3.Connection, batch: list[_Op]) -> list[_Outcome]:
    """Run ``batch`` in one transaction; every outcome is final only after COMMIT."""
    # A read whose caller is gone is skipped; a write is not (it was asked for).
    live = [op for op in batch if op.writes or not op.future.cancelled()]
    # A batch of counters only commits without its fsync: a limit's count lost to a
    # power cut costs a key a few requests, an fsync per request costs every request.
    relaxed = any(op.writes for op in live) and not any(op.writes and op.durable for op in live)
    if relaxed:
        conn.execute("PRAGMA synchronous = NORMAL")
    try:
        return _run_transaction(conn, live)
    finally:
        if relaxed:
            conn.execute("PRAGMA synchronous = FULL")


def _run_transaction(conn: sqlite3.Connection, live: list[_Op]) -> list[_Outcome]:
    outcomes: list[_Outcome] = []
    try:
        conn.execute("BEGIN IMMEDIATE" if any(op.writes for op in live) else "BEGIN")
        for op in live:
            assert op.work is not None
            if op.writes:
                conn.execute("SAVEPOINT op")
            try:
                result = op.work(conn)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting task
                if op.writes:
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                outcomes.append((op, None, _as_store_error(exc)))
            else:
                if op.writes:
                    conn.execute("RELEASE op")
                outcomes.append((op, result, None))
        conn.execute("COMMIT")
    except Exception as exc:  # BEGIN or COMMIT failed: nothing in the batch is durable
        log.exception("conversation store transaction failed")
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:  # pragma: no cover - the connection is broken anyway
                log.exception("rollback failed")
        error = _as_store_error(exc)
        return [(op, None, error) for op in live]
    return outcomes


def _settle(outcomes: list[_Outcome]) -> None:
    """Resolve the futures on their loops: one hop per loop per batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    for outcome in outcomes:
        by_loop.setdefault(outcome[0].loop, []).append(outcome)
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, items)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _resolve(outcomes: list[_Outcome]) -> None:
    for op, result, error in outcomes:
        if op.future.done():  # the caller was cancelled
            continue
        if error is not None:
            op.future.set_exception(error)
        else:
            op.future.set_result(result)


def _as_store_error(exc: BaseException) -> BaseException:
    """SQLite's own errors as a typed :class:`StoreFailed`; typed errors unchanged."""
    if isinstance(exc, sqlite3.Error):
        error = StoreFailed("The conversation store failed.")
        error.__cause__ = exc
        return error
    return exc
