"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` (or "arguments").

The calls are the whole reply: after optional whitespace it starts with
``<|python_tag|>`` or ``{``; several calls are separated by ``;`` and/or
newlines. A reply that does not start that way is plain content, passed
through without delay. A leading JSON object that turns out not to be a call
(no name, e.g. the user asked for JSON) is released as content when it ends.
Text after the calls that is not another call is content.

Example::

    parser = Llama3Parser(0)
    parser.feed('{"name": "get_weather", "parameters": {"city": "Tokyo"}}; ')
    # [ToolCallStart(name="get_weather"), ToolCallDelta('{"city": "Tokyo"}'), ToolCallEnd(0)]
    parser.feed('{"name": "get_time", "parameters": {}}')
    # [ToolCallStart(index=1, name="get_time"), ToolCallDelta("{}"), ToolCallEnd(1)]
"""

from __future__ import annotations

from enum import Enum, auto

from sluice.core.events import Event, TextDelta
from sluice.parsers.common import WHITESPACE, CallEmitter, CallProgress, advance_call, content
from sluice.parsers.jsonscan import ToolCallScanner

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = WHITESPACE + ";"


class _State(Enum):
    START = auto()  # a call may begin here (start of the reply, or after a call)
    CALL = auto()
    CONTENT = auto()  # pass-through


class Llama3Parser:
    """Streaming parser for Llama 3.x JSON tool calls (with or without ``<|python_tag|>``)."""

    __slots__ = ("_buf", "_calls", "_markup", "_scan", "_state", "choice")

    def __init__(self, choice: int, id_prefix: str = "call_") -> None:
        self.choice = choice
        self._calls = CallEmitter(choice, id_prefix)
        self._state = _State.START
        self._buf = ""
        self._markup = ""  # text of the current call before it got a name
        self._scan = ToolCallScanner()

    @property
    def called_tools(self) -> bool:
        return self._calls.called

    def feed(self, text: str) -> list[Event]:
        if self._state is _State.CONTENT:
            return content(self.choice, text)
        self._buf += text
        events: list[Event] = []
        while self._buf:
            if self._state is _State.START:
                if not self._start(events):
                    break
            elif self._state is _State.CALL:
                self._call(events)
            else:
                events.append(TextDelta(self.choice, self._buf))
                self._buf = ""
        return events

    def flush(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._state is _State.CALL:
            if self._scan.name is None:
                return content(self.choice, self._markup + self._scan.raw + buf)
            return self._calls.arguments(self._scan.finish().arguments) + self._calls.end()
        if self._state is _State.START and self._calls.called:
            buf = buf.lstrip(_SEPARATORS)  # separators after the last call
        return content(self.choice, buf)

    def _start(self, events: list[Event]) -> bool:
        """Does a call begin here? False while undecided."""
        buf = self._buf
        rest = buf.lstrip(_SEPARATORS if self._calls.called else WHITESPACE)
        skipped = buf[: len(buf) - len(rest)]
        if rest.startswith(PYTHON_TAG):
            self._begin(skipped + PYTHON_TAG, rest[len(PYTHON_TAG) :])
        elif rest.startswith("{"):
            self._begin(skipped, rest)
        elif not rest or PYTHON_TAG.startswith(rest):
            return False
        else:
            self._state = _State.CONTENT
            self._buf = rest if self._calls.called else buf
        return True

    def _begin(self, markup: str, rest: str) -> None:
        self._state = _State.CALL
        # Separators between calls are not content, even if the next "call" is not one.
        self._markup = markup if not self._calls.called else markup.lstrip(_SEPARATORS)
        self._scan = ToolCallScanner()
        self._buf = rest

    def _call(self, events: list[Event]) -> None:
        used, progress = advance_call(self._scan, self._calls, self._buf, events)
        self._buf = self._buf[used:]
        if progress is CallProgress.ENDED:
            self._state = _State.START
        elif progress is CallProgress.NOT_A_CALL:
            # Not a call: what the model wrote is content, and so is the rest.
            markup = self._markup.replace(PYTHON_TAG, "")
            events.extend(content(self.choice, markup + self._scan.raw))
            self._state = _State.CONTENT
