"""One streaming tool-call parser for every format a :class:`ToolSyntax` describes.

Content streams through until the syntax's opening markup; the calls are read
element by element (:mod:`sluice.parsers.elements`) and reported as soon as
each part is decided: the call's start once its name (and the model's id, where
the format writes one before the arguments) is known, its arguments as they
grow, its end. A possible prefix of the opening markup is held back, so no
markup ever reaches the content. Markup that turns out not to start a call
(no name follows) is given back as content. Whitespace touching the markup is
kept only between two pieces of content (:class:`ContentGate`).

Example::

    parser = FormatParser(0, syntax_of_qwen3_coder, tool_types)
    parser.feed("Let me look.<tool_call>\\n<function=read>\\n<parameter=path>\\n/et")
    # [TextDelta("Let me look."), ToolCallStart(name="read"), ToolCallDelta('{"path": "/et')]
"""

from __future__ import annotations

import enum
from typing import Any

from sluice.core.events import Event
from sluice.core.syntax import (
    CallId,
    CallObject,
    Element,
    GemmaArgs,
    IdName,
    Index,
    JsonArgs,
    Lit,
    Name,
    PythonArgs,
    Recipient,
    TaggedArgs,
    ToolSyntax,
    chunks,
    first_chunk,
)
from sluice.parsers.common import CallEmitter, ContentGate, content_holdback, find_first
from sluice.parsers.elements import (
    DONE,
    FAIL,
    MORE,
    CallObjectReader,
    GemmaArgsReader,
    JsonArgsReader,
    LitReader,
    NameReader,
    PythonArgsReader,
    Status,
    TaggedArgsReader,
    skip_ws,
)

Reader = Any  # one of the element readers


def openers(syntax: ToolSyntax) -> tuple[str, ...]:
    """The markup tool calls may begin with: the first piece of the opening; for an
    opening of several pieces its last one when that is a tag of its own (a model that
    leaves out ``<tool_call>`` before ``<function=...>``); and a call's own opening tag
    where a section opens the calls (a model that leaves the section out)."""
    pieces = chunks(syntax.opener)
    out = pieces[:1]
    last = pieces[-1]
    if len(pieces) > 1 and last.startswith("<") and len(last) > 2 and not _recurs(last, syntax):
        out.append(last)
    first = syntax.call[0] if syntax.call else None
    if syntax.section_start and isinstance(first, Lit):
        head = first_chunk(first.text)
        if head.startswith("<") and len(head) > 2:
            out.append(head)
    return tuple(dict.fromkeys(out))


def _recurs(piece: str, syntax: ToolSyntax) -> bool:
    """Whether ``piece`` is also written elsewhere in the calls' markup (Kimi K3's
    ``<|sep|>`` closes every tag): no sign of a call on its own."""
    texts = [syntax.section_end, syntax.separator]
    for element in syntax.call[1:]:
        if isinstance(element, Lit):
            texts.append(element.text)
        elif isinstance(element, TaggedArgs):
            texts += [element.key_prefix, element.key_suffix, element.value_prefix]
            texts.append(element.value_suffix)
    return any(piece in text for text in texts)


class _State(enum.Enum):
    CONTENT = "content"
    SECTION = "section"  # matching the section's opening markup
    CALL = "call"
    AFTER = "after"  # after a call: another, a separator, or the end of the section
    CLOSE = "close"  # matching the section's closing markup


def _next_literal(elements: tuple[Element, ...], k: int) -> str:
    for element in elements[k + 1 :]:
        if isinstance(element, Lit) and element.text.strip():
            return element.text
        if not isinstance(element, Lit):
            return ""
    return ""


def _name_in_id(call_id: str, spec: IdName) -> str:
    name = call_id.removeprefix(spec.prefix)
    return name.rpartition(spec.sep)[0] or name if spec.sep in name else name


