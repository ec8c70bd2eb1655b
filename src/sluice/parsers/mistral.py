"""Mistral tool calls after ``[TOOL_CALLS]``, in either of its two shapes:

* v3: a JSON array ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``
  (a single bare object is accepted too);
* v11+: ``[TOOL_CALLS]name[ARGS]{...}``, repeated for parallel calls
  (``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` too; the model's id is replaced).

Content before ``[TOOL_CALLS]`` (and after the calls) is content; whitespace
touching the markup is kept only between two pieces of content. If what follows ``[TOOL_CALLS]`` is not a
call, the text is released as content.

Example::

    parser = MistralParser(0)
    parser.feed('[TOOL_CALLS]get_weather[ARGS]{"city": ')
    # [ToolCallStart(name="get_weather"), ToolCallDelta('{"city": ')]
    parser.feed('"Tokyo"}')   # [ToolCallDelta('"Tokyo"}'), ToolCallEnd(0)]
"""

from __future__ import annotations

import string
from enum import Enum, auto

from sluice.core.events import Event
from sluice.parsers.common import (
    WHITESPACE,
    CallEmitter,
    CallProgress,
    ContentGate,
    advance_call,
    content_holdback,
    find_first,
    partial_tag_len,
)
from sluice.parsers.jsonscan import ArgsCollector, ToolCallScanner

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")


class _State(Enum):
    CONTENT = auto()
    TAG = auto()  # just after [TOOL_CALLS]: which shape?
    ITEM = auto()  # in the array: an object or ']'
    OBJECT = auto()  # a {"name": ..., "arguments": ...} object
    SEP = auto()  # in the array after an object: ',' or ']'
    NAME = auto()  # name[ARGS] shape: the name
    CALL_ID = auto()  # the model's call id, up to [ARGS]
    ARGS = auto()  # the arguments value after [ARGS]


