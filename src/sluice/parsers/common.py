"""Pieces every parser family shares: tag hold-back and tool-call event bookkeeping.

Example::

    calls = CallEmitter(choice=0)
    events = calls.start("get_weather") + calls.arguments('{"city": "Tokyo"}') + calls.end()
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.core.events import Event, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

if TYPE_CHECKING:  # jsonscan imports this module
    from sluice.parsers.jsonscan import ToolCallScanner

WHITESPACE = " \t\r\n"


def partial_tag_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``.

    That suffix may still become a tag once more text arrives, so it is held back.
    """
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def content_holdback(text: str, tags: Sequence[str]) -> int:
    """How much of the tail of ``text`` to hold: a possible tag prefix plus the
    whitespace before it (whitespace right before tool-call markup is dropped)."""
    held = partial_tag_len(text, tags)
    head = text[: len(text) - held]
    return held + len(head) - len(head.rstrip(WHITESPACE))


def find_first(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
    """The earliest complete occurrence of any of ``tags``: (index, tag)."""
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag)
        if at != -1 and (best is None or at < best[0]):
            best = (at, tag)
    return best


def content(choice: int, text: str) -> list[Event]:
    """A content event, or nothing for empty text."""
    return [TextDelta(choice, text)] if text else []


class ContentGate:
    """Content around tool-call markup: whitespace touching the markup is deferred and
    goes out only between two pieces of content, so "A\n<call>\nB" reads "A\n\nB" and
    a reply that only calls tools has no content at all.
    """

    __slots__ = ("_started", "choice", "deferred")

    def __init__(self, choice: int) -> None:
        self.choice = choice
        self.deferred = ""
        self._started = False

    def text(self, text: str) -> list[Event]:
        """Content that is not followed by markup."""
        if not text:
            return []
        if self.deferred:
            text = (self.deferred if self._started else "") + text
            self.deferred = ""
        self._started = True
        return [TextDelta(self.choice, text)]

    def before_markup(self, text: str) -> list[Event]:
        """Content that ends where markup begins: its trailing whitespace is deferred."""
        head = text.rstrip(WHITESPACE)
        events = self.text(head)
        self.deferred += text[len(head) :]
        return events

    def after_markup(self, text: str) -> str:
        """Defer the whitespace that starts ``text``; returns the rest."""
        rest = text.lstrip(WHITESPACE)
        self.deferred += text[: len(text) - len(rest)]
        return rest


class CallEmitter:
    """Tool-call events for one choice: dense indexes, unique ids, no empty deltas.

    ``start`` opens call ``index`` (the next dense index) with a fresh id,
    ``arguments`` adds a fragment of its JSON arguments text, ``end`` closes it.
    """

    __slots__ = ("_ids", "choice", "count", "id_prefix", "open")

    def __init__(self, choice: int, id_prefix: str = "call_") -> None:
        self.choice = choice
        self.id_prefix = id_prefix
        self.count = 0  # calls started so far
        self.open = False
        self._ids: set[str] = set()

    @property
    def called(self) -> bool:
        return self.count > 0

    def new_id(self) -> str:
        while True:
            call_id = self.id_prefix + secrets.token_hex(12)
            if call_id not in self._ids:
                self._ids.add(call_id)
                return call_id

    def start(self, name: str, call_id: str | None = None) -> list[Event]:
        """Open a call; ``call_id``: the model's own id for it (kept if unused so far)."""
        events = self.end()  # a new call implies the previous one is over
        self.open = True
        self.count += 1
        if call_id and call_id not in self._ids:
            self._ids.add(call_id)
        else:
            call_id = self.new_id()
        return [*events, ToolCallStart(self.choice, self.count - 1, call_id, name)]

    def arguments(self, text: str) -> list[Event]:
        if not text or not self.open:
            return []
        return [ToolCallDelta(self.choice, self.count - 1, text)]

    def end(self) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        return [ToolCallEnd(self.choice, self.count - 1)]


class CallProgress(enum.Enum):
    OPEN = "open"  # the call object goes on
    ENDED = "ended"  # the call closed (or broke after its name: ended as it is)
    NOT_A_CALL = "not_a_call"  # it broke before a name: the text was never a call


def advance_call(
    scan: ToolCallScanner, calls: CallEmitter, text: str, events: list[Event]
) -> tuple[int, CallProgress]:
    """Feed one call object's text to its scanner; emit start / argument / end events.

    Returns how many characters the call consumed and where it stands.
    """
    had_name = scan.name is not None
    step = scan.feed(text)
    if step.name is not None:
        events.extend(calls.start(step.name))
    events.extend(calls.arguments(step.arguments))
    if scan.done or (scan.failed and (had_name or step.name is not None)):
        events.extend(calls.end())
        return step.consumed, CallProgress.ENDED
    if scan.failed:
        return step.consumed, CallProgress.NOT_A_CALL
    return step.consumed, CallProgress.OPEN
