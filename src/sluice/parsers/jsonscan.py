"""Incremental scanning of one tool-call JSON object as the model writes it.

The scanner does not build the object: it follows JSON's structure (strings
with escapes, nesting, scalars) to know where values end, decodes only the
short strings it needs (keys and the function name), and passes the raw text
of the arguments value on as it arrives, so a client sees argument fragments
while the model is still writing them. The joined fragments are exactly the
arguments' JSON text.

Example::

    scan = ToolCallScanner()
    step = scan.feed('{"name": "get_weather", "argu')   # step.name == "get_weather"
    step = scan.feed('ments": {"city": "To')             # step.arguments == '{"city": "To'
    step = scan.feed('kyo"}}\\n</tool_call>')            # '"}', scan.done, step.consumed == 6
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from enum import Enum, auto

from sluice.parsers.common import WHITESPACE

# Characters of numbers and of true/false/null (letters broadly, to find the token's end).
_SCALAR = frozenset(string.ascii_letters + string.digits + "+-.")
_CLOSER = {"{": "}", "[": "]"}


class JsonValueScanner:
    """Finds where one JSON value ends in streamed text, without parsing it.

    ``feed(text, i)`` consumes from ``text[i]`` (the value's first character,
    not whitespace) and returns the index after the last character it took:
    ``len(text)`` while the value goes on. A scalar ends at the first
    character that cannot belong to it, which is not consumed.
    """

    __slots__ = ("_escape", "_in_string", "_scalar", "_stack", "done", "failed", "kind")

    def __init__(self) -> None:
        self._stack: list[str] = []  # closers still expected
        self._in_string = False
        self._escape = False
        self._scalar = False
        self.kind = ""  # first character: '{', '[', '"' or a scalar's first character
        self.done = False
        self.failed = False

    def feed(self, text: str, i: int = 0) -> int:
        stack = self._stack
        n = len(text)
        while i < n and not (self.done or self.failed):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if not stack:
                        self.done = True
                i += 1
                continue
            if self._scalar:
                if c in _SCALAR:
                    i += 1
                    continue
                self._scalar = False
                if not stack:
                    self.done = True
                    return i
            if not self.kind:
                if c != '"' and c not in _CLOSER and c not in _SCALAR:
                    self.failed = True
                    return i
                self.kind = c
            if c == '"':
                self._in_string = True
            elif c in _CLOSER:
                stack.append(_CLOSER[c])
            elif c == "}" or c == "]":
                if not stack or stack[-1] != c:
                    self.failed = True
                    return i
                stack.pop()
                if not stack:
                    self.done = True
            elif c in _SCALAR:
                self._scalar = True
            elif c not in WHITESPACE and c != "," and c != ":":
                self.failed = True
                return i
            i += 1
        return i

    def finish(self) -> bool:
        """The input ended: a scalar at the top level is complete. True if the value is."""
        if self._scalar and not self._stack:
            self._scalar = False
            self.done = True
        return self.done


class ArgsCollector:
    """The arguments value: objects and arrays stream as raw text, anything else is
    buffered and normalised at the end (a JSON string holding JSON becomes that
    JSON, ``null`` becomes ``{}``)."""

    __slots__ = ("_scan", "_sent", "raw")

    def __init__(self) -> None:
        self._scan = JsonValueScanner()
        self.raw = ""  # the value's text so far
        self._sent = 0  # how much of ``raw`` was handed out by ``take``

    @property
    def done(self) -> bool:
        return self._scan.done

    @property
    def failed(self) -> bool:
        return self._scan.failed

    @property
    def streaming(self) -> bool:
        return self._scan.kind in ("{", "[")

    def feed(self, text: str, i: int = 0) -> int:
        """Consume from ``text[i]`` (leading whitespace skipped); index after the last taken."""
        if not self._scan.kind:
            while i < len(text) and text[i] in WHITESPACE:
                i += 1
        end = self._scan.feed(text, i)
        self.raw += text[i:end]
        return end

    def take(self) -> str:
        """Argument text decided since the last call (only for streamed kinds)."""
        if not self.streaming:
            return ""
        piece = self.raw[self._sent :]
        self._sent = len(self.raw)
        return piece

    def rest(self) -> str:
        """Everything not handed out yet, once the value ended (or the input did)."""
        if self.streaming:
            return self.take()
        if self._sent or not self.raw:
            return ""
        self._sent = len(self.raw)
        if not self._scan.finish():
            return self.raw  # cut short: what there is
        if self.raw == "null":
            return "{}"
        if self._scan.kind == '"':
            try:
                inner = json.loads(self.raw)
                json.loads(inner)
            except ValueError:
                return self.raw
            return str(inner).strip(WHITESPACE)
        return self.raw


class _State(Enum):
    OPEN = auto()  # before '{'
    KEY = auto()  # expecting a key (or '}')
    KEY_STR = auto()
    COLON = auto()
    VALUE = auto()  # expecting a value
    NAME_STR = auto()
    ID_STR = auto()  # the call's id (with ``id_key``)
    ARGS = auto()
    SKIP = auto()  # a value of some other key
    AFTER = auto()  # after a value: ',' or '}'


@dataclass(slots=True)
class ScanStep:
    """What one ``feed`` decided: the name (once, when complete), argument text,
    and how many characters of the fed text belong to the object."""

    name: str | None = None
    arguments: str = ""
    consumed: int = 0


class ToolCallScanner:
    """Scans one ``{"name": ..., "arguments": {...}}`` object streamed as text.

    ``done``: the object is complete (or, leniently, the name and the arguments
    are and something other than ``,``/``}`` follows). ``failed``: the text is
    not such an object; ``raw`` is what was consumed, to release as content
    when no name was reported. Text after ``consumed`` belongs to the framing.
    """

    __slots__ = (
        "_args",
        "_esc",
        "_key",
        "_skip",
        "_state",
        "_tok",
        "argument_keys",
        "call_id",
        "done",
        "failed",
        "id_key",
        "name",
        "name_is_key",
        "name_key",
        "raw",
    )

    def __init__(
        self,
        name_key: str = "name",
        argument_keys: tuple[str, ...] = ("arguments", "parameters"),
        id_key: str | None = None,
        name_is_key: bool = False,
    ) -> None:
        self.name_key = name_key
        self.name_is_key = name_is_key  # {"NAME": {arguments}}
        self.argument_keys = argument_keys
        self.id_key = id_key
        self.call_id: str | None = None
        self.name: str | None = None
        self.done = False
        self.failed = False
        self.raw = ""
        self._state = _State.OPEN
        self._tok = ""  # raw text of the key or name string being read
        self._esc = False
        self._key = ""
        self._args: ArgsCollector | None = None
        self._skip: JsonValueScanner | None = None

    def feed(self, text: str) -> ScanStep:
        step = ScanStep()
        i = self._scan(text, step)
        self.raw += text[:i]
        step.consumed = i
        if self.name is not None and self._args is not None:
            step.arguments = self._args.take()
        if self.done:
            step.arguments += self._final_args()
        return step

    def finish(self) -> ScanStep:
        """The input ended: argument text still held, if the call has a name."""
        step = ScanStep()
        if self.name is not None and not self.done and self._args is not None:
            step.arguments = self._args.rest()
        return step

    def _final_args(self) -> str:
        if self._args is None:
            return "{}"  # a call without arguments
        return self._args.rest()

    def _fail(self, i: int) -> int:
        self.failed = True
        return i

    def _scan(self, text: str, step: ScanStep) -> int:
        i, n = 0, len(text)
        while i < n and not (self.done or self.failed):
            state = self._state
            c = text[i]
            if state is _State.ARGS or state is _State.SKIP:
                value = self._args if state is _State.ARGS else self._skip
                assert value is not None
                i = value.feed(text, i)
                if value.failed:
                    return self._fail(i)
                if value.done:
                    self._state = _State.AFTER
                continue
            if state is _State.KEY_STR or state is _State.NAME_STR or state is _State.ID_STR:
                i, closed = self._string(text, i)
                if closed and not self._string_end(state, step):
                    return self._fail(i)
                continue
            if c in WHITESPACE:
                i += 1
                continue
            if state is _State.OPEN:
                if c != "{":
                    return self._fail(i)
                self._state = _State.KEY
            elif state is _State.KEY:
                if c == '"':
                    self._state, self._tok = _State.KEY_STR, ""
                elif c == "}":
                    return self._close(i)
                else:
                    return self._fail(i)
            elif state is _State.COLON:
                if c != ":":
                    return self._fail(i)
                self._state = _State.VALUE
            elif state is _State.VALUE:
                self._value(c)
                if self._state is _State.NAME_STR and c != '"':
                    return self._fail(i)
                if self._state is not _State.NAME_STR and self._state is not _State.ID_STR:
                    continue  # the value scanner takes this character
            elif state is _State.AFTER:
                if c == ",":
                    self._state = _State.KEY
                elif c == "}":
                    return self._close(i)
                elif self.name is not None and self._args is not None and self._args.done:
                    self.done = True  # lenient: the call itself is complete
                    return i
                else:
                    return self._fail(i)
            i += 1
        return i

    def _string(self, text: str, i: int) -> tuple[int, bool]:
        """Read string characters into ``_tok`` up to and including the closing quote.

        Returns the index after the last character read and whether the string closed.
        """
        start = i
        n = len(text)
        while i < n:
            c = text[i]
            i += 1
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._tok += text[start : i - 1]
                return i, True
        self._tok += text[start:i]
        return i, False

    def _string_end(self, state: _State, step: ScanStep) -> bool:
        """A key or the name string just closed; False if it does not decode."""
        try:
            value = json.loads(f'"{self._tok}"', strict=False)
        except ValueError:
            return False
        if state is _State.KEY_STR:
            self._key = str(value)
            self._state = _State.COLON
            if self.name_is_key and self.name is None:
                if not self._key:
                    return False
                self.name = step.name = self._key
            return True
        if state is _State.ID_STR:
            self.call_id = str(value)
            self._state = _State.AFTER
            return True
        if not value:
            return False  # an empty name is no call
        self.name = step.name = str(value)
        self._state = _State.AFTER
        return True

    def _value(self, c: str) -> None:
        if self.name_is_key:
            if self._args is None and self._key == self.name:
                self._args = ArgsCollector()
                self._state = _State.ARGS
            else:
                self._skip = JsonValueScanner()
                self._state = _State.SKIP
        elif self._key == self.name_key and self.name is None:
            self._state, self._tok = _State.NAME_STR, ""
        elif self._key == self.id_key and self.call_id is None and c == '"':
            self._state, self._tok = _State.ID_STR, ""
        elif self._key in self.argument_keys and self._args is None:
            self._args = ArgsCollector()
            self._state = _State.ARGS
        else:
            self._skip = JsonValueScanner()
            self._state = _State.SKIP

    def _close(self, i: int) -> int:
        if self.name is None:
            self.failed = True  # a complete object, but not a tool call
        else:
            self.done = True
        return i + 1
