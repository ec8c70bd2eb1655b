"""gpt-oss's harmony format: the output is messages on channels, not marked-up text.

Each message is ``[<|start|>assistant][ to=R]<|channel|>C[ to=R][ <|constrain|>T]<|message|>``
then its body, ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``. The
``analysis`` channel is reasoning; ``final`` (and ``commentary`` with no
recipient) is the answer; a message to ``functions.NAME`` is a call of NAME
whose body is its JSON arguments. Messages to the model's built-in tools
(``python``, ``container.exec``, ``browser.*``) are not calls of the client's
tools and are dropped, as llama.cpp does. Output that opens no message at all
is content.

Example::

    parser = HarmonyParser(0)
    parser.feed("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant")
    # [ReasoningDelta("Hmm.")]
    parser.feed("<|channel|>commentary to=functions.get <|constrain|>json<|message|>{}")
    # [ToolCallStart(name="get"), ToolCallDelta("{}")]
"""

from __future__ import annotations

import enum
import re

from sluice.core.events import Event, ReasoningDelta, TextDelta
from sluice.parsers.common import CallEmitter, partial_tag_len
from sluice.parsers.elements import JsonStrings

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
START = "<|start|>assistant"
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>(\w+)")
_MAX_HEADER = 512  # a header longer than this is not one: the model wrote plain text


class _State(enum.Enum):
    HEADER = "header"
    BODY = "body"
    PLAIN = "plain"  # no harmony at all: everything is content


class HarmonyParser:
    """Streaming parser for gpt-oss's channels (reasoning, answer and calls together)."""

    __slots__ = ("_buf", "_calls", "_json", "_kind", "_sent", "_state", "choice")

    def __init__(self, choice: int, id_prefix: str = "call_") -> None:
        self.choice = choice
        self._calls = CallEmitter(choice, id_prefix)
        self._state = _State.HEADER
        self._buf = ""
        self._kind = ""  # the body's route: reasoning | content | call | drop
        self._json = JsonStrings()  # where a call's arguments have their strings
        self._sent = False  # anything sent yet (leading whitespace of the answer dropped)

    @property
    def called_tools(self) -> bool:
        return self._calls.called

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._buf:
            if self._state is _State.PLAIN:
                events += self._route("content", self._buf)
                self._buf = ""
            elif self._state is _State.HEADER:
                if not self._header(events):
                    break
            elif not self._body(events, final=False):
                break
        return events

    def flush(self) -> list[Event]:
        events: list[Event] = []
        buf, self._buf = self._buf, ""
        if self._state is _State.BODY:
            events += self._route(self._kind, buf)
        elif buf.strip() and not self._sent:
            events += self._route("content", buf)  # a header that never opened: text
        events += self._calls.end()
        return events

    def _header(self, events: list[Event]) -> bool:
        buf = self._buf
        at = buf.find(MESSAGE)
        if at == -1:
            head = buf.lstrip()
            undecided = "<|".startswith(head[:2]) or "to=".startswith(head[:3])
            if head and not undecided and not head.startswith(("<|", "to=")) and not self._sent:
                self._state = _State.PLAIN
                return True
            if len(buf) > _MAX_HEADER:
                self._state = _State.PLAIN
                return True
            return False
        header, self._buf = buf[:at], buf[at + len(MESSAGE) :]
        channel = _CHANNEL.findall(header)
        recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
        recipient = recipients[-1] if recipients else ""
        if recipient.startswith("functions."):
            self._kind = "call"
            self._json = JsonStrings()
            events += self._calls.start(recipient.removeprefix("functions."))
        elif recipient:
            self._kind = "drop"
        elif channel and channel[-1] == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"
        self._state = _State.BODY
        return True

    def _body(self, events: list[Event], final: bool) -> bool:
        buf = self._buf
        if self._kind == "call":  # JSON: an end's text inside one of its strings is text
            hits = [(self._json.find(e, buf, 0), e) for e in ENDS]
        else:
            hits = [(buf.find(e), e) for e in ENDS]
        hits = [(at, e) for at, e in hits if at != -1]
        if hits:
            at, end = min(hits)
            events += self._route(self._kind, buf[:at])
            if self._kind == "call":
                events += self._calls.end()
            rest = buf[at + len(end) :]
            rest = rest.removeprefix(START)
            self._buf = rest
            self._state = _State.HEADER
            return True
        keep = partial_tag_len(buf, ENDS)
        if self._kind == "call":
            self._json.take(buf[: len(buf) - keep])
        events += self._route(self._kind, buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _route(self, kind: str, text: str) -> list[Event]:
        if not text:
            return []
        if kind == "call":
            return self._calls.arguments(text)
        if kind == "drop":
            return []
        self._sent = True
        if kind == "reasoning":
            return [ReasoningDelta(self.choice, text)]
        return [TextDelta(self.choice, text)]