class _Call:
    """One call being read: its elements' readers in turn."""

    __slots__ = ("call_id", "elements", "k", "name", "reader", "started", "types")

    def __init__(self, elements: tuple[Element, ...], types: dict[str, dict[str, Any]]) -> None:
        self.elements = elements
        self.types = types
        self.k = 0
        self.name: str | None = None
        self.call_id: str | None = None
        self.started = False
        self.reader: Reader = self._make(0)

    def _make(self, k: int) -> Reader:
        element = self.elements[k]
        if isinstance(element, Lit):
            return LitReader(element.text, lenient=k == len(self.elements) - 1)
        if isinstance(element, Name):
            return NameReader()
        if isinstance(element, CallId):
            return NameReader(stop=first_chunk(_next_literal(self.elements, k))[:1] or None)
        if isinstance(element, JsonArgs):
            return JsonArgsReader()
        if isinstance(element, TaggedArgs):
            end = _next_literal(self.elements, k)
            return TaggedArgsReader(element, end, self.types.get(self.name or ""))
        if isinstance(element, CallObject):
            return CallObjectReader(element)
        if isinstance(element, PythonArgs):
            return PythonArgsReader()
        if isinstance(element, GemmaArgs):
            return GemmaArgsReader()
        if isinstance(element, (IdName, Recipient, Index)):
            return NameReader(stop=first_chunk(_next_literal(self.elements, k))[:1] or None)
        raise TypeError(f"unknown element {element!r}")

    @property
    def id_pending(self) -> bool:
        """Whether the format writes the call's id before the arguments, still to come."""
        for element in self.elements[self.k :]:
            if isinstance(element, CallId) or (isinstance(element, CallObject) and element.id_key):
                return True
            if isinstance(element, (JsonArgs, TaggedArgs, PythonArgs, GemmaArgs)):
                return False
        return False

    def feed(self, text: str, i: int, final: bool, out: list[str]) -> tuple[int, Status]:
        """Advance through the elements; argument text goes to ``out``."""
        while True:
            reader = self.reader
            i, status = reader.feed(text, i, final)
            if isinstance(reader, NameReader) and status is DONE:
                element = self.elements[self.k]
                if isinstance(element, IdName):
                    self.call_id = reader.value
                    self.name = _name_in_id(reader.value or "", element)
                elif isinstance(element, CallId):
                    self.call_id = reader.value
                elif isinstance(element, (Recipient, Index)):
                    pass  # not kept (the function is named in its own place)
                else:
                    self.name = reader.value
            elif isinstance(reader, CallObjectReader):
                self.name = reader.value or self.name
                self.call_id = reader.call_id or self.call_id
            if hasattr(reader, "take"):
                piece = reader.take(final or status is DONE)
                if piece:
                    out.append(piece)
            if status is not DONE:
                return i, status
            self.k += 1
            if self.k == len(self.elements):
                return i, DONE
            self.reader = self._make(self.k)


