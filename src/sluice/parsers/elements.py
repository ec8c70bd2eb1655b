"""Incremental readers for the elements of a tool call (see :mod:`sluice.core.syntax`).

Each reader is fed the unread text and an index into it, and returns the
index after what it took and its status: ``DONE`` (the element is complete;
what follows is the next element's), ``MORE`` (all taken, more text needed)
or ``FAIL`` (the text is not this element). A reader keeps what it needs of
the text it took, so the caller may drop it. With ``final`` the text has
ended: a reader decides with what it has.

Readers report what they learn through their attributes: a name, a call id,
argument text (``take()``: the arguments' JSON text decided since the last
call; the joined pieces are the arguments' JSON).

Example::

    lit = LitReader("<tool_call>\\n<function=")
    i, status = lit.feed("<tool_call><function=get", 0, final=False)   # (21, DONE)
"""

from __future__ import annotations

import ast
import enum
import json
import re
from typing import Any

from sluice.core.syntax import (
    CDATA_CLOSE,
    CDATA_OPEN,
    GEMMA_QUOTE,
    KEY_NAME,
    STRING_FLAG,
    TYPE_NAME,
    CallObject,
    TaggedArgs,
    chunks,
    first_chunk,
)
from sluice.parsers.common import WHITESPACE, partial_tag_len
from sluice.parsers.jsonscan import ArgsCollector, ToolCallScanner

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class Status(enum.Enum):
    DONE = "done"
    MORE = "more"
    FAIL = "fail"


DONE, MORE, FAIL = Status.DONE, Status.MORE, Status.FAIL


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in WHITESPACE:
        i += 1
    return i


class LitReader:
    """Markup: its non-whitespace runs in order, any whitespace before and between;
    whitespace the markup ends with is taken when the text has it."""

    __slots__ = ("_chunk", "_off", "_tail", "chunks", "lenient", "trailing")

    def __init__(self, text: str, lenient: bool = False) -> None:
        self.chunks = chunks(text)
        # Closing markup: when the text ends after its first piece, it counts as written
        # (a model stops at its end-of-turn token where the template writes more).
        self.lenient = lenient
        self.trailing = text[len(text.rstrip()) :] if self.chunks else ""
        self._chunk = 0  # the chunk being matched
        self._off = 0  # characters of it matched so far
        self._tail = 0  # characters of ``trailing`` matched so far

    def skip_to(self, chunk: str) -> None:
        """Start matching at ``chunk`` (the earlier pieces were left out)."""
        if chunk in self.chunks:
            self._chunk = self.chunks.index(chunk)
            self._off = 0

    def feed(self, text: str, i: int, final: bool) -> tuple[int, Status]:
        n = len(text)
        chunks = self.chunks
        while self._chunk < len(chunks):
            chunk = chunks[self._chunk]
            if self._off == 0:
                i = skip_ws(text, i)
            if i >= n:
                if final:
                    return i, DONE if self.lenient and self._chunk > 0 else FAIL
                return i, MORE
            want = chunk[self._off :]
            got = text[i : i + len(want)]
            if not want.startswith(got):
                return i, FAIL
            i += len(got)
            self._off += len(got)
            if self._off < len(chunk):
                return i, FAIL if final else MORE
            self._chunk += 1
            self._off = 0
        while self._tail < len(self.trailing):
            if i >= n:
                return i, DONE if final else MORE
            if text[i] != self.trailing[self._tail]:
                break
            i += 1
            self._tail += 1
        return i, DONE


