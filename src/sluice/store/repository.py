"""The repository interface the routes program against: SQLite and PostgreSQL implement it.

Every method is a coroutine that never blocks the event loop. A write is
durable (committed) when its coroutine returns, and writes are applied in
the order they were called (within one process: several sluice processes
may share one PostgreSQL database).

Example::

    store: ConversationStore = await SQLiteStore.open(path)
    conversation = await store.create_conversation(owner="alice", user_id=None, model="m")
    await store.add_message(conversation.id, NewMessage(role="user", content="Hi"))
    history = await store.path(conversation.head_id or "")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sluice.store.models import (
    Conversation,
    EventWatch,
    Message,
    NewMessage,
    StoredEvents,
    StoredResponse,
    UsageRow,
)


class ConversationStore(Protocol):
    """Server-side conversations and their message trees.

    Ownership: a conversation belongs to ``owner`` (an API key's name) and
    ``user_id``; lookups by another owner or user answer as if it did not
    exist, so the caller's 404 never confirms a foreign id. ``user_id`` None
    matches only conversations made without one.

    Example::

        page, total = await store.list_conversations(
            owner="alice", user_id=None, limit=20, offset=0
        )
    """

    async def create_conversation(
        self, *, owner: str, user_id: str | None, model: str | None
    ) -> Conversation:
        """A new empty conversation (no messages, ``head_id`` None), committed."""
        ...

    async def get_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None
    ) -> Conversation | None:
        """The conversation, or None if unknown or someone else's."""
        ...

    async def list_conversations(
        self, *, owner: str, user_id: str | None, limit: int, offset: int
    ) -> tuple[list[Conversation], int]:
        """One page of the caller's conversations, most recently updated first, and the total."""
        ...

    async def delete_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None
    ) -> bool:
        """Delete it with all its messages; False if unknown or someone else's."""
        ...

    async def rename_conversation(
        self, conversation_id: str, *, owner: str, user_id: str | None, title: str | None
    ) -> Conversation | None:
        """Set (or clear, with None) its title; the renamed conversation, None if
        unknown or someone else's. ``updated_at`` stays: a name is not a turn."""
        ...

    async def add_message(
        self, conversation_id: str, message: NewMessage, *, advance_head: bool = True
    ) -> Message:
        """Store one message, committed when this returns.

        Its parent defaults to the conversation's head; ``advance_head`` makes
        it the new head. Bumps the conversation's ``updated_at`` and
        ``message_count``. Raises ``UnknownConversation``, ``InvalidParent``
        or ``DuplicateMessageId``. A caller cancelled while waiting does not
        undo it: once called, the write happens (a turn the client cut off is
        still recorded).
        """
        ...

    async def add_messages(
        self,
        conversation_id: str,
        messages: Sequence[NewMessage],
        *,
        advance_head: bool = True,
    ) -> list[Message]:
        """Store several messages in one transaction (all or none), as a chain.

        The first's parent defaults to the head, each next one's to the one
        before it; ``advance_head`` makes the last one the new head.
        """
        ...

    async def messages(self, conversation_id: str) -> list[Message]:
        """Every message of the conversation (all branches), in creation order."""
        ...

    async def path(self, message_id: str) -> list[Message]:
        """The root .. ``message_id`` through parent links; empty if unknown."""
        ...

    async def get_message(self, message_id: str) -> Message | None:
        """One message by id (any conversation: the caller checks ownership)."""
        ...

    async def put_response(self, response: StoredResponse) -> None:
        """Store ``response`` (or replace the one with its id: a background response is
        stored when it starts, and again when it ends)."""
        ...

    async def get_response(self, response_id: str, *, owner: str) -> StoredResponse | None:
        """The stored response ``response_id`` of ``owner``; None if unknown or another's."""
        ...

    async def delete_response(self, response_id: str, *, owner: str) -> bool:
        """Forget the response (its messages stay in their conversation); False if
        there was none of ``owner``'s."""
        ...

    async def end_unfinished_responses(self, error: dict[str, Any]) -> int:
        """Responses stored ``queued`` or ``in_progress`` (left by a server that stopped
        while they generated) become ``failed`` with ``error``; how many did."""
        ...

    # -- the usage ledger and the limits' counters ------------------------

    # True when other processes share this store's data (PostgreSQL): the limits'
    # counters must then be kept here; False (SQLite, one process) they may stay in memory.
    shared: bool

    async def add_usage(self, rows: Sequence[UsageRow]) -> None:
        """Add each row's counts to the stored ``(key, model, day)`` totals: an upsert,
        all rows in one transaction. A caller cancelled while waiting does not undo it."""
        ...

    async def usage(
        self, *, key: str | None = None, since: str | None = None, until: str | None = None
    ) -> list[UsageRow]:
        """Stored totals, one row per ``(key, model, day)``, ordered by day, key, model.
        ``key`` None: every key; ``since``/``until``: inclusive ``"YYYY-MM-DD"`` bounds."""
        ...

    async def take_request(self, key: str, *, limit: int, window: float, now: float) -> float:
        """Atomically across every process sharing the database: count ``key``'s requests
        taken in ``(now - window, now]``; if fewer than ``limit``, record one at ``now`` and
        return 0.0; else the seconds until enough of them leave the window for one more
        (with ``limit`` taken: the oldest), always > 0. ``window`` is at most an hour:
        older records are pruned. Requests recorded after ``now`` count too (another
        process read its clock a moment later but took its turn first)."""
        ...

    async def add_tokens(self, key: str, tokens: int, now: float) -> None:
        """Record ``tokens`` used by ``key`` at ``now`` (for tokens-per-minute limits)."""
        ...

    async def tokens_since(self, key: str, since: float) -> tuple[int, float | None]:
        """Tokens ``key`` recorded after ``since``, and the time of the oldest such record
        (None if none). Records older than an hour are pruned."""
        ...

    async def close(self) -> None:
        """Finish every queued write, then close; later calls raise ``StoreClosed``."""
        ...


