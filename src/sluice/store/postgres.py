"""The conversation store in PostgreSQL: several sluice processes share one database.

Writes to conversations and responses go, as in the SQLite store, through one
writer: a task owning a connection of its own, which takes every write waiting
(up to ``_MAX_BATCH``) into one transaction, commits once and only then tells
the callers. So writes apply in the order they were called, concurrent turns
share one commit, and a write whose caller was cancelled still happens. Each
conversation's row is locked (``FOR UPDATE``) while a message is added, so two
processes continuing one conversation make one chain.

A batch goes pipelined, in two round trips: every write's statements at once
(the ``add_messages`` writes in a row as one call of the schema's
``sluice_add_messages``, which checks under the row lock what the caller's plan
took for granted and reports a broken rule rather than raising), then the
commit once all have answered. A write the database refuses (a deadlock lost to another
process, an id another process took) rolls that transaction back, and the batch
runs again one write at a time, each in its own savepoint: the failing write
fails alone, one that lost a deadlock is retried in its savepoint. A batch with a
write that has no pipelined form runs that way from the start.

Reads, the usage ledger and the limits' counters use a pool of connections
instead, concurrently (paths asked in one turn of the event loop, as when a
batch's commit resumes several turns, are read in one query): the ledger and
the counters are not ordered with the conversations, and each runs in a
transaction of its own (a usage upsert or a counter never waits behind a batch,
and never holds another process's rows in an order that could deadlock). ``take_request`` is one call of a function the
schema defines, atomic across processes under an advisory lock on the key.

Processes: each open store registers an *instance* (a row of ``instances``,
refreshed by a heartbeat every ``heartbeat`` seconds), and every stored
response records the instance that stored it. A response left ``queued`` or
``in_progress`` belongs to a live run somewhere unless its instance is gone:
:meth:`end_unfinished_responses` fails only those of this instance's id and of
instances not seen for ``dead_after`` seconds, and after it has been called
once, the heartbeat keeps failing those of instances that die later.

Background responses (:class:`~sluice.store.repository.RunEvents`): the instance
running one stores its events (``response_events``, written in batches by the
caller), so another can resume its stream from the database; a cancel asked
through another instance is a flag on the response (``cancel_requested``) the
running instance polls for. Both are also announced (``NOTIFY``, delivered at the
write's commit) to every instance's listener, a connection of its own that
``LISTEN``s: a follower reads new events as soon as they are stored and a cancel
reaches its run at once; the polls stay, slower, for word lost while a listener
reconnects. Events go when the run's grace ends, with their response, or (an
instance that died left them) an hour old at a heartbeat.

Example::

    store = await PostgresStore.open("postgresql://sluice:secret@db.internal/sluice")
    conversation = await store.create_conversation(owner="alice", user_id=None, model="m")
    await store.add_message(conversation.id, NewMessage(role="user", content="Hi"))
    await store.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from sluice.store.common import (
    ADD_USAGE,
    CONVERSATION_COLUMNS,
    INSERT_CONVERSATION,
    MESSAGE_COLUMNS,
    MESSAGE_FIELDS,
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
    is_unfinished,
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
    DuplicateMessageId,
    EventWatch,
    Message,
    NewMessage,
    StoreClosed,
    StoredEvents,
    StoredResponse,
    StoreFailed,
    UnknownConversation,
    UsageRow,
)
from sluice.store.postgres_schema import MIGRATIONS, describe, migrate, scrub

log = logging.getLogger("sluice.store")

T = TypeVar("T")
Conn = psycopg.AsyncConnection[Any]
Work = Callable[[Conn], Awaitable[T]]
# A write as its statements sent (``Send``), and how to read its outcome once the
# server has answered (``Read``): the writer sends a whole batch of them before it
# waits. Read may raise only for a write that changed nothing (an unknown conversation).
Read = Callable[[], Awaitable[T]]
Send = Callable[[Conn], Awaitable[Read[T]]]

_MAX_BATCH = 256
_DEADLOCK_RETRIES = 3
_CONNECT_TIMEOUT = 10.0
# The path from a message up to its root. Not common.py's PATH (SQLite's): the step up is
# a lateral lookup by id, which PostgreSQL plans as an index scan a step even on a table
# it has no statistics of yet (the join form got a sequential scan a step: O(n^2)), and
# the chain carries the columns, so no join over all messages picks them up after.
_PATHS = f"""
    WITH RECURSIVE chain AS (
        SELECT asked.n AS origin, 0 AS depth, first.*
        FROM unnest(%s::text[]) WITH ORDINALITY AS asked (id, n) CROSS JOIN LATERAL (
            SELECT {MESSAGE_COLUMNS} FROM messages AS m WHERE m.id = asked.id LIMIT 1
        ) AS first
        UNION ALL
        SELECT chain.origin, chain.depth + 1, up.* FROM chain CROSS JOIN LATERAL (
            SELECT {MESSAGE_COLUMNS} FROM messages AS m WHERE m.id = chain.parent_id LIMIT 1
        ) AS up
    )
    SELECT origin, {MESSAGE_COLUMNS} FROM chain ORDER BY origin, depth DESC