class NameReader:
    """A function name (or, with ``stop``, a call id: anything up to ``stop``'s first
    character or whitespace)."""

    __slots__ = ("_stop", "_text", "value")

    def __init__(self, stop: str | None = None) -> None:
        self._stop = stop
        self._text = ""
        self.value: str | None = None

    def _ok(self, c: str) -> bool:
        if self._stop is None:
            return c in NAME_CHARS
        return c not in WHITESPACE and c != self._stop

    def feed(self, text: str, i: int, final: bool) -> tuple[int, Status]:
        if not self._text:
            i = skip_ws(text, i)
        n = len(text)
        start = i
        while i < n and self._ok(text[i]):
            i += 1
        self._text += text[start:i]
        if i >= n and not final:
            return i, MORE
        if not self._text:
            return i, FAIL
        self.value = self._text
        return i, DONE


class JsonArgsReader:
    """The arguments as a JSON object, streamed as written."""

    __slots__ = ("_args",)

    def __init__(self) -> None:
        self._args = ArgsCollector()

    def feed(self, text: str, i: int, final: bool) -> tuple[int, Status]:
        i = self._args.feed(text, i)
        if self._args.failed:
            return i, FAIL
        if self._args.done:
            return i, DONE
        if final:
            return i, DONE if self._args.raw else FAIL
        return i, MORE

    def take(self, final: bool = False) -> str:
        return self._args.rest() if final or self._args.done else self._args.take()


class CallObjectReader:
    """The whole call as one JSON object."""

    __slots__ = ("_pending", "_scan", "call_id", "value")

    def __init__(self, spec: CallObject) -> None:
        self._scan = ToolCallScanner(
            spec.name_key, spec.args_keys, id_key=spec.id_key, name_is_key=spec.name_is_key
        )
        self._pending = ""
        self.value: str | None = None
        self.call_id: str | None = None

    def feed(self, text: str, i: int, final: bool) -> tuple[int, Status]:
        if not self._scan.raw:
            i = skip_ws(text, i)
        step = self._scan.feed(text[i:])
        i += step.consumed
        if step.name is not None:
            self.value = step.name
        self.call_id = self._scan.call_id
        self._pending += step.arguments
        if self._scan.failed:
            return i, DONE if self.value is not None else FAIL
        if self._scan.done:
            return i, DONE
        if final:
            if self.value is None:
                return i, FAIL
            self._pending += self._scan.finish().arguments
            return i, DONE
        return i, MORE

    def take(self, final: bool = False) -> str:
        out, self._pending = self._pending, ""
        return out


class _Tag(enum.Enum):
    BETWEEN = "between"  # before an argument, or the end of the arguments
    PREFIX = "prefix"
    KEY = "key"
    KEY_SUFFIX = "key_suffix"
    VALUE_PREFIX = "value_prefix"
    VALUE = "value"
    VALUE_SUFFIX = "value_suffix"
    FLAG = "flag"  # string="true|false" in the key's markup
    CDATA = "cdata"  # inside <![CDATA[...]]>


_READ_STATES = frozenset((_Tag.KEY, _Tag.VALUE, _Tag.FLAG, _Tag.CDATA))  # not literal markup


class JsonStrings:
    """Whether a JSON value written so far is inside one of its strings, where its
    closing markup is text of the string (``{"html": "</arg_value>"}``). Only for a
    value that opens as JSON's structures do (a bare word has no strings)."""

    __slots__ = ("_escape", "_in_string", "_kind")

    def __init__(self) -> None:
        self._kind = ""  # the value's first character
        self._in_string = False
        self._escape = False

    def take(self, text: str) -> None:
        """Go on over ``text`` (what the value has taken)."""
        self._kind, self._in_string, self._escape = self._over(text)

    def _over(self, text: str) -> tuple[str, bool, bool]:
        kind, in_string, escape = self._kind, self._in_string, self._escape
        if not kind:
            head = text.lstrip()
            if not head:
                return kind, in_string, escape
            kind = head[0]
        if kind not in '{["':
            return kind, in_string, escape
        for c in text:
            if escape:
                escape = False
            elif c == "\\":
                escape = in_string
            elif c == '"':
                in_string = not in_string
        return kind, in_string, escape

    def find(self, stop: str, text: str, i: int) -> int:
        """The first ``stop`` in ``text`` from ``i`` on that is not inside a string
        (-1 if none); nothing is taken."""
        at = text.find(stop, i)
        while at != -1 and self._over(text[i:at])[1]:
            at = text.find(stop, at + 1)
        return at


