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
import dataclasses
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from sluice.core.errors import InvalidRequest
from sluice.store.models import (
    CONVERSATION_PREFIX,
    MESSAGE_PREFIX,
    MESSAGE_STATUSES,
    ROOT,
    Conversation,
    DuplicateMessageId,
    InvalidParent,
    Message,
    NewMessage,
    StoreClosed,
    StoredResponse,
    StoreFailed,
    UnknownConversation,
    new_id,
)
from sluice.store.schema import MIGRATIONS, connect

log = logging.getLogger("sluice.store")

T = TypeVar("T")

# Enough to share one fsync among every turn that ends at about the same time,
# small enough that one transaction never holds the writer for long.
_MAX_BATCH = 256

_CONVERSATION_COLUMNS = (
    "id, owner, user_id, model, created_at, updated_at, head_id, message_count, title"
)
# The columns are the dataclass's fields, in its order: a row is a Message's arguments.
_MESSAGE_FIELDS = tuple(field.name for field in dataclasses.fields(Message))
_MESSAGE_COLUMNS = ", ".join(_MESSAGE_FIELDS)
_MESSAGE_SLOTS = ", ".join("?" for _ in _MESSAGE_FIELDS)
_JSON_FIELDS = frozenset({"content", "tool_calls", "usage"})