"""
# The head in a plan made without reading it: no id (PostgreSQL's text holds no NUL);
# sluice_add_messages puts the head it reads under the lock in its place.
_HEAD = "\0head"
_PARENT = MESSAGE_FIELDS.index("parent_id")


class _Plan:
    """An add_messages write planned without reading the database: the write as
    ``sluice_add_messages`` takes it (``item``), and its outcome from the row it returns
    (raising UnknownConversation, InvalidParent or DuplicateMessageId as the row says)."""

    __slots__ = ("batch", "conversation_id", "head_parent", "item", "stored")

    def __init__(
        self, conversation_id: str, batch: tuple[NewMessage, ...], advance: bool, clock: Clock
    ) -> None:
        parents: list[str] = []  # named parents, taken for this conversation's
        ids: list[str] = []  # caller-given ids, taken for free

        def parent_conversation(message_id: str) -> str:
            parents.append(message_id)
            return conversation_id

        def taken(message_id: str) -> bool:
            ids.append(message_id)
            return False

        self.conversation_id = conversation_id
        self.batch = batch
        self.stored = plan_messages(
            conversation_id,
            head=_HEAD,
            batch=batch,
            parent_conversation=parent_conversation,
            taken=taken,
            now=clock.now,
        )
        self.head_parent = self.stored[0].parent_id == _HEAD
        rows = [list(message_row(message)) for message in self.stored]
        if self.head_parent:
            rows[0][_PARENT] = None  # the function's to fill
        self.item = {
            "conversation": conversation_id,
            "advance": advance,
            "now": clock.now(),
            "head_parent": self.head_parent,
            "parents": parents,
            "ids": ids,
            "messages": rows,
        }

    def outcome(self, row: Sequence[Any]) -> list[Message]:
        known, head, missing, taken_ids = row
        if not known:
            raise UnknownConversation(self.conversation_id)
        if missing or taken_ids:  # nothing was written: raise the rule broken first
            plan_messages(
                self.conversation_id,
                head=head,
                batch=self.batch,
                parent_conversation=lambda m: None if m in missing else self.conversation_id,
                taken=taken_ids.__contains__,
                now=time.time,
            )
            raise AssertionError(f"the plan of {missing} {taken_ids} broke no rule")
        if self.head_parent:
            self.stored[0] = dataclasses.replace(self.stored[0], parent_id=head)
        return self.stored


async def _send_plans(conn: Conn, plans: list[_Plan]) -> list[Read[list[Message]]]:
    """``plans`` sent as one call; how to read each one's outcome once answered."""
    cursor = await conn.execute(
        "SELECT known, head, missing_parents, taken_ids FROM sluice_add_messages(%s::jsonb)",
        (to_json([plan.item for plan in plans]),),
    )
    rows: list[Any] = []

    async def read(plan: _Plan, k: int) -> list[Message]:
        if not rows:
            rows.extend(await cursor.fetchall())
        return plan.outcome(rows[k])

    return [functools.partial(read, plan, k) for k, plan in enumerate(plans)]


class _Op:
    """One queued write: ``work`` runs on the writer's connection, its outcome goes to
    ``future``; ``send``, when the write has that form, is it pipelined."""

    __slots__ = ("future", "plan", "send", "work")

    def __init__(
        self,
        work: Work[Any] | None,
        future: asyncio.Future[Any],
        send: Send[Any] | None = None,
        plan: Callable[[], _Plan] | None = None,
    ) -> None:
        self.work = work  # None: the close marker
        self.future = future
        self.send = send
        self.plan = plan  # add_messages: what it writes, sent with its neighbours' in one call


_Outcome = tuple[_Op, Any, BaseException | None]


class _Refused(Exception):
    """A statement of a pipelined batch failed: the batch's transaction is rolled back."""


def _sent(send: Send[T]) -> Work[T]:
    """``send`` as a plain write: its statements, then its outcome."""

    async def work(conn: Conn) -> T:
        read = await send(conn)
        return await read()

    return work


EVENTS_CHANNEL = "sluice_events"  # payload: a response id whose new events are stored
CANCEL_CHANNEL = "sluice_cancel"  # payload: a response id whose cancel was requested
_LISTEN_RETRY_MAX = 30.0  # s between a lost listener's attempts, at most


class _Listener:
    """This instance's ``LISTEN`` connection: word of other instances' events and
    cancels, handed to the watches and callbacks waiting for it. Reconnects with a
    backoff when its connection is lost (the watches then say they are not ``live``,
    and whoever waits looks on its own)."""

    def __init__(self, connect: Callable[[], Awaitable[Conn]]) -> None:
        self._connect = connect
        self._watches: dict[str, set[EventWatch]] = {}
        self._cancels: list[Callable[[str], None]] = []
        self._task: asyncio.Task[None] | None = None
        self.live = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._listen(), name="sluice-store-listener"
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def watch(self, response_id: str) -> EventWatch:
        watch = EventWatch(lambda: self.live, functools.partial(self._forget, response_id))
        self._watches.setdefault(response_id, set()).add(watch)
        return watch

    def _forget(self, response_id: str, watch: EventWatch) -> None:
        watches = self._watches.get(response_id)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[response_id]

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        self._cancels.append(callback)

    async def _listen(self) -> None:
        delay = 0.5
        while True:
            try:
                conn = await self._connect()
                async with conn:
                    await conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                    await conn.execute(f"LISTEN {CANCEL_CHANNEL}")
                    self.live = True
                    delay = 0.5
                    self._wake_all()  # word may have been lost while not listening
                    async for notice in conn.notifies():
                        self._heard(notice.channel, notice.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - lost: listen again after a pause
                if self.live:
                    log.warning("the store's listener lost its connection: %s", exc)
            finally:
                self.live = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, _LISTEN_RETRY_MAX)

    def _heard(self, channel: str, payload: str) -> None:
        if channel == EVENTS_CHANNEL:
            for watch in self._watches.get(payload, ()):
                watch.notify()
        elif channel == CANCEL_CHANNEL:
            for callback in list(self._cancels):
                try:
                    callback(payload)
                except Exception:  # a callback's bug must not end the listening
                    log.exception("a cancel callback failed for %s", payload)

    def _wake_all(self) -> None:
        for watches in self._watches.values():
            for watch in watches:
                watch.notify()


