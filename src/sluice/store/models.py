"""What the store keeps: conversations, and messages that form a tree.

Every message names its parent, so a conversation is a tree rather than a
list: LM Studio's ``previous_response_id`` may continue from any earlier
response, and two follow-ups of one response are two branches. A
conversation's ``head_id`` is the tip of its main line, what the next
``/c1`` turn continues.

Example::

    turn = NewMessage(role="user", content="Hello")
    stored = await store.add_message(conversation.id, turn)
    stored.parent_id  # the conversation's previous head
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Self

from sluice.core.errors import InternalError, InvalidRequest, NotFound, ShuttingDown

MessageStatus = Literal["complete", "incomplete", "failed"]
MESSAGE_STATUSES: tuple[MessageStatus, ...] = ("complete", "incomplete", "failed")

CONVERSATION_PREFIX = "conv_"
MESSAGE_PREFIX = "msg_"
ROOT = ""  # NewMessage.parent_id for a new root (no parent) in a conversation that has one


def new_id(prefix: str) -> str:
    """``prefix`` + 24 hex digits (96 random bits: unguessable, so an id is no capability leak)."""
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One server-side conversation, owned by an API key (and optionally an end user).

    Example::

        conversation = await store.create_conversation(owner="alice", user_id=None, model="m")
        conversation.id  # "conv_" + 24 hex
    """

    id: str
    owner: str  # the API key's name ("" when the server has no keys)
    user_id: str | None  # optional end-user id within one key
    model: str | None
    created_at: float  # unix seconds
    updated_at: float
    head_id: str | None  # the latest message of the main line (what the next turn continues)
    message_count: int
    title: str | None = None  # a name the user gave it (None until renamed)


@dataclass(frozen=True, slots=True)
class Message:
    """A stored message: a node of its conversation's tree.

    Example::

        message = await store.get_message("msg_0123456789abcdef01234567")
        message.parent_id, message.role, message.content
    """

    id: str  # "msg_" + 24 hex unless the caller gave one (LM Studio gives "resp_...")
    conversation_id: str
    parent_id: str | None
    role: str  # system | user | assistant | tool
    content: Any  # JSON-able: a string, OpenAI content parts, or None
    created_at: float
    status: MessageStatus = "complete"
    model: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None  # what failed, for status "failed"
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class NewMessage:
    """The fields of a :class:`Message` that a caller supplies; the store fills in the rest.

    ``parent_id`` None means "the conversation's head" (for the first message:
    none, a root); :data:`ROOT` makes it a new root beside the first (a branch
    from the very start). ``id`` None means a fresh ``msg_`` id.

    Example::

        NewMessage(role="assistant", content="Hi", status="incomplete", finish_reason=None)
    """

    role: str
    content: Any = None
    parent_id: str | None = None
    status: MessageStatus = "complete"
    model: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    finish_reason: str | None = None
    id: str | None = None


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """An OpenAI Responses API response as ``GET /v1/responses/{id}`` returns it.

    ``body`` is the response object, ``input_items`` the request's input (with
    ids), ``conversation_id`` the conversation whose tree holds its messages (the
    assistant message of the response has the response's id), what a
    ``previous_response_id`` continues.
    """

    id: str
    owner: str
    conversation_id: str | None
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    created_at: float


@dataclass(frozen=True, slots=True)
class StoredEvents:
    """A running (or ended) response's stored events after some sequence number, as
    :meth:`~sluice.store.repository.RunEvents.events_after` reads them.

    ``body`` and ``unfinished`` were read *before* ``frames``: when ``unfinished`` is
    False, ``frames`` holds every event the run stored. ``frames``: ``(seq, frame)``
    in order; ``last``: the run's last stored event, None if it stored none (or its
    events were pruned).
    """

    body: dict[str, Any]
    unfinished: bool
    frames: list[tuple[int, bytes]]
    last: tuple[int, bytes] | None


class EventWatch:
    """Word that another instance stored new events of one response: set by the store's
    listener, waited on by whoever follows that response through this instance.

    Clear it *before* reading the events, so word that comes during the read is not
    lost; then wait. ``live``: the store hears such word at all at the moment (else
    the follower must look on its own, more often).

    Example::

        with store.watch("resp_1") as watch:
            watch.clear()
            got = await store.events_after("resp_1", owner="", after=-1)
            await watch.wait(1.0 if watch.live else 0.15)
    """

    def __init__(self, live: Callable[[], bool], close: Callable[[EventWatch], None]) -> None:
        self._event = asyncio.Event()
        self._live = live
        self._close = close

    @property
    def live(self) -> bool:
        return self._live()

    def notify(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, timeout: float) -> bool:
        """Until word comes (True) or ``timeout`` seconds pass (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
            return True
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(self)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """What one API key used of one model on one day (UTC): the usage ledger's unit.

    :meth:`ConversationStore.add_usage` adds a row's counts to the stored totals of its
    ``(key, model, day)``; :meth:`ConversationStore.usage` answers with those totals.

    Example::

        await store.add_usage([UsageRow("ci", "qwen", "2026-05-01", requests=1, prompt_tokens=9)])
    """

    key: str  # the API key's name ("" when the server has no keys)
    model: str
    day: str  # "YYYY-MM-DD", UTC
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0


class UnknownConversation(NotFound):
    """A message was added to a conversation that does not exist (or was deleted meanwhile)."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"No conversation '{conversation_id}'.", param="conversation_id")
        self.conversation_id = conversation_id


class InvalidParent(InvalidRequest):
    """A message's parent does not exist or belongs to another conversation."""

    def __init__(self, parent_id: str) -> None:
        super().__init__(f"No message '{parent_id}' in this conversation.", param="parent_id")
        self.parent_id = parent_id


class DuplicateMessageId(InvalidRequest):
    """A caller-given message id is already taken."""

    def __init__(self, message_id: str) -> None:
        super().__init__(f"A message with id '{message_id}' already exists.", param="id")
        self.message_id = message_id


class StoreClosed(ShuttingDown):
    """The store was closed (the server is shutting down)."""

    def __init__(self) -> None:
        super().__init__("The conversation store is closed.")


class StoreFailed(InternalError):
    """The database itself failed (disk full, I/O error, PostgreSQL unreachable, a schema
    newer than this sluice)."""
