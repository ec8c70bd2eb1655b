"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Zero or more calls, with content possibly before, between and after them.
Content never carries the markup: a possible prefix of the opening tag at the
end of a feed is held back (and released as content if it turns out not to be
the tag). Whitespace touching the markup is kept only between two pieces of
content (see :class:`ContentGate`), so a reply that only calls tools has no
content at all.

A ``<tool_call>`` block whose body is not a tool-call object (no name) is
not a call: the model's text is released verbatim as content rather than
lost. Junk between a call's object and ``</tool_call>`` is dropped.

Example::

    parser = HermesParser(0)
    parser.feed('Let me check.\\n<tool_call>\\n{"name": "get_weather", ')
    # [TextDelta("Let me check."), ToolCallStart(index=0, name="get_weather")]
    parser.feed('"arguments": {"city": "Tokyo"}}\\n</tool_call>')
    # [ToolCallDelta('{"city": "Tokyo"}'), ToolCallEnd(0)]
"""

from __future__ import annotations

from enum import Enum, auto

from sluice.core.events import Event
from sluice.parsers.common import (
    CallEmitter,
    CallProgress,
    ContentGate,
    advance_call,
    content_holdback,
    find_first,
    partial_tag_len,
)
from sluice.parsers.jsonscan import ToolCallScanner


class _State(Enum):
    CONTENT = auto()
    CALL = auto()  # inside <tool_call>, reading the JSON object
    AFTER = auto()  # the object ended: waiting for </tool_call> (or another <tool_call>)


class HermesParser:
    """Streaming parser for ``<tool_call>``-framed JSON tool calls (Hermes, Qwen, generic)."""

    __slots__ = (
        "_buf",
        "_calls",
        "_content",
        "_drop_ws",
        "_markup",
        "_scan",
        "_state",
        "choice",
        "close",
        "open",
    )

    def __init__(
        self,
        choice: int,
        id_prefix: str = "call_",
        open_tag: str = "<tool_call>",
        close_tag: str = "</tool_call>",
    ) -> None:
        self.choice = choice
        self.open = open_tag
        self.close = close_tag
        self._calls = CallEmitter(choice, id_prefix)
        self._content = ContentGate(choice)
        self._state = _State.CONTENT
        self._buf = ""  # text not decided yet
        self._drop_ws = False  # just after a call: leading whitespace is deferred
        self._markup = ""  # the opening tag, given back as content if no call follows
        self._scan = ToolCallScanner()

    @property
    def called_tools(self) -> bool:
        return self._calls.called

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._buf:
            if self._state is _State.CONTENT:
                if not self._read_content(events):
                    break
            elif self._state is _State.CALL:
                self._call(events)
            elif not self._after():
                break
        return events

    def flush(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._state is _State.CONTENT:
            return self._content.text(buf)  # (whitespace right after a call is deferred)
        if self._state is _State.CALL:
            if self._scan.name is None:  # never became a call: give the text back
                return self._content.text(self._markup + self._scan.raw + buf)
            return self._calls.arguments(self._scan.finish().arguments) + self._calls.end()
        return []  # AFTER: the call ended already; a partial closing tag is dropped

    def _read_content(self, events: list[Event]) -> bool:
        """Content up to the next opening tag; False when the rest must wait."""
        buf = self._buf
        if self._drop_ws:
            buf = self._content.after_markup(buf)
            if not buf:
                self._buf = ""
                return False
            self._drop_ws = False
        at = buf.find(self.open)
        if at != -1:
            events.extend(self._content.before_markup(buf[:at]))
            self._begin_call(buf[at + len(self.open) :])
            return True
        keep = content_holdback(buf, (self.open,))
        events.extend(self._content.text(buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep :]
        return False

    def _begin_call(self, rest: str) -> None:
        self._state = _State.CALL
        self._markup = self.open
        self._scan = ToolCallScanner()
        self._buf = rest

    def _call(self, events: list[Event]) -> None:
        used, progress = advance_call(self._scan, self._calls, self._buf, events)
        self._buf = self._buf[used:]
        if progress is CallProgress.ENDED:
            self._state = _State.AFTER
        elif progress is CallProgress.NOT_A_CALL:
            # Not a tool call after all: the block's text is the model's content.
            events.extend(self._content.text(self._markup + self._scan.raw))
            self._state = _State.CONTENT

    def _after(self) -> bool:
        """Skip to the closing tag (or straight to another call); False to wait."""
        hit = find_first(self._buf, (self.close, self.open))
        if hit is None:
            keep = partial_tag_len(self._buf, (self.close, self.open))
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        at, tag = hit
        rest = self._buf[at + len(tag) :]
        if tag == self.close:
            self._state = _State.CONTENT
            self._drop_ws = True
            self._buf = rest
        else:
            self._begin_call(rest)
        return True