class TaggedArgsReader:
    """Arguments in markup, as a JSON object. A string parameter's value streams as it
    is written; other values go out once complete."""

    __slots__ = (
        "_closing",
        "_end",
        "_end_text",
        "_flag",
        "_fresh",
        "_json",
        "_key",
        "_lit",
        "_mark",
        "_out",
        "_sent_value",
        "_state",
        "_stringy",
        "_strip_tail",
        "_suffix",
        "_value",
        "count",
        "spec",
        "types",
    )

    def __init__(self, spec: TaggedArgs, end: str, types: dict[str, Any] | None) -> None:
        self.spec = spec
        self.types = types or {}
        self._end = first_chunk(end)  # what follows the arguments
        self._end_text = end
        self._suffix = first_chunk(spec.value_suffix)
        # whitespace the template writes between a value and its closing markup
        lead = spec.value_suffix[: len(spec.value_suffix) - len(spec.value_suffix.lstrip())]
        self._strip_tail = lead
        self._closing = spec.value_suffix  # with the key, where the markup names it
        self._state = _Tag.BETWEEN
        self._lit: LitReader | None = None
        self._key = ""
        self._value = ""
        self._sent_value = 0
        self._stringy = False
        self._flag: bool | None = None  # what the markup said (STRING_FLAG), if it says
        self._fresh = False  # at a value's first character (where CDATA may open)
        self._json = JsonStrings()  # where a JSON value's strings are
        # where the key's markup says what the value is (STRING_FLAG or TYPE_NAME)
        self._mark = next((m for m in (STRING_FLAG, TYPE_NAME) if m in spec.key_suffix), "")
        self._out = ""
        self.count = 0

    def take(self, final: bool = False) -> str:
        out, self._out = self._out, ""
        return out

    def feed(self, text: str, i: int, final: bool) -> tuple[int, Status]:
        spec = self.spec
        n = len(text)
        while True:
            state = self._state
            if state is _Tag.BETWEEN:
                i = skip_ws(text, i)
                # Another argument if its whole opening markup follows, else the end (the
                # end's markup wins where both match: "<" opens a key and "</invoke>").
                ended = (
                    LitReader(self._end_text).feed(text, i, final)[1] if self._end_text else FAIL
                )
                if ended is DONE:
                    self._out += "}" if self.count else "{}"
                    return i, DONE
                if ended is MORE and not final:
                    return i, MORE  # the end's markup may still be what follows
                probe = LitReader(spec.key_prefix)
                j, status = probe.feed(text, i, final)
                if status is DONE:
                    i, self._state, self._key = j, _Tag.KEY, ""
                    continue
                if status is MORE and not final:
                    return i, MORE
                self._out += "}" if self.count else "{}"
                return i, DONE
            if state not in _READ_STATES:
                assert self._lit is not None
                i, status = self._lit.feed(text, i, final)
                if status is FAIL and state is _Tag.VALUE_SUFFIX and final:
                    status = DONE  # the text ended in the closing markup
                if status is not DONE:
                    return i, status
                if state is _Tag.PREFIX:
                    self._state, self._key = _Tag.KEY, ""
                elif state is _Tag.KEY_SUFFIX:
                    self._begin_value()
                elif state is _Tag.VALUE_PREFIX:
                    self._start_value()
                else:
                    self._state = _Tag.BETWEEN
                continue
            if state is _Tag.KEY:
                stop = first_chunk(spec.key_suffix)
                at = text.find(stop, i) if stop else -1
                if at == -1:
                    keep = partial_tag_len(text[i:], (stop,)) if stop else 0
                    self._key += text[i : n - keep]
                    if final:
                        return n, FAIL
                    return n - keep, MORE
                self._key = (self._key + text[i:at]).strip()
                i = at
                if self._mark:  # the markup says whether it is a string, or its type
                    self._lit = LitReader(spec.key_suffix.partition(self._mark)[0])
                    self._state = _Tag.FLAG
                else:
                    self._lit = LitReader(spec.key_suffix)
                    self._state = _Tag.KEY_SUFFIX
                continue
            if state is _Tag.FLAG:
                assert self._lit is not None
                i, status = self._lit.feed(text, i, final)
                if status is not DONE:
                    return i, status
                j = i
                while j < n and text[j].isalpha():
                    j += 1
                if j == n and not final:
                    return i, MORE  # the word may go on
                word = text[i:j]
                if self._mark == TYPE_NAME and word:
                    known = self._key in self.types  # the schema decides where it knows
                    self._flag = None if known else word == "string"
                elif word in ("true", "false"):
                    self._flag = word == "true"
                else:
                    return i, FAIL
                i = j
                self._lit = LitReader(spec.key_suffix.partition(self._mark)[2])
                self._state = _Tag.KEY_SUFFIX
                continue
            if state is _Tag.VALUE and self._fresh:
                rest = text[i : i + len(CDATA_OPEN)]
                if rest == CDATA_OPEN:
                    self._fresh = False
                    self._state = _Tag.CDATA
                    i += len(CDATA_OPEN)
                    continue
                if CDATA_OPEN.startswith(rest) and not final and len(rest) < len(CDATA_OPEN):
                    return i, MORE  # CDATA may still open (or nothing came yet)
                self._fresh = False
            # VALUE (up to its closing markup) or CDATA (up to "]]>", then the closing)
            stop = CDATA_CLOSE if state is _Tag.CDATA else self._suffix
            if state is _Tag.VALUE and not self._stringy and stop:
                at = self._json.find(stop, text, i)  # not inside one of its strings
            else:
                at = text.find(stop, i) if stop else -1
            if at == -1:
                keep = 0 if final else partial_tag_len(text[i:], (stop,))
                self._json.take(text[i : n - keep])
                self._value += text[i : n - keep]
                if not final:
                    self._stream_value()
                    return n - keep, MORE
                self._end_value()
                self._out += "}"
                return n, DONE
            self._json.take(text[i:at])
            self._value += text[i:at]
            self._end_value()
            self._lit = LitReader(self._closing)
            self._state = _Tag.VALUE_SUFFIX
            i = at + len(CDATA_CLOSE) if state is _Tag.CDATA else at

    def _begin_value(self) -> None:
        spec = self.spec
        self._closing = spec.value_suffix.replace(KEY_NAME, self._key)
        # A closing tag named by the key is found whole (values may nest other tags).
        named = KEY_NAME in spec.value_suffix
        self._suffix = self._closing if named else first_chunk(self._closing)
        flag, self._flag = self._flag, None
        schema = self.types.get(self._key)
        if flag is not None:
            self._stringy = flag
        else:
            self._stringy = _may_be_string(schema) if spec.nested else _is_string(schema)
        head = "{" if self.count == 0 else ", "
        self._out += head + json.dumps(self._key, ensure_ascii=False) + ": "
        self.count += 1
        if self._stringy:
            self._out += '"'
        if self.spec.value_prefix.strip():
            self._lit = LitReader(self.spec.value_prefix)
            self._state = _Tag.VALUE_PREFIX
        else:
            self._start_value()

    def _start_value(self) -> None:
        self._state, self._value, self._sent_value = _Tag.VALUE, "", 0
        self._json = JsonStrings()
        self._fresh = self.spec.cdata

    def _stream_value(self) -> None:
        if not self._stringy:
            return
        ready = len(self._value.rstrip(WHITESPACE))
        if ready > self._sent_value:
            self._out += _escape(self._value[self._sent_value : ready])
            self._sent_value = ready

    def _end_value(self) -> None:
        value = self._value
        tail = self._strip_tail
        if tail and value.endswith(tail):
            value = value[: -len(tail)]
        if self._stringy:
            self._out += _escape(value[self._sent_value :]) + '"'
        elif self.spec.nested and (
            value.lstrip().startswith(self.spec.key_prefix)
            or (not value.strip() and _structured(self.types.get(self._key)))
        ):  # markup inside: an object's members or an array's items (maybe none)
            schema = self.types.get(self._key)
            nested = _markup_value(value, schema if isinstance(schema, dict) else {}, self.spec)
            self._out += json.dumps(nested, ensure_ascii=False)
        else:
            self._out += _typed(value)
        self._value = ""