class RunEvents(Protocol):
    """What a shared store (``shared`` True: PostgreSQL) adds so that several processes
    serve background responses as one: a run's events, readable by every instance, and
    a cancel asked through another instance than the one running it.

    Example::

        await store.add_events([("resp_1", 0, b"event: response.created\n...")])
        got = await store.events_after("resp_1", owner="alice", after=-1)
        await store.request_cancel("resp_1", owner="alice")  # the runner hears of it
        await store.cancels_requested(["resp_1"])              # ["resp_1"]
    """

    async def add_events(self, rows: Sequence[tuple[str, int, bytes]]) -> None:
        """Store ``(response_id, seq, frame)`` rows, all in one transaction (a row already
        stored stays). A caller cancelled while waiting does not undo it."""
        ...

    async def events_after(
        self, response_id: str, *, owner: str, after: int
    ) -> StoredEvents | None:
        """``owner``'s response ``response_id`` (read first) and its stored events of
        sequence number above ``after``; None if unknown or another's."""
        ...

    async def delete_events(self, response_id: str) -> None:
        """Forget the response's stored events (its run's grace ended)."""
        ...

    async def request_cancel(self, response_id: str, *, owner: str) -> bool:
        """Mark ``owner``'s unfinished response to be cancelled by whichever instance runs
        it; False if there is none unfinished."""
        ...

    async def cancels_requested(self, response_ids: Sequence[str]) -> list[str]:
        """Those of ``response_ids`` a cancel was requested for."""
        ...

    def watch(self, response_id: str) -> EventWatch:
        """Word of new events of ``response_id`` stored by any instance (a context
        manager: leaving it stops the word)."""
        ...

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(response_id)`` at once when a cancel of it is requested,
        through any instance (besides :meth:`cancels_requested`, which is the record)."""
        ...