class FormatParser:
    """Streaming parser for the tool calls of one :class:`ToolSyntax` (one per choice).

    ``types``: each tool's parameter schemas by name (``{"get": {"city": {...}}}``),
    so markup-written values are typed as the tool declares them.
    """

    __slots__ = (
        "_buf",
        "_call",
        "_calls",
        "_content",
        "_drop_ws",
        "_lit",
        "_markup",
        "_openers",
        "_pending",
        "_state",
        "choice",
        "syntax",
        "types",
    )

    def __init__(
        self,
        choice: int,
        syntax: ToolSyntax,
        types: dict[str, dict[str, Any]] | None = None,
        id_prefix: str = "call_",
    ) -> None:
        self.choice = choice
        self.syntax = syntax
        self.types = types or {}
        self._calls = CallEmitter(choice, id_prefix)
        self._content = ContentGate(choice)
        self._state = _State.CONTENT
        self._buf = ""
        self._drop_ws = False
        self._lit: LitReader | None = None
        self._call: _Call | None = None
        self._markup = ""  # text of the markup since it opened, given back if no call follows
        self._pending: list[str] = []  # argument text read before the call could start
        self._openers = openers(syntax)

    @property
    def called_tools(self) -> bool:
        return self._calls.called

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def flush(self) -> list[Event]:
        events = self._run(final=True)
        if self._state is _State.CONTENT and self._buf:
            events += self._content.text(self._buf)
        elif self._state in (_State.SECTION, _State.CALL) and not self._calls.open:
            events += self._content.text(self._markup + self._buf)
        self._buf = ""
        events += self._calls.end()
        return events

    # -- the states ------------------------------------------------------------------

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            state = self._state
            if state is _State.CONTENT:
                if not self._read_content(events, final):
                    break
            elif state is _State.SECTION or state is _State.CLOSE:
                if not self._read_markup(events, final):
                    break
            elif state is _State.CALL:
                if not self._read_call(events, final):
                    break
            elif not self._after(events, final):
                break
        return events

    def _read_content(self, events: list[Event], final: bool) -> bool:
        buf = self._buf
        if self._drop_ws:
            buf = self._content.after_markup(buf)
            self._buf = buf
            if not buf:
                return False
            self._drop_ws = False
        hit = find_first(buf, self._openers)
        if hit is None:
            if final:
                return False  # flush() gives the rest out
            keep = content_holdback(buf, self._openers) if self._openers else 0
            events.extend(self._content.text(buf[: len(buf) - keep]))
            self._buf = buf[len(buf) - keep :]
            return False
        at, opener = hit
        events.extend(self._content.before_markup(buf[:at]))
        self._buf = buf[at:]
        self._markup = ""
        call_head = self.syntax.call[0]
        reader: Reader
        if self.syntax.section_start and (
            opener == first_chunk(self.syntax.section_start)
            or not (isinstance(call_head, Lit) and opener == first_chunk(call_head.text))
        ):
            self._state = _State.SECTION
            self._lit = reader = LitReader(self.syntax.section_start)
        else:  # no section, or a call without its section
            self._new_call()
            assert self._call is not None
            reader = self._call.reader
        if isinstance(reader, LitReader):  # a model may leave out the opening's first pieces
            reader.skip_to(opener)
        return True

    def _new_call(self) -> None:
        self._state = _State.CALL
        self._call = _Call(self.syntax.call, self.types)
        self._pending = []

    def _take(self, i: int) -> None:
        self._markup += self._buf[:i]
        self._buf = self._buf[i:]

    def _read_markup(self, events: list[Event], final: bool) -> bool:
        assert self._lit is not None
        i, status = self._lit.feed(self._buf, 0, final)
        self._take(i)
        if status is MORE:
            return False
        if self._state is _State.CLOSE:
            self._to_content()
            return True
        if status is FAIL:
            head = self.syntax.call[0]
            if isinstance(head, Lit) and first_chunk(head.text) == first_chunk(
                self.syntax.section_start
            ):  # not the section's opening: maybe a call's without its section
                self._buf, self._markup = self._markup + self._buf, ""
                self._new_call()
                return True
            self._give_back(events)
            return True
        self._new_call()
        return True

    def _read_call(self, events: list[Event], final: bool) -> bool:
        call = self._call
        assert call is not None
        args: list[str] = []
        i, status = call.feed(self._buf, 0, final, args)
        self._take(i)
        self._pending.extend(args)
        if (
            not call.started
            and call.name is not None
            and (status is not MORE or not call.id_pending)
        ):
            call.started = True
            events.extend(self._calls.start(call.name, call.call_id))
        if call.started:
            for piece in self._pending:
                events.extend(self._calls.arguments(piece))
            self._pending = []
        if status is MORE:
            return False
        if status is FAIL and not call.started:
            self._give_back(events)
            return True
        events.extend(self._calls.end())
        self._markup = ""
        if status is FAIL:
            self._to_content()
        else:
            self._state = _State.AFTER
        return True

    def _after(self, events: list[Event], final: bool) -> bool:
        syntax = self.syntax
        buf = self._buf
        i = skip_ws(buf, 0)
        rest = buf[i:]
        first = syntax.call[0]
        # the next call's opening: its markup, or a call object's brace (MiniMax-M1)
        head = (
            first.text if isinstance(first, Lit) else "{" if isinstance(first, CallObject) else ""
        )
        options = [
            (first_chunk(syntax.section_end), "close", syntax.section_end),
            (first_chunk(syntax.separator), "sep", syntax.separator),
            (first_chunk(head), "call", head),
        ]
        matched = [(m, kind, full) for m, kind, full in options if m and rest.startswith(m)]
        if len(matched) > 1:  # markup that begins alike (MiniMax-M3's namespace token)
            read = [(LitReader(full).feed(rest, 0, final)[1], m, k) for m, k, full in matched]
            done = [(m, k, "") for status, m, k in read if status is DONE]
            if not done and not final and any(status is MORE for status, _, _ in read):
                return False
            matched = done or matched[:1]
        for marker, kind, _ in matched:
            self._buf = buf[i:]
            if kind == "close":
                self._state = _State.CLOSE
                self._lit = LitReader(syntax.section_end, lenient=True)
            else:
                if kind == "sep":
                    self._buf = self._buf[len(marker) :]
                self._new_call()
            return True
        if not final and any(m and m.startswith(rest) for m, _, _ in options):
            return False  # not decided yet (or only whitespace so far)
        self._to_content()
        return True

    def _to_content(self) -> None:
        self._state = _State.CONTENT
        self._drop_ws = True
        self._markup = ""

    def _give_back(self, events: list[Event]) -> None:
        """The markup opened no call: its text is content after all."""
        markup, self._markup = self._markup, ""
        if markup:
            events.extend(self._content.text(markup))
        elif self._buf:  # nothing taken: the opener itself failed, pass one character
            events.extend(self._content.text(self._buf[0]))
            self._buf = self._buf[1:]
        self._state = _State.CONTENT
        self._call = None