def _is_string(schema: Any) -> bool:
    """Whether a parameter's schema says string (its value is then never read as JSON)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if isinstance(kind, list):
        return kind == ["string"]
    return kind == "string"


def _may_be_string(schema: Any) -> bool:
    """Whether a string is one of the values ``schema`` allows (a union with a string
    alternative reads as a string, as llama.cpp reads it)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    alternatives = schema.get("anyOf") or schema.get("oneOf") or []
    return any(_may_be_string(a) for a in alternatives)


def _tags(text: str, spec: TaggedArgs) -> list[tuple[str, str]] | None:
    """``text`` as a sequence of elements ``(tag, inside)`` in ``spec``'s markup, or None
    if it is not one."""
    out: list[tuple[str, str]] = []
    i, n = skip_ws(text, 0), len(text)
    while i < n:
        if not text.startswith(spec.key_prefix, i):
            return None
        at = text.find(spec.key_suffix, i + len(spec.key_prefix))
        if at == -1:
            return None
        tag = text[i + len(spec.key_prefix) : at]
        opening = spec.key_prefix + tag + spec.key_suffix
        closing = spec.value_suffix.replace(KEY_NAME, tag)
        start = j = at + len(spec.key_suffix)
        depth = 1
        while depth:  # the matching close, past any element of the same name inside
            close = text.find(closing, j)
            if close == -1:
                return None
            again = text.find(opening, j, close)
            if again != -1:
                depth, j = depth + 1, again + len(opening)
            else:
                depth, j = depth - 1, close + len(closing)
        out.append((tag, text[start : j - len(closing)]))
        i = skip_ws(text, j)
    return out