class _Op:
    """One queued operation: ``work`` runs on the store thread, its outcome goes to ``future``."""

    __slots__ = ("future", "loop", "work", "writes")

    def __init__(
        self,
        work: Callable[[sqlite3.Connection], Any] | None,
        writes: bool,
        future: asyncio.Future[Any],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.work = work  # None: the close marker
        self.writes = writes
        self.future = future
        self.loop = loop


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

    def __init__(self, path: str) -> None:
        self.location = path  # the file, or ":memory:"
        self._queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._closing = False
        self._closed: asyncio.Future[None] | None = None
        self._last_time = 0.0  # only touched on the store thread

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
            now = self._now()
            conversation = Conversation(
                id=new_id(CONVERSATION_PREFIX),
                owner=owner,
                user_id=user_id,
                model=model,
                created_at=now,
                updated_at=now,
                head_id=None,
                message_count=0,
            )
            conn.execute(
                f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",
                (conversation.id, owner, user_id, model, now, now, None, 0, None),
            )
            return conversation

        return await self._call(work, writes=True)

    async def get_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None
    ) -> Conversation | None:
        def work(conn: sqlite3.Connection) -> Conversation | None:
            row = conn.execute(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations"
                " WHERE id = ? AND owner = ? AND user_id IS ?",
                (conversation_id, owner, user_id),
            ).fetchone()
            return None if row is None else Conversation(*row)

        return await self._call(work, writes=False)

    async def list_conversations(
        self, *, owner: str, user_id: str | None, limit: int, offset: int
    ) -> tuple[list[Conversation], int]:
        if limit < 0:
            raise InvalidRequest("'limit' must be 0 or more", param="limit")
        if offset < 0:
            raise InvalidRequest("'offset' must be 0 or more", param="offset")

        def work(conn: sqlite3.Connection) -> tuple[list[Conversation], int]:
            # rowid breaks ties of updated_at, so pages never overlap or skip
            rows = conn.execute(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations"
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
                f" RETURNING {_CONVERSATION_COLUMNS}",
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
        batch = tuple(messages)
        for new in batch:
            if new.status not in MESSAGE_STATUSES:
                raise InvalidRequest(f"Unknown message status '{new.status}'", param="status")
        if not batch:
            return []

        def work(conn: sqlite3.Connection) -> list[Message]:
            return self._insert_messages(conn, conversation_id, batch, advance_head)

        return await self._call(work, writes=True)

    async def messages(self, conversation_id: str) -> list[Message]:
        def work(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
            return [_message(row) for row in rows]

        return await self._call(work, writes=False)

    async def path(self, message_id: str) -> list[Message]:
        def work(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                f"""
                WITH RECURSIVE chain (seq, up, depth) AS (
                    SELECT seq, parent_id, 0 FROM messages WHERE id = ?
                    UNION ALL
                    SELECT m.seq, m.parent_id, chain.depth + 1
                    FROM messages AS m JOIN chain ON m.id = chain.up
                )
                SELECT {_MESSAGE_COLUMNS} FROM chain JOIN messages USING (seq)
                ORDER BY chain.depth DESC
                """,
                (message_id,),
            ).fetchall()
            return [_message(row) for row in rows]

        return await self._call(work, writes=False)

    async def get_message(self, message_id: str) -> Message | None:
        def work(conn: sqlite3.Connection) -> Message | None:
            row = conn.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,)
            ).fetchone()
            return None if row is None else _message(row)

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
                    _json(response.body),
                    _json(response.input_items),
                ),
            )

        await self._call(work, writes=True)

    async def get_response(self, response_id: str, *, owner: str) -> StoredResponse | None:
        def work(conn: sqlite3.Connection) -> StoredResponse | None:
            row = conn.execute(
                "SELECT id, owner, conversation_id, body, input_items, created_at"
                " FROM responses WHERE id = ? AND owner = ?",
                (response_id, owner),
            ).fetchone()
            if row is None:
                return None
            return StoredResponse(row[0], row[1], row[2], _unjson(row[3]), _unjson(row[4]), row[5])

        return await self._call(work, writes=False)

    async def end_unfinished_responses(self, error: dict[str, Any]) -> int:
        def work(conn: sqlite3.Connection) -> int:
            rows = conn.execute(
                "SELECT id, body FROM responses"
                " WHERE json_extract(body, '$.status') IN ('queued', 'in_progress')"
            ).fetchall()
            for response_id, text in rows:
                body = _unjson(text) | {"status": "failed", "error": error}
                conn.execute(
                    "UPDATE responses SET body = ? WHERE id = ?", (_json(body), response_id)
                )
            return len(rows)

        return await self._call(work, writes=True)

    async def delete_response(self, response_id: str, *, owner: str) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            )
            return cursor.rowcount > 0

        return await self._call(work, writes=True)

    async def close(self) -> None:
        if self._closed is None:
            self._closing = True
            loop = asyncio.get_running_loop()
            self._closed = loop.create_future()
            self._queue.put(_Op(None, False, self._closed, loop))
        await asyncio.shield(self._closed)

    # -- the store thread -----------------------------------------------

    async def _call(self, work: Callable[[sqlite3.Connection], T], *, writes: bool) -> T:
        if self._closing:
            raise StoreClosed()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        # Queued now, at call time: the order of calls is the order of writes.
        self._queue.put(_Op(work, writes, future, loop))
        result: T = await future
        return result

    def _now(self) -> float:
        """Unix time, strictly increasing within this store, so "newest first"
        follows write order even when the clock has not ticked between two writes."""
        self._last_time = max(time.time(), self._last_time + 1e-6)
        return self._last_time

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
        previous: str | None = row[0]
        stored: list[Message] = []
        for new in batch:
            parent_id = new.parent_id if new.parent_id is not None else previous
            if parent_id == ROOT:
                parent_id = None  # a second root: a branch from the very start
            elif parent_id is not None:
                # A parent in another conversation would tie two conversations'
                # lifetimes together (deleting one would orphan the other's messages).
                owner_row = conn.execute(
                    "SELECT conversation_id FROM messages WHERE id = ?", (parent_id,)
                ).fetchone()
                if owner_row is None or owner_row[0] != conversation_id:
                    raise InvalidParent(parent_id)
            message_id = new.id if new.id is not None else new_id(MESSAGE_PREFIX)
            if (
                new.id is not None
                and conn.execute("SELECT 1 FROM messages WHERE id = ?", (message_id,)).fetchone()
            ):
                raise DuplicateMessageId(message_id)
            message = Message(
                id=message_id,
                conversation_id=conversation_id,
                parent_id=parent_id,
                role=new.role,
                content=new.content,
                created_at=self._now(),
                status=new.status,
                model=new.model,
                reasoning=new.reasoning,
                tool_calls=new.tool_calls,
                tool_call_id=new.tool_call_id,
                name=new.name,
                usage=new.usage,
                error=new.error,
                finish_reason=new.finish_reason,
            )
            conn.execute(
                f"INSERT INTO messages ({_MESSAGE_COLUMNS}) VALUES ({_MESSAGE_SLOTS})",
                _message_row(message),
            )
            stored.append(message)
            previous = message_id
        conn.execute(
            "UPDATE conversations SET updated_at = ?, message_count = message_count + ?,"
            " head_id = CASE WHEN ? THEN ? ELSE head_id END WHERE id = ?",
            (self._now(), len(stored), advance_head, previous, conversation_id),
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


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _unjson(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _message_row(message: Message) -> tuple[Any, ...]:
    return tuple(
        _json(getattr(message, field)) if field in _JSON_FIELDS else getattr(message, field)
        for field in _MESSAGE_FIELDS
    )


def _message(row: tuple[Any, ...]) -> Message:
    return Message(
        *(
            _unjson(value) if field in _JSON_FIELDS else value
            for field, value in zip(_MESSAGE_FIELDS, row, strict=True)
        )
    )
