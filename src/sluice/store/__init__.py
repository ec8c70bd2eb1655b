"""Server-side conversations, stored responses, the usage ledger and the limits' counters:
a repository interface, and its SQLite and PostgreSQL implementations.

:func:`open_store` picks one by the location: a ``postgresql://`` (or ``postgres://``)
URL opens :class:`PostgresStore` (several sluice processes may share the database),
anything else is a SQLite file for :class:`SQLiteStore` (one process).

Example::

    from sluice.store import NewMessage, open_store

    store = await open_store(data_dir / "conversations.db")  # or "postgresql://app@db/sluice"
    conversation = await store.create_conversation(owner="alice", user_id=None, model="m")
    await store.add_message(conversation.id, NewMessage(role="user", content="Hi"))
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sluice.store.common import is_url
from sluice.store.models import (
    ROOT,
    Conversation,
    DuplicateMessageId,
    EventWatch,
    InvalidParent,
    Message,
    MessageStatus,
    NewMessage,
    StoreClosed,
    StoredEvents,
    StoredResponse,
    StoreFailed,
    UnknownConversation,
    UsageRow,
)
from sluice.store.repository import ConversationStore, RunEvents
from sluice.store.schema import MIGRATIONS
from sluice.store.sqlite import SQLiteStore

if TYPE_CHECKING:
    from sluice.store.postgres import PostgresStore


async def open_store(location: str | os.PathLike[str]) -> ConversationStore:
    """The store at ``location``, migrated and ready: PostgreSQL for a ``postgresql://``
    or ``postgres://`` URL, else the SQLite file at that path (``":memory:"``: a private
    in-memory database). Raises ``StoreFailed`` when it cannot be opened; the message
    names the database but never a password."""
    if isinstance(location, str) and is_url(location):
        from sluice.store.postgres import PostgresStore

        return await PostgresStore.open(location)
    return await SQLiteStore.open(location)


def __getattr__(name: str) -> Any:
    # PostgresStore on first use: psycopg takes a tenth of a second to import, which a
    # server on SQLite need not pay.
    if name == "PostgresStore":
        from sluice.store.postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MIGRATIONS",
    "ROOT",
    "Conversation",
    "ConversationStore",
    "DuplicateMessageId",
    "EventWatch",
    "InvalidParent",
    "Message",
    "MessageStatus",
    "NewMessage",
    "PostgresStore",
    "RunEvents",
    "SQLiteStore",
    "StoreClosed",
    "StoreFailed",
    "StoredEvents",
    "StoredResponse",
    "UnknownConversation",
    "UsageRow",
    "open_store",
]