def _fits(tags: list[tuple[str, str]] | None, schema: dict[str, Any]) -> bool:
    """Whether elements (or plain text, None) have the shape ``schema`` asks for."""
    kind = schema.get("type")
    if kind == "array":
        return bool(tags is not None and all(t == "item" for t, _ in tags))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        names = {t for t, _ in tags or []}
        return tags is not None and names <= set(props) and set(schema.get("required", [])) <= names
    return tags is None


def _markup_value(text: str, schema: dict[str, Any], spec: TaggedArgs) -> Any:
    """A value written as nested markup, read as the JSON its schema describes."""
    tags = _tags(text, spec)
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        schema = next((a for a in alternatives if isinstance(a, dict) and _fits(tags, a)), {})
    if tags is None or _is_string(schema):  # an empty string is no empty object
        return json.loads(_typed(text)) if not _is_string(schema) else text
    if schema.get("type") == "array" or (not schema and tags and all(t == "item" for t, _ in tags)):
        items = schema.get("items")
        item = items if isinstance(items, dict) else {}
        return [_markup_value(inside, item, spec) for _, inside in tags]
    props = schema.get("properties") or {}
    out: dict[str, Any] = {}
    for tag, inside in tags:
        sub = props.get(tag)
        out[tag] = _markup_value(inside, sub if isinstance(sub, dict) else {}, spec)
    return out


def _structured(schema: Any) -> bool:
    """Whether ``schema`` says array or object (an empty value is then one with nothing in it)."""
    return isinstance(schema, dict) and schema.get("type") in ("array", "object")


