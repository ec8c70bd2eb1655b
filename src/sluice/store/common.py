"""What both stores share that is no SQL: rows as dataclasses, the rules a write checks.

SQLite and PostgreSQL keep the same columns the same way (JSON fields as JSON text,
times as unix seconds), so one set of conversions serves both; and the rules of
``add_messages`` (a parent in the same conversation, a caller-given id not taken, a
chain through the batch) are planned here once, from lookups each store answers its
own way.

Example::

    clock = Clock()
    planned = plan_messages(
        "conv_1", head=None, batch=(NewMessage(role="user", content="Hi"),),
        parent_conversation=lambda message_id: None, taken=lambda message_id: False,
        now=clock.now,
    )
    message_row(planned[0])  # the values of the messages table's columns, in order
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

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
    StoredResponse,
    UsageRow,
    new_id,
)

CONVERSATION_COLUMNS = (
    "id, owner, user_id, model, created_at, updated_at, head_id, message_count, title"
)
# The columns are the dataclass's fields, in its order: a row is a Message's arguments.
MESSAGE_FIELDS = tuple(field.name for field in dataclasses.fields(Message))
MESSAGE_COLUMNS = ", ".join(MESSAGE_FIELDS)
_JSON_FIELDS = frozenset({"content", "tool_calls", "usage"})

USAGE_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")
USAGE_COLUMNS = ", ".join(("key", "model", "day", *USAGE_COUNTS))

# SQL both databases read alike, with ? for a parameter (PostgreSQL's store swaps in %s).
INSERT_CONVERSATION = (
    f"INSERT INTO conversations ({CONVERSATION_COLUMNS}) VALUES ({', '.join('?' * 9)})"
)
INSERT_MESSAGE = (
    f"INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES ({', '.join('?' * len(MESSAGE_FIELDS))})"
)
ADVANCE = (
    "UPDATE conversations SET updated_at = ?, message_count = message_count + ?,"
    " head_id = CASE WHEN ? THEN ? ELSE head_id END WHERE id = ?"
)
PATH = f"""
    WITH RECURSIVE chain (seq, up, depth) AS (
        SELECT seq, parent_id, 0 FROM messages WHERE id = ?
        UNION ALL
        SELECT m.seq, m.parent_id, chain.depth + 1
        FROM messages AS m JOIN chain ON m.id = chain.up
    )
    SELECT {MESSAGE_COLUMNS} FROM chain JOIN messages USING (seq)
    ORDER BY chain.depth DESC
"""
SELECT_RESPONSE = (
    "SELECT id, owner, conversation_id, body, input_items, created_at"
    " FROM responses WHERE id = ? AND owner = ?"
)
ADD_USAGE = (
    f"INSERT INTO usage ({USAGE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)"
    " ON CONFLICT (key, model, day) DO UPDATE SET "
    + ", ".join(f"{name} = usage.{name} + excluded.{name}" for name in USAGE_COUNTS)
)
SELECT_USAGE = (
    f"SELECT {USAGE_COLUMNS} FROM usage WHERE (CAST(? AS TEXT) IS NULL OR key = ?)"
    " AND (CAST(? AS TEXT) IS NULL OR day >= ?) AND (CAST(? AS TEXT) IS NULL OR day <= ?)"
    " ORDER BY day, key, model"
)
TOKENS_SINCE = "SELECT COALESCE(SUM(tokens), 0), MIN(at) FROM rate_tokens WHERE key = ? AND at > ?"

# The limits' counters keep an hour: enough for any per-minute window, and what is
# older is pruned as requests come (every PRUNE_EVERY seconds of the callers' clock).
COUNTER_HORIZON = 3600.0
PRUNE_EVERY = 60.0

UNFINISHED_STATUSES = ("queued", "in_progress")

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


class Clock:
    """Unix time, strictly increasing within one store, so "newest first" follows
    write order even when the clock has not ticked between two writes."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = 0.0

    def now(self) -> float:
        self._last = max(time.time(), self._last + 1e-6)
        return self._last


def is_url(location: str) -> bool:
    """Whether ``location`` names a PostgreSQL database (else it is a SQLite file)."""
    return location.startswith(("postgresql://", "postgres://"))


def new_conversation(
    owner: str, user_id: str | None, model: str | None, now: float
) -> tuple[Conversation, tuple[Any, ...]]:
    """A new empty conversation, and its row's values for :data:`INSERT_CONVERSATION`."""
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
    return conversation, (conversation.id, owner, user_id, model, now, now, None, 0, None)


def response_from_row(row: Sequence[Any]) -> StoredResponse:
    """A row of :data:`SELECT_RESPONSE` as the response."""
    return StoredResponse(row[0], row[1], row[2], from_json(row[3]), from_json(row[4]), row[5])