class MistralParser:
    """Streaming parser for Mistral ``[TOOL_CALLS]`` tool calls (both shapes)."""

    __slots__ = (
        "_args",
        "_buf",
        "_calls",
        "_content",
        "_drop_ws",
        "_in_array",
        "_markup",
        "_named",
        "_scan",
        "_state",
        "choice",
    )

    def __init__(self, choice: int, id_prefix: str = "call_") -> None:
        self.choice = choice
        self._calls = CallEmitter(choice, id_prefix)
        self._content = ContentGate(choice)
        self._state = _State.CONTENT
        self._buf = ""
        self._drop_ws = False
        self._in_array = False
        self._markup = ""  # text since [TOOL_CALLS], released as content if no call follows
        self._named = False  # a call since the last [TOOL_CALLS]: the markup is spent
        self._scan = ToolCallScanner()
        self._args = ArgsCollector()

    @property
    def called_tools(self) -> bool:
        return self._calls.called

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._buf:
            state = self._state
            if state is _State.CONTENT:
                go = self._read_content(events)
            elif state is _State.OBJECT:
                go = self._object(events)
            elif state is _State.NAME:
                go = self._name(events)
            elif state is _State.CALL_ID:
                go = self._call_id()
            elif state is _State.ARGS:
                go = self._arguments(events)
            else:
                go = self._punctuation(events)
            if not go:
                break
        return events

    def flush(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        state = self._state
        if state is _State.CONTENT:
            return self._content.text(buf)
        if state is _State.OBJECT and self._scan.name is not None:
            return self._calls.arguments(self._scan.finish().arguments) + self._calls.end()
        if state is _State.OBJECT:
            return self._content.text(self._release() + self._scan.raw + buf)
        if state is _State.ARGS:
            return self._calls.arguments(self._args.rest()) + self._calls.end()
        if state is _State.CALL_ID:
            return self._calls.end()
        if self._named:
            return []  # TAG, ITEM, SEP: leftovers of the array after its calls
        return self._content.text(self._markup + buf)  # TAG, ITEM, NAME

    # -- content -------------------------------------------------------------------

    def _read_content(self, events: list[Event]) -> bool:
        buf = self._buf
        if self._drop_ws:
            buf = self._content.after_markup(buf)
            if not buf:
                self._buf = ""
                return False
            self._drop_ws = False
        at = buf.find(TOOL_CALLS)
        if at != -1:
            events.extend(self._content.before_markup(buf[:at]))
            self._markup = TOOL_CALLS
            self._named = False
            self._state = _State.TAG
            self._buf = buf[at + len(TOOL_CALLS) :]
            return True
        keep = content_holdback(buf, (TOOL_CALLS,))
        events.extend(self._content.text(buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep :]
        return False

    def _release(self) -> str:
        """The markup to give back as content when no call follows it."""
        return "" if self._named else self._markup

    def _to_content(self, events: list[Event], release: str) -> bool:
        """Back to content: ``release`` (text that was no call) goes out first."""
        events.extend(self._content.text(release))
        self._markup = ""
        self._in_array = False
        self._state = _State.CONTENT
        return True

    def _calls_over(self) -> bool:
        self._markup = ""
        self._in_array = False
        self._state = _State.CONTENT
        self._drop_ws = True
        return True

    # -- structure -------------------------------------------------------------------

    def _punctuation(self, events: list[Event]) -> bool:
        """TAG, ITEM and SEP: whitespace, then one character decides."""
        rest = self._buf.lstrip(WHITESPACE)
        self._markup += self._buf[: len(self._buf) - len(rest)]
        self._buf = rest
        if not rest:
            return False
        c = rest[0]
        state = self._state
        if state is _State.TAG and c == "[":
            self._in_array = True
            self._state = _State.ITEM
        elif c == "{" and state is not _State.SEP:
            self._scan = ToolCallScanner()
            self._state = _State.OBJECT
            return True
        elif state is _State.TAG and c in _NAME_CHARS:
            self._state = _State.NAME
            return True
        elif c == "]" and state is not _State.TAG:
            self._buf = rest[1:]
            return self._calls_over()
        elif state is _State.SEP and c == ",":
            self._state = _State.ITEM
        elif state is _State.SEP:
            return self._calls_over()  # an unclosed array: the rest is content
        else:
            return self._to_content(events, self._release())  # not a call after all
        self._markup += c
        self._buf = rest[1:]
        return True

    def _object(self, events: list[Event]) -> bool:
        used, progress = advance_call(self._scan, self._calls, self._buf, events)
        self._buf = self._buf[used:]
        if self._scan.name is not None:
            self._named = True
        if progress is CallProgress.ENDED:
            if self._in_array and self._scan.done:
                self._state = _State.SEP
                return True
            return self._calls_over()
        if progress is CallProgress.NOT_A_CALL:
            return self._to_content(events, self._release() + self._scan.raw)
        return False

    def _name(self, events: list[Event]) -> bool:
        buf = self._buf
        i = 0
        while i < len(buf) and buf[i] in _NAME_CHARS:
            i += 1
        tail = buf[i:].lstrip(WHITESPACE)
        if not tail or any(len(tail) < len(t) and t.startswith(tail) for t in (ARGS, CALL_ID)):
            return False  # the name, or the tag after it, may go on
        for tag, state in ((ARGS, _State.ARGS), (CALL_ID, _State.CALL_ID)):
            if tail.startswith(tag):
                events.extend(self._calls.start(buf[:i]))
                self._named = True
                self._args = ArgsCollector()
                self._state = state
                self._buf = tail[len(tag) :]
                return True
        return self._to_content(events, self._release())  # the name goes on as content

    def _call_id(self) -> bool:
        hit = find_first(self._buf, (ARGS,))
        if hit is None:
            self._buf = self._buf[len(self._buf) - partial_tag_len(self._buf, (ARGS,)) :]
            return False
        self._buf = self._buf[hit[0] + len(ARGS) :]
        self._state = _State.ARGS
        return True

    def _arguments(self, events: list[Event]) -> bool:
        args = self._args
        end = args.feed(self._buf)
        self._buf = self._buf[end:]
        events.extend(self._calls.arguments(args.take()))
        if args.done or args.failed:
            events.extend(self._calls.arguments(args.rest()))
            events.extend(self._calls.end())
            return self._calls_over()
        return False