class PostgresStore:
    """:class:`~sluice.store.repository.ConversationStore` on a PostgreSQL database.

    Open it with :meth:`open` (not the constructor), with a ``postgresql://`` URL.

    Example::

        async with await PostgresStore.open("postgresql://app@localhost/sluice") as store:
            conversation = await store.create_conversation(owner="", user_id=None, model=None)
            print(await store.messages(conversation.id))  # []
    """

    shared = True  # other processes may use the same database: counters live here

    def __init__(self, url: str, instance: str, heartbeat: float, dead_after: float) -> None:
        self.location = describe(url)  # never the password
        self.instance = instance
        self._url = url
        self._heartbeat_every = heartbeat
        self._dead_after = dead_after
        self._queue: asyncio.Queue[_Op] = asyncio.Queue()
        self._closing = False
        self._closed: asyncio.Future[None] | None = None
        self._clock = Clock()
        self._pruner = Pruner()
        self._writer_conn: Conn | None = None
        self._pool: AsyncConnectionPool[Conn] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._side: set[asyncio.Future[Any]] = set()
        self._unfinished_error: dict[str, Any] | None = None
        self._committing = False  # the writer's batch is past its last write: COMMIT
        self._paths: dict[str, list[asyncio.Future[list[Message]]]] | None = None  # to read
        self._listener = _Listener(self._connect)

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        instance: str | None = None,
        migrations: Sequence[str] = MIGRATIONS,
        pool_size: int = 8,
        heartbeat: float = 10.0,
        dead_after: float = 60.0,
    ) -> PostgresStore:
        """Connect, migrate and register this instance; ready when this returns.

        ``instance`` names this process in the database (default: host, pid and a random
        suffix, new at every start); a stable name lets a restarted process end its own
        unfinished responses at once. An instance whose heartbeat (every ``heartbeat``
        seconds) is older than ``dead_after`` seconds is taken for gone. Raises
        ``StoreFailed`` naming the host and database (never the password).
        """
        if instance is None:
            instance = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        store = cls(url, instance, heartbeat, dead_after)
        try:
            store._writer_conn = await store._connect()
            await migrate(store._writer_conn, tuple(migrations), store.location)
            store._pool = AsyncConnectionPool(
                url,
                min_size=1,
                max_size=max(pool_size, 1),
                kwargs={"autocommit": True},
                open=False,
                name="sluice-store",
            )
            await store._pool.open(wait=True, timeout=_CONNECT_TIMEOUT)
            await store._beat()
        except BaseException as exc:
            await store._abandon()
            if isinstance(exc, psycopg.Error | TimeoutError | PoolTimeout):
                detail = scrub(str(exc).strip(), url) or type(exc).__name__
                raise StoreFailed(
                    f"Could not open the conversation store {store.location}: {detail}"
                ) from None
            raise
        loop = asyncio.get_running_loop()
        store._tasks = [
            loop.create_task(store._write_loop(), name="sluice-store-writer"),
            loop.create_task(store._heartbeat_loop(), name="sluice-store-heartbeat"),
        ]
        store._listener.start()
        log.info("conversation store %s opened as instance %s", store.location, instance)
        return store

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the repository -------------------------------------------------

    async def create_conversation(
        self, *, owner: str, user_id: str | None, model: str | None
    ) -> Conversation:
        async def send(conn: Conn) -> Read[Conversation]:
            conversation, values = new_conversation(owner, user_id, model, self._clock.now())
            await conn.execute(_pg(INSERT_CONVERSATION), values)
            return lambda: _done(conversation)

        return await self._write(send)

    async def get_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None
    ) -> Conversation | None:
        async def work(conn: Conn) -> Conversation | None:
            cursor = await conn.execute(
                f"SELECT {CONVERSATION_COLUMNS} FROM conversations"
                f" WHERE id = %s AND owner = %s AND {_user_is(user_id)}",
                (conversation_id, owner, user_id),
            )
            row = await cursor.fetchone()
            return None if row is None else Conversation(*row)

        return await self._call(work, writes=False)

    async def list_conversations(
        self, *, owner: str, user_id: str | None, limit: int, offset: int
    ) -> tuple[list[Conversation], int]:
        check_page(limit, offset)

        async def work(conn: Conn) -> tuple[list[Conversation], int]:
            # seq breaks ties of updated_at, so pages never overlap or skip
            cursor = await conn.execute(
                f"SELECT {CONVERSATION_COLUMNS} FROM conversations"
                f" WHERE owner = %s AND {_user_is(user_id)}"
                " ORDER BY updated_at DESC, seq DESC LIMIT %s OFFSET %s",
                (owner, user_id, limit, offset),
            )
            rows = await cursor.fetchall()
            cursor = await conn.execute(
                f"SELECT COUNT(*) FROM conversations WHERE owner = %s AND {_user_is(user_id)}",
                (owner, user_id),
            )
            total = await cursor.fetchone()
            assert total is not None
            return [Conversation(*row) for row in rows], int(total[0])

        return await self._call(work, writes=False)

    async def delete_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None
    ) -> bool:
        async def send(conn: Conn) -> Read[bool]:
            # the messages and responses go by ON DELETE CASCADE
            cursor = await conn.execute(
                f"DELETE FROM conversations WHERE id = %s AND owner = %s AND {_user_is(user_id)}",
                (conversation_id, owner, user_id),
            )
            return lambda: _done(cursor.rowcount > 0)

        return await self._write(send)

    async def rename_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None, title: str | None
    ) -> Conversation | None:
        async def send(conn: Conn) -> Read[Conversation | None]:
            # A new name is not a new turn: updated_at (the list's order) stays.
            cursor = await conn.execute(
                "UPDATE conversations SET title = %s"
                f" WHERE id = %s AND owner = %s AND {_user_is(user_id)}"
                f" RETURNING {CONVERSATION_COLUMNS}",
                (title, conversation_id, owner, user_id),
            )

            async def read() -> Conversation | None:
                row = await cursor.fetchone()
                return None if row is None else Conversation(*row)

            return read

        return await self._write(send)

    async def add_message(
        self, conversation_id: str, message: NewMessage, *, advance_head: bool = True
    ) -> Message:
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

        def plan() -> _Plan:
            return _Plan(conversation_id, batch, advance_head, self._clock)

        async def work(conn: Conn) -> list[Message]:
            try:
                (read,) = await _send_plans(conn, [plan()])
                return await read()
            except psycopg.errors.UniqueViolation:
                # another process took a caller-given id since we looked
                given = [m.id for m in batch if m.id is not None]
                if not given:
                    raise
                raise DuplicateMessageId(given[0]) from None

        if self._closing:
            raise StoreClosed()
        future: asyncio.Future[list[Message]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Op(work, future, plan=plan))
        return await future

    async def messages(self, conversation_id: str) -> list[Message]:
        async def work(conn: Conn) -> list[Message]:
            cursor = await conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = %s ORDER BY seq",
                (conversation_id,),
            )
            return [message_from_row(row) for row in await cursor.fetchall()]

        return await self._call(work, writes=False)

    async def path(self, message_id: str) -> list[Message]:
        """Paths asked at once (in one turn of the event loop: the turns a batch's
        commit resumed) are read in one query."""
        if self._closing:
            raise StoreClosed()
        loop = asyncio.get_running_loop()
        if self._paths is None:
            self._paths = {}
            loop.call_soon(self._read_paths)
        future: asyncio.Future[list[Message]] = loop.create_future()
        self._paths.setdefault(message_id, []).append(future)
        return await future

    def _read_paths(self) -> None:
        asked, self._paths = self._paths or {}, None
        ids = list(asked)

        async def work(conn: Conn) -> dict[int, list[Any]]:
            cursor = await conn.execute(_PATHS, (ids,))
            rows: dict[int, list[Any]] = {}
            for row in await cursor.fetchall():
                rows.setdefault(row[0], []).append(row[1:])
            return rows

        def done(task: asyncio.Future[dict[int, list[Any]]]) -> None:
            for n, message_id in enumerate(ids, start=1):
                waiting = [future for future in asked[message_id] if not future.done()]
                if not waiting:  # (their callers were cancelled)
                    continue
                if task.cancelled():
                    for future in waiting:
                        future.cancel()
                    continue
                try:
                    path = [message_from_row(row) for row in task.result().get(n, ())]
                except BaseException as exc:  # noqa: BLE001 - each caller gets it
                    for future in waiting:
                        future.set_exception(exc)
                    continue
                for future in waiting:
                    future.set_result(list(path))

        task = asyncio.ensure_future(self._pooled(work, retry=True))
        self._side.add(task)  # (close waits for it)
        task.add_done_callback(self._side_done)
        task.add_done_callback(done)

    async def get_message(self, message_id: str) -> Message | None:
        async def work(conn: Conn) -> Message | None:
            cursor = await conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = %s", (message_id,)
            )
            row = await cursor.fetchone()
            return None if row is None else message_from_row(row)

        return await self._call(work, writes=False)

    async def put_response(self, response: StoredResponse) -> None:
        async def send(conn: Conn) -> Read[None]:
            await conn.execute(
                "INSERT INTO responses (id, owner, conversation_id, created_at, body,"
                " input_items, instance, unfinished) VALUES (%s,%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (id) DO UPDATE SET owner = excluded.owner,"
                " conversation_id = excluded.conversation_id,"
                " created_at = excluded.created_at, body = excluded.body,"
                " input_items = excluded.input_items, instance = excluded.instance,"
                " unfinished = excluded.unfinished",
                (
                    response.id,
                    response.owner,
                    response.conversation_id,
                    response.created_at,
                    to_json(response.body),
                    to_json(response.input_items),
                    self.instance,
                    is_unfinished(response.body),
                ),
            )
            return lambda: _done(None)

        await self._write(send)

    async def get_response(self, response_id: str, *, owner: str) -> StoredResponse | None:
        async def work(conn: Conn) -> StoredResponse | None:
            cursor = await conn.execute(_pg(SELECT_RESPONSE), (response_id, owner))
            row = await cursor.fetchone()
            return None if row is None else response_from_row(row)

        return await self._call(work, writes=False)

    async def end_unfinished_responses(self, error: dict[str, Any]) -> int:
        self._unfinished_error = error  # the heartbeat ends those of instances dying later
        return await self._call(self._end_orphans, writes=True)

    async def delete_response(self, response_id: str, *, owner: str) -> bool:
        async def work(conn: Conn) -> bool:
            cursor = await conn.execute(
                "DELETE FROM responses WHERE id = %s AND owner = %s", (response_id, owner)
            )
            if cursor.rowcount == 0:
                return False
            await conn.execute("DELETE FROM response_events WHERE response_id = %s", (response_id,))
            return True

        return await self._call(work, writes=True)

    # -- a run's events, a cancel through another instance -------------------

    async def add_events(self, rows: Sequence[tuple[str, int, bytes]]) -> None:
        if not rows:
            return

        async def work(conn: Conn) -> None:
            async with conn.transaction(), conn.cursor() as cursor:
                await cursor.executemany(
                    "INSERT INTO response_events (response_id, seq, frame) VALUES (%s,%s,%s)"
                    " ON CONFLICT DO NOTHING",
                    rows,
                )
                # Delivered at the commit: the followers read what this wrote.
                await cursor.execute(
                    f"SELECT pg_notify('{EVENTS_CHANNEL}', id) FROM unnest(%s::text[]) AS id",
                    (sorted({row[0] for row in rows}),),
                )

        await self._aside(work, writes=True)

    async def events_after(
        self, response_id: str, *, owner: str, after: int
    ) -> StoredEvents | None:
        async def work(conn: Conn) -> StoredEvents | None:
            # The response first: once it reads finished, its run stored all its events.
            cursor = await conn.execute(
                "SELECT body, unfinished FROM responses WHERE id = %s AND owner = %s",
                (response_id, owner),
            )
            row = await cursor.fetchone()
            if row is None:
                return None
            cursor = await conn.execute(
                "SELECT seq, frame FROM response_events WHERE response_id = %s AND seq > %s"
                " ORDER BY seq",
                (response_id, after),
            )
            frames = [(int(seq), bytes(frame)) for seq, frame in await cursor.fetchall()]
            last = frames[-1] if frames else None
            if last is None:
                cursor = await conn.execute(
                    "SELECT seq, frame FROM response_events WHERE response_id = %s"
                    " ORDER BY seq DESC LIMIT 1",
                    (response_id,),
                )
                found = await cursor.fetchone()
                last = None if found is None else (int(found[0]), bytes(found[1]))
            return StoredEvents(from_json(row[0]), bool(row[1]), frames, last)

        return await self._aside(work, writes=False)

    async def delete_events(self, response_id: str) -> None:
        async def work(conn: Conn) -> None:
            await conn.execute("DELETE FROM response_events WHERE response_id = %s", (response_id,))

        await self._aside(work, writes=True)

    async def request_cancel(self, response_id: str, *, owner: str) -> bool:
        async def work(conn: Conn) -> bool:
            cursor = await conn.execute(
                "WITH asked AS (UPDATE responses SET cancel_requested = true"
                " WHERE id = %s AND owner = %s AND unfinished RETURNING id)"
                f" SELECT pg_notify('{CANCEL_CHANNEL}', id) FROM asked",
                (response_id, owner),
            )
            return cursor.rowcount > 0

        return await self._aside(work, writes=True)

    def watch(self, response_id: str) -> EventWatch:
        return self._listener.watch(response_id)

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        self._listener.on_cancel(callback)

    async def cancels_requested(self, response_ids: Sequence[str]) -> list[str]:
        if not response_ids:
            return []

        async def work(conn: Conn) -> list[str]:
            cursor = await conn.execute(
                "SELECT id FROM responses WHERE id = ANY(%s) AND cancel_requested ORDER BY id",
                (list(response_ids),),
            )
            return [str(row[0]) for row in await cursor.fetchall()]

        return await self._aside(work, writes=False)

    # -- the usage ledger and the limits' counters ------------------------

    async def add_usage(self, rows: Sequence[UsageRow]) -> None:
        values = merge_usage(rows)  # one order for every process: no deadlock
        if not values:
            return

        async def work(conn: Conn) -> None:
            async with conn.transaction(), conn.cursor() as cursor:
                await cursor.executemany(_pg(ADD_USAGE), values)

        await self._aside(work, writes=True)

    async def usage(
        self, *, key: str | None = None, since: str | None = None, until: str | None = None
    ) -> list[UsageRow]:
        params = usage_params(key, since, until)

        async def work(conn: Conn) -> list[UsageRow]:
            cursor = await conn.execute(_pg(SELECT_USAGE), params)
            return [UsageRow(*row) for row in await cursor.fetchall()]

        return await self._aside(work, writes=False)

    async def take_request(self, key: str, *, limit: int, window: float, now: float) -> float:
        check_window(limit, window)

        async def work(conn: Conn) -> float:
            await self._prune(conn, now)
            cursor = await conn.execute(
                "SELECT admitted, oldest FROM sluice_take_request(%s, %s, %s, %s)",
                (key, limit, window, now),
            )
            row = await cursor.fetchone()
            assert row is not None
            admitted, oldest = row
            return 0.0 if admitted else retry_after(oldest, window, now)

        return await self._aside(work, writes=True)

    async def add_tokens(self, key: str, tokens: int, now: float) -> None:
        async def work(conn: Conn) -> None:
            await self._prune(conn, now)
            await conn.execute(
                "INSERT INTO rate_tokens (key, at, tokens) VALUES (%s, %s, %s)",
                (key, now, tokens),
            )

        await self._aside(work, writes=True)

    async def tokens_since(self, key: str, since: float) -> tuple[int, float | None]:
        async def work(conn: Conn) -> tuple[int, float | None]:
            cursor = await conn.execute(_pg(TOKENS_SINCE), (key, since))
            row = await cursor.fetchone()
            assert row is not None
            return int(row[0]), row[1]

        return await self._aside(work, writes=False)

    async def take_stream(self, key: str, limit: int) -> int | None:
        """A lease on one of ``key``'s ``limit`` streams in flight across the instances
        (its id), or None when they are all held."""

        async def work(conn: Conn) -> int | None:
            cursor = await conn.execute(
                "SELECT sluice_take_stream(%s, %s, %s, %s)",
                (key, limit, self.instance, self._dead_after),
            )
            row = await cursor.fetchone()
            assert row is not None
            return None if row[0] is None else int(row[0])

        return await self._aside(work, writes=True)

    async def drop_stream(self, lease: int) -> None:
        """The stream ``lease`` was taken for ended."""

        async def work(conn: Conn) -> None:
            await conn.execute("DELETE FROM stream_leases WHERE id = %s", (lease,))

        await self._aside(work, writes=True)

    async def close(self) -> None:
        if self._closed is None:
            self._closing = True
            self._closed = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._closed)

    # -- how calls run --------------------------------------------------

    async def _call(self, work: Work[T], *, writes: bool) -> T:
        """A write goes to the writer (queued now, at call time: the order of calls is the
        order of writes); a read runs at once on a pooled connection."""
        if self._closing:
            raise StoreClosed()
        if not writes:
            return await self._pooled(work, retry=True)
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Op(work, future))
        return await future

    async def _write(self, send: Send[T], work: Work[T] | None = None) -> T:
        """A write that can be pipelined (``send``) to the writer; ``work`` runs it on
        its own when its batch could not be (default: ``send``, then its outcome)."""
        if self._closing:
            raise StoreClosed()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Op(work or _sent(send), future, send))
        return await future

    async def _aside(self, work: Work[T], *, writes: bool) -> T:
        """``work`` on a pooled connection, beside the writer; a write is not undone by
        its caller's cancellation (it runs on, and close waits for it)."""
        if self._closing:
            raise StoreClosed()
        if not writes:
            return await self._pooled(work, retry=True)
        task = asyncio.ensure_future(self._pooled(work, retry=False))
        self._side.add(task)
        task.add_done_callback(self._side_done)
        return await asyncio.shield(task)

    def _side_done(self, task: asyncio.Future[Any]) -> None:
        self._side.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # retrieved here, so a write whose caller left does not warn "never retrieved"
            log.debug("a store write failed: %s", task.exception())

    async def _pooled(self, work: Work[T], *, retry: bool) -> T:
        """``work`` on a pooled connection. ``retry``: once more on another connection if
        this one was dead (the server restarted since it was pooled): for reads only, as
        a write's fate is unknown when its connection dies under it."""
        assert self._pool is not None
        while True:
            conn: Conn | None = None
            try:
                async with self._pool.connection() as conn:
                    return await work(conn)
            except psycopg.Error as exc:
                if not (retry and conn is not None and conn.broken):
                    raise self._failed(exc) from exc
                retry = False

    async def _write_loop(self) -> None:
        while True:
            batch: list[_Op] = [await self._queue.get()]
            while batch[-1].work is not None and len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            stop = batch[-1] if batch[-1].work is None else None
            writes = batch[:-1] if stop is not None else batch
            if writes:
                await self._run_batch(writes)
            if stop is not None:
                stop.future.set_result(None)
                return

    async def _run_batch(self, batch: list[_Op]) -> None:
        """Run ``batch`` in one transaction; every outcome is final only after COMMIT.

        A batch of writes that all can be is pipelined: BEGIN and every write's
        statements go at once, and COMMIT once they are all answered, two round trips
        in all. If a statement fails there (a deadlock, an id another process took),
        the transaction is rolled back and the batch runs again one write at a time,
        each in its savepoint, so that the failing one fails alone."""
        pipelined = all(op.send is not None or op.plan is not None for op in batch)
        attempt = 1
        while True:
            self._committing = False
            try:
                conn = await self._writer()
                if pipelined:
                    outcomes = await self._pipelined(conn, batch)
                else:
                    outcomes = await self._one_by_one(conn, batch)
                break
            except _Refused:
                pipelined = False
            except Exception as exc:  # noqa: BLE001 - connect, BEGIN or a write's connection failed
                # Nothing of the batch is durable, unless the connection died during
                # COMMIT (then nobody knows). A connection found dead before COMMIT (the
                # server restarted while it was idle) is replaced and the batch run again.
                writer = self._writer_conn
                if attempt == 1 and not self._committing and writer is not None and writer.broken:
                    attempt += 1
                    continue
                error = self._failed(exc)
                outcomes = [(op, None, error) for op in batch]
                break
        for op, result, op_error in outcomes:
            if op.future.done():  # the caller was cancelled
                continue
            if op_error is not None:
                op.future.set_exception(op_error)
            else:
                op.future.set_result(result)

    async def _pipelined(self, conn: Conn, batch: list[_Op]) -> list[_Outcome]:
        """``batch`` sent at once in one transaction; raises ``_Refused`` (all rolled
        back) if a statement failed, and the connection's error if it died.

        Two round trips: the writes, then, once every write has answered, the commit,
        so a connection dying in the first leaves nothing committed. A batch of
        add_messages writes only is one call, in the implicit transaction PostgreSQL
        keeps open until the pipeline's next Sync: its answer comes back for a Flush,
        and the Sync commits (or, after an error, rolls back). Other batches run in a
        transaction of this method's own (not ``conn.transaction()``, which in
        pipeline mode waits for BEGIN alone and syncs thrice more): BEGIN and the
        writes then a Sync, COMMIT then a Sync."""
        implicit = all(op.plan is not None for op in batch)
        outcomes: list[_Outcome] = []
        try:
            async with conn.pipeline() as pipeline:
                try:
                    if not implicit:
                        await conn.execute(b"BEGIN", prepare=False)
                    reads: list[Read[Any] | BaseException | None] = [None] * len(batch)
                    plans: dict[int, _Plan] = {}  # add_messages in a row: one call
                    for i, op in enumerate([*batch, None]):
                        if plans and (op is None or op.plan is None):
                            sent = await _send_plans(conn, list(plans.values()))
                            for k, sent_read in zip(plans, sent, strict=True):
                                reads[k] = sent_read
                            plans = {}
                        if op is None:
                            break
                        try:
                            if op.plan is not None:
                                plans[i] = op.plan()
                                continue
                            assert op.send is not None
                            reads[i] = await op.send(conn)
                        except psycopg.Error:
                            raise
                        except Exception as exc:  # noqa: BLE001 - failed before it was sent
                            reads[i] = exc
                    if not implicit:
                        await pipeline.sync()
                    for op, answer in zip(batch, reads, strict=True):
                        assert answer is not None
                        if isinstance(answer, BaseException):
                            outcomes.append((op, None, answer))
                            continue
                        try:  # (implicit: the first read flushes, and fetches all)
                            outcomes.append((op, await answer(), None))
                        except psycopg.Error:
                            raise
                        except Exception as exc:  # noqa: BLE001 - handed to the awaiting task
                            outcomes.append((op, None, exc))
                except BaseException:
                    if not conn.broken:  # roll the failed transaction back
                        with contextlib.suppress(psycopg.Error):
                            # after an error the server skips all to the next Sync (which
                            # ends an implicit transaction): a ROLLBACK must come after it
                            await pipeline.sync()
                        if not implicit:
                            with contextlib.suppress(psycopg.Error):  # (sent as it ends)
                                await conn.execute(b"ROLLBACK", prepare=False)
                    raise
                self._committing = True
                if not implicit:
                    await conn.execute(b"COMMIT", prepare=False)
                # (the pipeline's end: a Sync, its answer awaited)
        except psycopg.Error as exc:
            if conn.broken:
                raise
            raise _Refused() from exc
        return outcomes

    async def _one_by_one(self, conn: Conn, batch: list[_Op]) -> list[_Outcome]:
        outcomes: list[_Outcome] = []
        async with conn.transaction():
            for op in batch:
                outcomes.append(await self._in_savepoint(conn, op))
            self._committing = True
        return outcomes

    async def _in_savepoint(self, conn: Conn, op: _Op) -> _Outcome:
        """One write in its own savepoint: a failing one is rolled back alone; one that
        lost a deadlock to another process is tried again."""
        assert op.work is not None
        for attempt in range(1, _DEADLOCK_RETRIES + 1):
            try:
                async with conn.transaction():
                    return op, await op.work(conn), None
            except psycopg.errors.TransactionRollback as exc:
                if attempt == _DEADLOCK_RETRIES:
                    return op, None, self._failed(exc)
            except psycopg.OperationalError:
                raise  # the connection is gone: the whole batch failed
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting task
                return op, None, self._failed(exc) if isinstance(exc, psycopg.Error) else exc
        raise AssertionError("unreachable")

    async def _writer(self) -> Conn:
        conn = self._writer_conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                await conn.close()
            self._writer_conn = None
            self._writer_conn = conn = await self._connect()
        return conn

    async def _connect(self) -> Conn:
        return await psycopg.AsyncConnection.connect(
            self._url, autocommit=True, connect_timeout=int(_CONNECT_TIMEOUT)
        )

    async def _end_orphans(self, conn: Conn, *, own: bool = True) -> int:
        """Fail the unfinished responses of instances gone, and (``own``: at start) those
        this instance's id left. The heartbeat passes ``own`` False: this instance's
        unfinished responses are then its live runs."""
        assert self._unfinished_error is not None
        cursor = await conn.execute(
            "SELECT r.id, r.body FROM responses AS r"
            " WHERE r.unfinished AND (r.instance IS NULL OR (r.instance = %s AND %s)"
            "   OR (r.instance <> %s AND NOT EXISTS ("
            "   SELECT 1 FROM instances AS i WHERE i.id = r.instance"
            "   AND i.last_seen > clock_timestamp() - make_interval(secs => %s))))"
            " ORDER BY r.id FOR UPDATE OF r SKIP LOCKED",
            (self.instance, own, self.instance, self._dead_after),
        )
        rows = await cursor.fetchall()
        if rows:
            async with conn.cursor() as update:
                await update.executemany(
                    "UPDATE responses SET body = %s, unfinished = false WHERE id = %s",
                    [
                        (to_json(failed_body(from_json(text), self._unfinished_error)), id_)
                        for id_, text in rows
                    ],
                )
        return len(rows)

    async def _end_orphan_runs(self, conn: Conn) -> int:
        return await self._end_orphans(conn, own=False)

    async def _prune(self, conn: Conn, now: float) -> None:
        cutoff = self._pruner.due(now)
        if cutoff is not None:
            await conn.execute("DELETE FROM rate_requests WHERE at <= %s", (cutoff,))
            await conn.execute("DELETE FROM rate_tokens WHERE at <= %s", (cutoff,))

    async def _beat(self) -> None:
        assert self._pool is not None
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO instances (id) VALUES (%s)"
                " ON CONFLICT (id) DO UPDATE SET last_seen = clock_timestamp()",
                (self.instance,),
            )
            # Streams in flight of instances gone (they no longer count).
            await conn.execute(
                "DELETE FROM stream_leases AS l WHERE NOT EXISTS ("
                "   SELECT 1 FROM instances AS i WHERE i.id = l.instance"
                "   AND i.last_seen > clock_timestamp() - make_interval(secs => %s))",
                (self._dead_after,),
            )
            # Events an instance that died left (a live one prunes its own at its runs'
            # grace): those an hour old, of responses no longer running.
            await conn.execute(
                "DELETE FROM response_events AS e"
                " WHERE e.at < clock_timestamp() - interval '1 hour' AND NOT EXISTS ("
                "   SELECT 1 FROM responses AS r WHERE r.id = e.response_id AND r.unfinished)"
            )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_every)
            try:
                await self._beat()
                if self._unfinished_error is not None and not self._closing:
                    ended = await self._call(self._end_orphan_runs, writes=True)
                    if ended:
                        log.warning(
                            "%d background response(s) of a stopped sluice instance are now failed",
                            ended,
                        )
            except StoreClosed:
                return
            except Exception:  # the next beat tries again
                log.warning("conversation store heartbeat failed", exc_info=True)

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        stopped: asyncio.Future[None] = loop.create_future()
        writer, heartbeat = self._tasks
        self._queue.put_nowait(_Op(None, stopped))
        await writer  # every write queued before close is done
        await self._listener.stop()
        heartbeat.cancel()
        await asyncio.gather(heartbeat, *self._side, return_exceptions=True)
        if self._pool is not None:
            try:  # gone at once: another instance may end this one's unfinished responses
                async with self._pool.connection() as conn:
                    await conn.execute("DELETE FROM instances WHERE id = %s", (self.instance,))
                    await conn.execute(
                        "DELETE FROM stream_leases WHERE instance = %s", (self.instance,)
                    )
            except psycopg.Error:
                log.warning("could not unregister instance %s", self.instance, exc_info=True)
        await self._abandon()

    async def _abandon(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self._writer_conn is not None:
            await self._writer_conn.close()

    def _failed(self, exc: BaseException) -> StoreFailed:
        """PostgreSQL's error as the typed one the caller's client sees (which names no
        database); the log names the database and why, never its password."""
        if isinstance(exc, StoreFailed):
            return exc
        detail = scrub(str(exc).strip(), self._url) or type(exc).__name__
        log.error("conversation store %s failed: %s", self.location, detail)
        error = StoreFailed("The conversation store failed.")
        error.__cause__ = exc
        return error


async def _done(value: T) -> T:
    return value


def _user_is(user_id: str | None) -> str:
    """The condition ``user_id IS %s`` as PostgreSQL answers it from the index (``IS NOT
    DISTINCT FROM`` it cannot); it takes the one parameter either way."""
    return "user_id IS NULL AND %s::text IS NULL" if user_id is None else "user_id = %s"


def _pg(sql: str) -> str:
    """Shared SQL (``?`` parameters) as psycopg takes it (``%s``)."""
    return sql.replace("?", "%s")