def usage_params(key: str | None, since: str | None, until: str | None) -> tuple[Any, ...]:
    """:data:`SELECT_USAGE`'s parameters, after checking the days."""
    check_day(since, "since")
    check_day(until, "until")
    return (key, key, since, since, until, until)


def to_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def from_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def message_row(message: Message) -> tuple[Any, ...]:
    return tuple(
        to_json(getattr(message, field)) if field in _JSON_FIELDS else getattr(message, field)
        for field in MESSAGE_FIELDS
    )


def message_from_row(row: Sequence[Any]) -> Message:
    return Message(
        *(
            from_json(value) if field in _JSON_FIELDS else value
            for field, value in zip(MESSAGE_FIELDS, row, strict=True)
        )
    )


def check_page(limit: int, offset: int) -> None:
    if limit < 0:
        raise InvalidRequest("'limit' must be 0 or more", param="limit")
    if offset < 0:
        raise InvalidRequest("'offset' must be 0 or more", param="offset")


def check_statuses(messages: Iterable[NewMessage]) -> tuple[NewMessage, ...]:
    batch = tuple(messages)
    for new in batch:
        if new.status not in MESSAGE_STATUSES:
            raise InvalidRequest(f"Unknown message status '{new.status}'", param="status")
    return batch


def plan_messages(
    conversation_id: str,
    *,
    head: str | None,
    batch: Sequence[NewMessage],
    parent_conversation: Callable[[str], str | None],
    taken: Callable[[str], bool],
    now: Callable[[], float],
) -> list[Message]:
    """The messages ``batch`` stores in ``conversation_id``, as a chain from ``head``.

    ``parent_conversation(id)`` is the conversation of a stored message (None: no such
    message) and ``taken(id)`` whether a stored message has that id; messages earlier
    in the batch count as stored. Raises ``InvalidParent`` or ``DuplicateMessageId``.
    """
    planned: dict[str, Message] = {}
    previous = head
    for new in batch:
        parent_id = new.parent_id if new.parent_id is not None else previous
        if parent_id == ROOT:
            parent_id = None  # a second root: a branch from the very start
        elif (
            parent_id is not None
            and parent_id != head  # the head is this conversation's own
            and parent_id not in planned
            # A parent in another conversation would tie two conversations'
            # lifetimes together (deleting one would orphan the other's messages).
            and parent_conversation(parent_id) != conversation_id
        ):
            raise InvalidParent(parent_id)
        message_id = new.id if new.id is not None else new_id(MESSAGE_PREFIX)
        if new.id is not None and (message_id in planned or taken(message_id)):
            raise DuplicateMessageId(message_id)
        planned[message_id] = Message(
            id=message_id,
            conversation_id=conversation_id,
            parent_id=parent_id,
            role=new.role,
            content=new.content,
            created_at=now(),
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
        previous = message_id
    return list(planned.values())


def is_unfinished(body: dict[str, Any]) -> bool:
    return body.get("status") in UNFINISHED_STATUSES


def failed_body(body: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    return body | {"status": "failed", "error": error}


def check_day(day: str | None, param: str) -> None:
    if day is not None and not _DAY.fullmatch(day):
        raise InvalidRequest(f"'{param}' must be a day as YYYY-MM-DD", param=param)


def merge_usage(rows: Iterable[UsageRow]) -> list[tuple[Any, ...]]:
    """``rows`` as the usage table's values, one per ``(key, model, day)`` (counts
    added up), in that order: two stores adding the same rows lock them in one order."""
    totals: dict[tuple[str, str, str], list[int]] = {}
    for row in rows:
        counts = [getattr(row, name) for name in USAGE_COUNTS]
        if not _DAY.fullmatch(row.day) or any(not isinstance(n, int) or n < 0 for n in counts):
            raise ValueError(f"a usage row has a YYYY-MM-DD day and counts >= 0: {row}")
        sums = totals.setdefault((row.key, row.model, row.day), [0] * len(USAGE_COUNTS))
        for i, n in enumerate(counts):
            sums[i] += n
    return [(*where, *sums) for where, sums in sorted(totals.items())]


def check_window(limit: int, window: float) -> None:
    if not 0 < window <= COUNTER_HORIZON:
        raise ValueError(f"a window is more than 0 and at most {COUNTER_HORIZON:g} s: {window}")
    if limit < 0:
        raise ValueError(f"a limit is 0 or more: {limit}")


def retry_after(oldest: float | None, window: float, now: float) -> float:
    """Seconds until a request taken at ``oldest`` leaves the window ``(now - window, now]``."""
    if oldest is None:  # a limit of 0: nothing will ever be admitted
        return window
    return max(oldest + window - now, 1e-6)


class Pruner:
    """When the counters are due a prune, by the callers' clock (``now``)."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0.0

    def due(self, now: float) -> float | None:
        """The cut-off (rows at or before it go) if a prune is due, else None."""
        if now < self._next:
            return None
        self._next = now + PRUNE_EVERY
        return now - COUNTER_HORIZON