def _typed(value: str) -> str:
    """A value of a non-string (or nullable string) parameter: its JSON if it is JSON,
    else a string."""
    text = value.strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(parsed, ensure_ascii=False)


def _escape(text: str) -> str:
    """``text`` as the inside of a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _WholeArgs:
    """Arguments read whole (bracket depth counted) and given out as JSON at their end."""

    __slots__ = ("_depth", "_out", "_text")

    def __init__(self) -> None:
        self._text = ""
        self._depth = 0
        self._out = ""

    def take(self, final: bool = False) -> str:
        out, self._out = self._out, ""
        return out


class PythonArgsReader(_WholeArgs):
    """Python keyword arguments in parentheses; the JSON object once they close."""

    __slots__ = ("_escape", "_quote")

    def __init__(self) -> None:
        super().__init__()
        self._quote = ""
        self._escape = False

    def feed(self, text: str, i: int, final: bool) -> tuple[int, Status]:
        if not self._text:
            i = skip_ws(text, i)
            if i < len(text) and text[i] != "(":
                return i, FAIL
        n = len(text)
        start = i
        while i < n:
            c = text[i]
            i += 1
            if self._quote:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "\"'":
                self._quote = c
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._text += text[start:i]
                    return self._finish(i)
        self._text += text[start:i]
        if final:
            return i, FAIL
        return i, MORE

    def _finish(self, i: int) -> tuple[int, Status]:
        try:
            call = ast.parse(f"f{self._text}", mode="eval").body
        except SyntaxError:
            return i, FAIL
        if not isinstance(call, ast.Call) or call.args:
            return i, FAIL
        args: dict[str, Any] = {}
        source = f"f{self._text}"
        for kw in call.keywords:
            if kw.arg is None:
                return i, FAIL
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:  # JSON's true/false/null, as LFM2 sometimes writes them
                try:
                    args[kw.arg] = json.loads(ast.get_source_segment(source, kw.value) or "")
                except ValueError:
                    return i, FAIL
        self._out = json.dumps(args, ensure_ascii=False)
        return i, DONE


_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.\-]*)\s*:")


def gemma_json(text: str) -> str | None:
    """Gemma 4's ``{key:<|"|>v<|"|>,n:1}`` as JSON text; None if it is not that."""
    out = []
    parts = text.split(GEMMA_QUOTE)
    if len(parts) % 2 == 0:
        return None  # an unclosed string
    for k, part in enumerate(parts):
        out.append(
            json.dumps(part, ensure_ascii=False) if k % 2 else _BARE_KEY.sub(r'\1"\2":', part)
        )
    joined = "".join(out)
    try:
        return json.dumps(json.loads(joined), ensure_ascii=False)
    except ValueError:
        return None


class GemmaArgsReader(_WholeArgs):
    """Gemma 4's arguments object, as JSON once it closes."""

    __slots__ = ("_in_str",)

    def __init__(self) -> None:
        super().__init__()
        self._in_str = False

    def feed(self, text: str, i: int, final: bool) -> tuple[int, Status]:
        if not self._text:
            i = skip_ws(text, i)
            if i < len(text) and text[i] != "{":
                return i, FAIL
        n = len(text)
        while i < n:
            if text.startswith(GEMMA_QUOTE, i):
                self._in_str = not self._in_str
                self._text += GEMMA_QUOTE
                i += len(GEMMA_QUOTE)
                continue
            if GEMMA_QUOTE.startswith(text[i:]) and not final:
                return i, MORE  # maybe the start of a quote mark: wait
            c = text[i]
            self._text += c
            i += 1
            if self._in_str:
                continue
            if c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    converted = gemma_json(self._text)
                    if converted is None:
                        return i, FAIL
                    self._out = converted
                    return i, DONE
        return i, FAIL if final else MORE
