"""Server-side conversations: a repository interface and its SQLite implementation.

Example::

    from sluice.store import NewMessage, SQLiteStore

    store = await SQLiteStore.open(data_dir / "conversations.db")
    conversation = await store.create_conversation(owner="alice", user_id=None, model="m")
    await store.add_message(conversation.id, NewMessage(role="user", content="Hi"))
"""

from sluice.store.models import (
    ROOT,
    Conversation,
    DuplicateMessageId,
    InvalidParent,
    Message,
    MessageStatus,
    NewMessage,
    StoreClosed,
    StoredResponse,
    StoreFailed,
    UnknownConversation,
)
from sluice.store.repository import ConversationStore
from sluice.store.schema import MIGRATIONS
from sluice.store.sqlite import SQLiteStore

__all__ = [
    "MIGRATIONS",
    "ROOT",
    "Conversation",
    "ConversationStore",
    "DuplicateMessageId",
    "InvalidParent",
    "Message",
    "MessageStatus",
    "NewMessage",
    "SQLiteStore",
    "StoreClosed",
    "StoreFailed",
    "StoredResponse",
    "UnknownConversation",
]
