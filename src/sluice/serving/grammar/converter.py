"""GBNF grammars for constrained decoding: JSON schemas and tool-call shapes.

The JSON-schema translation is llama.cpp's own converter, as shipped in
llama-cpp-python (``llama_cpp.llama_grammar.SchemaConverter``, pure Python),
subclassed here where that port is unsafe or wrong on user input:

- Bounded repetitions (``minLength``/``maxLength``, ``minItems``/``maxItems``,
  a pattern's ``{m,n}``) are chains of small shared rules, each link charged
  against a per-grammar budget (``max_repeat``). The port writes every copy
  into nested groups, so a ``maxLength`` of 10**9 took the process to 20+ GB,
  and llama.cpp rejects its output past about a thousand copies. A maximum
  the output can never reach (above ``max_output_chars``) is compiled
  unbounded, which accepts exactly the same outputs up to that length.
- Regex patterns are translated here: the port writes ``\\d`` into the GBNF
  (which llama.cpp rejects), repeats whole escaped runs, and lets ``.`` or a
  pattern's ``"`` write a raw quote inside a JSON string.
- Literals escape backslashes and ``$ref`` names are rule names, so no schema
  text reaches the GBNF outside a quoted literal or a character class.
- Objects with many optional properties build in linear time.
- Wide grammars are bounded (``max_alternatives``). llama.cpp checks the whole
  vocabulary against every parse stack open at a point of the output, once
  per sampled token, on the engine thread every stream waits for: an enum of
  5,000 values cost about 1 s per token. Enum values and tool names are
  written as tries (a stack per distinct next character, not per value),
  optional properties as one choice after a shared comma, and the width (an
  upper bound on the open stacks, read off the GBNF: see ``_WidthAnalysis``;
  a stack that takes a space next counts twice) is a 400 past the limit.

Any failure on a schema is an :class:`InvalidRequest` naming the request field.

Example::

    hermes = CallFraming(call_open="<tool_call>", call_close="</tool_call>")
    g = tool_call_grammar([ToolSpec("get_weather", schema)], hermes, max_calls=1)
    g = json_schema_grammar(schema, param="response_format.json_schema.schema",
                            max_repeat=4096, max_output_chars=n_ctx * longest_piece,
                            max_alternatives=32)
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from sluice.errors import InvalidRequest

DEFAULT_MAX_REPEAT = 4096
REPEAT_SETTING = "--max-grammar-repeat"
DEFAULT_MAX_ALTERNATIVES = 32
ALTERNATIVES_SETTING = "--max-grammar-alternatives"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]
    param: str = "tools"  # the request field named by a schema error


@dataclass(frozen=True, slots=True)
class CallFraming:
    """How a family writes tool calls around the JSON call objects.

    The whole output is ``prefix call (sep call)* suffix`` and each call is
    ``call_open {"<name_key>": "...", "<args_key>": {...}} call_close``.
    """

    prefix: str = ""
    call_open: str = ""
    call_close: str = ""
    sep: str = "\n"
    suffix: str = ""
    name_key: str = "name"
    args_key: str = "arguments"


class _SchemaProblem(Exception):
    """A schema the converter cannot or will not translate (message for the client)."""


class _OverBudget(_SchemaProblem):
    pass


# -- integers ---------------------------------------------------------------------------

_MAX_DIGITS = 15  # integers without an upper bound: at most this many digits
_INT_LIMIT = 10**_MAX_DIGITS - 1


def _digit_patterns(lo: str, hi: str) -> list[str]:
    """GBNF sequences matching exactly the same-length decimal strings in [lo, hi]."""
    if lo == hi:
        return [" ".join(f'"{c}"' for c in lo)]
    i = next(k for k in range(len(lo)) if lo[k] != hi[k])
    prefix = [f'"{c}"' for c in lo[:i]]
    rest = len(lo) - i - 1
    if set(lo[i + 1 :]) <= {"0"} and set(hi[i + 1 :]) <= {"9"}:
        return [" ".join([*prefix, f"[{lo[i]}-{hi[i]}]", *["[0-9]"] * rest])]
    out: list[str] = []
    start, end = int(lo[i]), int(hi[i])
    if not set(lo[i + 1 :]) <= {"0"}:
        out += [" ".join([*prefix, p]) for p in _digit_patterns(lo[i:], lo[i] + "9" * rest)]
        start += 1
    tail: list[str] = []
    if not set(hi[i + 1 :]) <= {"9"}:
        tail = [" ".join([*prefix, p]) for p in _digit_patterns(hi[i] + "0" * rest, hi[i:])]
        end -= 1
    if start <= end:
        out.append(" ".join([*prefix, f"[{start}-{end}]", *["[0-9]"] * rest]))
    return out + tail


def _natural_range(lo: int, hi: int | None) -> list[str]:
    """Patterns for the non-negative integers in [lo, hi] (hi None: no bound)."""
    top = hi if hi is not None else _INT_LIMIT
    out: list[str] = []
    for n_digits in range(len(str(lo)), len(str(top)) + 1):
        a = max(lo, 10 ** (n_digits - 1) if n_digits > 1 else 0)
        b = min(top, 10**n_digits - 1)
        if a <= b:
            out += _digit_patterns(str(a), str(b))
    return out


def integer_range_rule(lo: int | None, hi: int | None) -> str | None:
    """A GBNF alternative for integers within the bounds; None when unbounded below.

    Bounds beyond 15 digits are clamped: the integers written are those of
    llama.cpp's unbounded integer rule, at most 15 digits.
    """
    if lo is None:
        if hi is None or hi < 0:
            return None
        lo = -_INT_LIMIT
    if hi is not None and hi < lo:
        raise InvalidRequest(f"Empty integer range: minimum {lo} > maximum {hi}.")
    lo = max(lo, -_INT_LIMIT)
    hi = None if hi is None or hi >= _INT_LIMIT else hi
    if lo > _INT_LIMIT or (hi is not None and hi < -_INT_LIMIT):
        raise InvalidRequest(f"Integer bounds beyond {_MAX_DIGITS} digits are not supported.")
    alts: list[str] = []
    if lo < 0:
        # One "-" before all the negative patterns: one parse stack, not one each.
        neg_hi = -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        alts.append('"-" (' + " | ".join(f"({p})" for p in _natural_range(neg_lo, neg_hi)) + ")")
    if hi is None or hi >= 0:
        alts += _natural_range(max(lo, 0), hi)
    return " | ".join(f"({a})" for a in alts)


def _bound(schema: dict[str, Any], key: str) -> float | None:
    """A numeric keyword (``minimum``...); None when absent."""
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _SchemaProblem(f"'{key}' must be a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _SchemaProblem(f"'{key}' must be finite")
    return value


def _integer_rule(schema: dict[str, Any]) -> str | None:
    """The integers within the schema's bounds (None: unbounded below)."""
    lows: list[int] = []
    highs: list[int] = []
    for key, low in (("minimum", True), ("maximum", False)):
        value = _bound(schema, key)
        # Draft 4 writes an exclusive bound as a boolean beside the inclusive one.
        exclusive = schema.get("exclusiveMinimum" if low else "exclusiveMaximum") is True
        if value is not None:
            if low:
                lows.append(math.floor(value) + 1 if exclusive else math.ceil(value))
            else:
                highs.append(math.ceil(value) - 1 if exclusive else math.floor(value))
    for key, low in (("exclusiveMinimum", True), ("exclusiveMaximum", False)):
        if isinstance(schema.get(key), bool):
            continue
        value = _bound(schema, key)
        if value is not None:
            (lows if low else highs).append(math.floor(value) + 1 if low else math.ceil(value) - 1)
    return integer_range_rule(max(lows) if lows else None, min(highs) if highs else None)


# -- literals and character classes ------------------------------------------------------

_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_LITERAL_SPECIAL = re.compile(r'[\\"\x00-\x1f\x7f]')


def gbnf_literal(text: str) -> str:
    """A GBNF literal matching exactly ``text``."""
    escaped = _LITERAL_SPECIAL.sub(
        lambda m: _LITERAL_ESCAPES.get(m[0]) or f"\\x{ord(m[0]):02X}", text
    )
    return f'"{escaped}"'


def _class_char(cp: int) -> str:
    c = chr(cp)
    if c.isascii() and c.isalnum():
        return c
    if cp < 0x100:
        return f"\\x{cp:02X}"
    return f"\\u{cp:04X}" if cp < 0x10000 else f"\\U{cp:08X}"


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _subtract(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = _merge(ranges)
    for c_lo, c_hi in cut:
        nxt: list[tuple[int, int]] = []
        for lo, hi in out:
            if hi < c_lo or lo > c_hi:
                nxt.append((lo, hi))
                continue
            if lo < c_lo:
                nxt.append((lo, c_lo - 1))
            if hi > c_hi:
                nxt.append((c_hi + 1, hi))
        out = nxt
    return out


# Characters a JSON string cannot hold as themselves; a pattern that allows them
# gets their JSON escapes (control characters other than tab, LF and CR: never).
_JSON_SPECIAL = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_JSON_ESCAPED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x22: '\\"', 0x5C: "\\\\"}


def _json_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    """A GBNF atom for one character of a JSON string's text in (or outside) ``ranges``."""
    ranges = _merge(ranges)

    def inside(cp: int) -> bool:
        return any(lo <= cp <= hi for lo, hi in ranges)

    spec = "".join(
        _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
        for lo, hi in (
            _merge(ranges + _JSON_SPECIAL) if negated else _subtract(ranges, _JSON_SPECIAL)
        )
    )
    alts = [f"[^{spec}]"] if negated else ([f"[{spec}]"] if spec else [])
    alts += [gbnf_literal(text) for cp, text in _JSON_ESCAPED.items() if inside(cp) != negated]
    if not alts:
        raise _SchemaProblem("a character class in 'pattern' matches no character")
    return alts[0] if len(alts) == 1 else f"({' | '.join(alts)})"


_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_SETS = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CONTROL = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
_QUANTIFIER = re.compile(r"\{([0-9]+)(?:(,)([0-9]*))?\}")


class _Pattern:
    """A JSON-schema ``pattern`` (ECMA regex, anchored) as a GBNF expression over JSON text.

    Supported: literals and escapes, ``.``, classes (``\\d \\w \\s`` and their
    negations), groups ``( )`` / ``(?: )``, ``|``, and ``* + ? {m} {m,} {m,n}``
    (lazy forms too). Anything else is a schema error, never invalid GBNF.
    """

    def __init__(self, conv: Any, pattern: str) -> None:
        self.conv = conv
        if not (pattern.startswith("^") and pattern.endswith("$")):
            raise _SchemaProblem("a 'pattern' must start with '^' and end with '$'")
        body = pattern[1:-1]
        if (len(body) - len(body.rstrip("\\"))) % 2:
            raise _SchemaProblem("a 'pattern' must end with an unescaped '$'")
        self.text = body
        self.i = 0

    def translate(self) -> str:
        expr, _ = self._alternation()
        if self.i < len(self.text):
            raise _SchemaProblem(f"unbalanced ')' at {self.i + 1} in 'pattern'")
        return expr

    def _peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def _alternation(self) -> tuple[str, bool]:
        seqs = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            seqs.append(self._sequence())
        return " | ".join(s for s, _ in seqs), any(n for _, n in seqs)

    def _sequence(self) -> tuple[str, bool]:
        # Items: (gbnf, the JSON text when a plain literal, can match empty)
        items: list[tuple[str, str | None, bool]] = []
        while self.i < len(self.text) and self._peek() not in "|)":
            items.append(self._quantified(self._atom()))
        parts: list[str] = []
        run: list[str] = []
        for gbnf, lit, _ in items:
            if lit is not None:
                run.append(lit)
                continue
            if run:
                parts.append(gbnf_literal("".join(run)))
                run = []
            parts.append(gbnf)
        if run:
            parts.append(gbnf_literal("".join(run)))
        return " ".join(p for p in parts if p) or '""', all(n for _, _, n in items)

    def _atom(self) -> tuple[str, str | None, bool]:
        c = self._peek()
        if c == "(":
            self.i += 1
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self._peek() == "?":
                raise _SchemaProblem("'pattern' groups other than ( ) and (?: ) are not supported")
            inner, nullable = self._alternation()
            if self._peek() != ")":
                raise _SchemaProblem("unbalanced '(' in 'pattern'")
            self.i += 1
            return f"({inner})", None, nullable
        if c == "[":
            return self._char_class(), None, False
        if c == ".":
            self.i += 1
            dot = _json_class([(0x0A, 0x0A), (0x0D, 0x0D)], negated=True)
            return self.conv._add_rule("dot", dot), None, False
        if c == "\\":
            return self._escape()
        if c in "*+?{":
            raise _SchemaProblem(f"nothing to repeat at {self.i + 1} in 'pattern'")
        if c in "^$":
            raise _SchemaProblem("'^' and '$' are supported only at the ends of a 'pattern'")
        self.i += 1
        text = _json_text(c)
        return gbnf_literal(text), text, False

    def _quantified(self, atom: tuple[str, str | None, bool]) -> tuple[str, str | None, bool]:
        gbnf, _, nullable = atom
        c = self._peek()
        where = f"at {self.i + 1} in 'pattern'"
        if c in ("*", "+", "?"):
            self.i += 1
            if c != "?" and nullable:
                raise _SchemaProblem(f"'{c}' on a group that can match nothing {where}")
            out = (f"{_atomic(gbnf)}{c}", None, c != "+" or nullable)
        elif c == "{":
            m = _QUANTIFIER.match(self.text, self.i)
            if m is None:
                raise _SchemaProblem(f"invalid quantifier {where}")
            try:
                lo = int(m[1])
                hi = lo if m[2] is None else (int(m[3]) if m[3] else None)
            except ValueError as exc:  # more digits than int() parses
                raise _SchemaProblem(f"quantifier too large {where}") from exc
            self.i = m.end()
            if hi is not None and hi < lo:
                raise _SchemaProblem(f"quantifier {m[0]} has its maximum below its minimum")
            if nullable and (hi is None or hi > 1):
                raise _SchemaProblem(f"quantifier {m[0]} on a group that can match nothing")
            what = f"the quantifier {_clip(m[0])} in 'pattern'"
            out = (self.conv._repeat(gbnf, lo, hi, what=what), None, lo == 0 or nullable)
        else:
            return atom
        if self._peek() == "?":  # lazy: the same strings
            self.i += 1
        if self._peek() in ("*", "+", "?") or _QUANTIFIER.match(self.text, self.i):
            raise _SchemaProblem(f"multiple repeat at {self.i + 1} in 'pattern'")
        return out

    def _escape(self) -> tuple[str, str | None, bool]:
        c = self.text[self.i + 1 : self.i + 2]
        if c and c.lower() in _SETS:
            self.i += 2
            return _json_class(_SETS[c.lower()], negated=c.isupper()), None, False
        text = _json_text(chr(self._escaped_char(in_class=False)))
        return gbnf_literal(text), text, False

    def _escaped_char(self, *, in_class: bool) -> int:
        """The code point of the escape at ``self.i`` (``\\n``, ``\\x41``, ``\\.``...)."""
        c = self.text[self.i + 1] if self.i + 1 < len(self.text) else ""
        if c in ("x", "u"):
            n = 2 if c == "x" else 4
            digits = self.text[self.i + 2 : self.i + 2 + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise _SchemaProblem(f"invalid \\{c} escape in 'pattern'")
            self.i += 2 + n
            return int(digits, 16)
        if c in _CONTROL or (in_class and c == "b"):
            self.i += 2
            return 0x08 if c == "b" else _CONTROL[c]
        if not c or c.isalnum():
            raise _SchemaProblem(f"the escape \\{c} in 'pattern' is not supported")
        self.i += 2
        return ord(c)

    def _char_class(self) -> str:
        self.i += 1
        negated = self._peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self._peek()
            if not c:
                raise _SchemaProblem("unbalanced '[' in 'pattern'")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "\\" and self.text[self.i + 1 : self.i + 2].lower() in _SETS:
                letter = self.text[self.i + 1]
                if letter.isupper():
                    raise _SchemaProblem(f"\\{letter} inside a class in 'pattern' is not supported")
                ranges += _SETS[letter]
                self.i += 2
                continue
            lo = self._class_member()
            if self._peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("", "]"):
                self.i += 1
                hi = self._class_member()
                if hi < lo:
                    raise _SchemaProblem("a class range in 'pattern' is out of order")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        return _json_class(ranges, negated)

    def _class_member(self) -> int:
        c = self._peek()
        if c == "\\":
            return self._escaped_char(in_class=True)
        self.i += 1
        return ord(c)


def _json_text(c: str) -> str:
    """How a JSON string writes the character ``c`` (a lone surrogate only as ``\\uXXXX``)."""
    return json.dumps(c, ensure_ascii=0xD800 <= ord(c) <= 0xDFFF)[1:-1]


def _atomic(gbnf: str) -> str:
    """``gbnf`` as one operand of a postfix operator."""
    if re.fullmatch(r'[A-Za-z0-9-]+|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', gbnf):
        return gbnf
    if gbnf.startswith("(") and gbnf.endswith(")") and _balanced_group(gbnf):
        return gbnf
    return f"({gbnf})"


def _balanced_group(gbnf: str) -> bool:
    """Whether the outer parentheses of ``gbnf`` enclose all of it (quotes and classes skipped)."""
    depth = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[()]', gbnf):
        if m[0] == "(":
            depth += 1
        elif m[0] == ")":
            depth -= 1
            if depth == 0 and m.end() != len(gbnf):
                return False
    return depth == 0


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _count(schema: dict[str, Any], key: str) -> int | None:
    """A non-negative integer keyword (``maxLength``...); None when absent."""
    value = schema.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not value.is_integer())
        or value < 0
    ):
        raise _SchemaProblem(f"'{key}' must be a non-negative integer")
    return int(value)


# -- width: the parse stacks llama.cpp keeps at one point of the output -------------------
#
# llama.cpp samples a constrained token by checking the whole vocabulary against every
# parse stack open at that point of the output (one per alternative still possible), so
# a token costs about (open stacks) x (vocabulary), on the engine thread that every
# stream waits for. The width of a grammar bounds its open stacks from above. It is read
# off the GBNF, so every construct counts alike: enum values (written as a trie, they
# hold one stack per distinct next character), anyOf/oneOf branches, optional
# properties, a pattern's alternatives and ambiguous repetitions, tools.
#
# Alternatives whose texts tell them apart early (JSON values of different types,
# properties or enum values that differ within their leading text) are open together
# only within that leading text; alternatives that may stay open together (anyOf of
# objects, overlapping patterns) count their widths summed. Where parses may run in
# different items of a sequence at once (a pattern's "(ab)?(ab)?a"), every position of
# those items counts. A stack whose next character may be a space counts twice (see
# _weight). Measured in llama.cpp (SmolLM2, one thread): a width of 32 costs 10-20 ms
# per token at its widest point; any grammar ~3.5-5 ms; no grammar well under 1 ms.

# Sets of characters are bit masks: a bit per ASCII character, and the others share
# 128 more bits (code point modulo 128). Two sets that share a character always share
# a bit, so a test for overlap errs only towards "may overlap": a wider count.
Chars = int
_ALL_CHARS: Chars = (1 << 256) - 1
_HIGH_CHARS: Chars = _ALL_CHARS ^ ((1 << 128) - 1)


def _char_bit(cp: int) -> Chars:
    return 1 << (cp if cp < 128 else 128 + cp % 128)


def _chars_in(lo: int, hi: int) -> Chars:
    """The mask of code points ``lo``..``hi``."""
    out = 0
    if lo < 128:
        top = min(hi, 127)
        out = ((1 << (top + 1)) - 1) ^ ((1 << lo) - 1)
        lo = 128
    if hi >= lo:
        if hi - lo >= 127:
            return out | _HIGH_CHARS
        for cp in range(lo, hi + 1):
            out |= _char_bit(cp)
    return out


_NUMBER_START: Chars = _char_bit(ord("-")) | _chars_in(ord("0"), ord("9"))
_SPACE_CHAR: Chars = _char_bit(ord(" "))


def _weight(chars: Chars) -> int:
    """What a stack whose next character is one of ``chars`` counts for.

    Most tokens of a vocabulary start with a space (SmolLM2: 65%): a stack that
    takes a space goes on to check all of those against what follows, and costs
    about twice another.
    """
    return 2 if chars & _SPACE_CHAR else 1


_GBNF_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9_-]+|\{[0-9]+(?:,[0-9]*)?\}|[()|*+?.]|\S',
    re.DOTALL,
)
_GBNF_KIND = {'"': "lit", "[": "cls", "{": "rep", **dict.fromkeys("()|*+?.", "op")}
_GBNF_SIMPLE = {"n": "\n", "r": "\r", "t": "\t"}
# Rules of llama.cpp's converter whose sentences are single JSON values.
_VALUE_PRIMITIVES = frozenset(
    ["value", "object", "array", "string", "number", "integer", "boolean", "null", "uuid"]
    + [f"{name}-string" for name in ("date", "time", "date-time")]
)


def _gbnf_chars(text: str) -> list[int]:
    """Code points of the inside of a GBNF literal or class, escapes decoded."""
    out: list[int] = []
    i = 0
    while i < len(text):
        if text[i] != "\\":
            out.append(ord(text[i]))
            i += 1
            continue
        e = text[i + 1 : i + 2]
        n = {"x": 2, "u": 4, "U": 8}.get(e)
        if n is not None:
            out.append(int(text[i + 2 : i + 2 + n], 16))
            i += 2 + n
        else:
            out.append(ord(_GBNF_SIMPLE.get(e, e)))
            i += 2
    return out


def _gbnf_class(text: str) -> Chars:
    inner = text[1:-1]
    negated = inner.startswith("^")
    members = re.findall(
        r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|.",
        inner[1:] if negated else inner,
        re.DOTALL,
    )
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(members):
        lo = _gbnf_chars(members[i])[0]
        if i + 2 < len(members) and members[i + 1] == "-":
            ranges.append((lo, _gbnf_chars(members[i + 2])[0]))
            i += 3
        else:
            ranges.append((lo, lo))
            i += 1
    if negated:
        ranges = _subtract([(0, 0x10FFFF)], ranges)
    out = 0
    for lo, hi in ranges:
        out |= _chars_in(lo, hi)
    return out


# A rule body as a tree: ("lit", text) ("cls", ranges) ("ref", name) ("seq", items)
# ("alt", items) ("rep", item, min, max or None).
_Node = tuple[Any, ...]


def _parse_gbnf(body: str) -> _Node:
    toks: list[tuple[str, str]] = []
    for text in _GBNF_TOKEN.findall(body):
        kind = _GBNF_KIND.get(text[0])
        if kind is None:
            if not (text[0].isascii() and (text[0].isalnum() or text[0] in "_-")):
                raise AssertionError(f"unreadable GBNF {text!r} in {body[:80]!r}")
            kind = "name"
        elif (kind == "lit" and (len(text) < 2 or text[-1] != '"')) or (
            kind == "cls" and text[-1] != "]"
        ):
            raise AssertionError(f"unreadable GBNF {text!r} in {body[:80]!r}")
        toks.append((kind, text))
    at = 0

    def alternation() -> _Node:
        nonlocal at
        alts = [sequence()]
        while at < len(toks) and toks[at] == ("op", "|"):
            at += 1
            alts.append(sequence())
        return alts[0] if len(alts) == 1 else ("alt", tuple(alts))

    def sequence() -> _Node:
        nonlocal at
        items: list[_Node] = []
        while at < len(toks) and toks[at] not in (("op", "|"), ("op", ")")):
            kind, text = toks[at]
            at += 1
            item: _Node
            if kind == "lit":
                item = ("lit", "".join(map(chr, _gbnf_chars(text[1:-1]))))
            elif kind == "cls":
                item = ("cls", _gbnf_class(text))
            elif kind == "name":
                item = ("ref", text)
            elif text == ".":
                item = ("cls", _ALL_CHARS)
            elif text == "(":
                item = alternation()
                if at >= len(toks) or toks[at] != ("op", ")"):
                    raise AssertionError(f"unbalanced GBNF group in {body[:80]!r}")
                at += 1
            else:
                raise AssertionError(f"unexpected {text!r} in GBNF {body[:80]!r}")
            while at < len(toks) and (toks[at][0] == "rep" or toks[at][1] in ("*", "+", "?")):
                kind, text = toks[at]
                at += 1
                if kind == "rep":
                    lo, comma, hi = text[1:-1].partition(",")
                    item = ("rep", item, int(lo), int(hi) if hi else (None if comma else int(lo)))
                else:
                    item = ("rep", item, int(text == "+"), 1 if text == "?" else None)
            items.append(item)
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    tree = alternation()
    if at != len(toks):
        raise AssertionError(f"unbalanced GBNF group in {body[:80]!r}")
    return tree


def _refs(node: _Node) -> set[str]:
    out: set[str] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n[0] == "ref":
            out.add(n[1])
        elif n[0] in ("seq", "alt"):
            todo.extend(n[1])
        elif n[0] == "rep":
            todo.append(n[1])
    return out


# What every match starts with: characters, each from a set, each maybe absent (a
# ``space``). Two leads tell their expressions apart when no text fits both until one
# of them ends.
_Lead = tuple[tuple[Chars, bool], ...]
_LEAD_MAX = 48


def _divergence(a: _Lead, b: _Lead) -> tuple[int, int] | None:
    """None when some text fits both leads until one of them ends, else how many items
    of each may match before they tell the texts apart.
    """
    n, m = 0, min(len(a), len(b))
    while n < m and a[n] == b[n]:
        n += 1
    if n == m:
        return None
    if not a[n][1] and not b[n][1] and not a[n][0] & b[n][0]:
        return n, n
    seen: set[tuple[int, int]] = set()
    todo = [(n, n)]
    far_a = far_b = n
    while todo:
        i, j = todo.pop()
        if i == len(a) or j == len(b):
            return None
        if (i, j) in seen:
            continue
        seen.add((i, j))
        far_a, far_b = max(far_a, i), max(far_b, j)
        (ra, oa), (rb, ob) = a[i], b[j]
        if oa:
            todo.append((i + 1, j))
        if ob:
            todo.append((i, j + 1))
        if ra & rb:
            todo.append((i + 1, j + 1))
    return far_a, far_b


def _fixed_text(lead: _Lead) -> str:
    """The characters a lead starts with, while each is one fixed character."""
    out: list[str] = []
    for chars, optional in lead:
        if optional or chars & (chars - 1) or chars >> 128:  # not one ASCII character
            break
        out.append(chr(chars.bit_length() - 1))
    return "".join(out)


def _common_lead(leads: list[_Lead]) -> _Lead:
    n = min(map(len, leads))
    for lead in leads[1:]:
        k = 0
        while k < n and lead[k] == leads[0][k]:
            k += 1
        n = k
    return leads[0][:n]


@dataclass(frozen=True, slots=True)
class _Shape:
    """What the width analysis knows of one GBNF expression.

    Stack counts are upper bounds, capped: past the cap only "too many" matters.
    """

    nullable: bool = False
    first: Chars = 0  # characters a non-empty match may start with
    cont: Chars = 0  # characters that may come next inside it where it may also end
    chars: Chars = 0  # every character it may match
    lead: _Lead = ()  # what every match starts with
    whole: bool = False  # the lead is all of it
    enter: int = 0  # stacks opened on entering it
    lead_stacks: tuple[int, ...] = ()  # [k]: most stacks open within the first k lead items
    live: int = 0  # most stacks open inside it
    end: int = 0  # most stacks open inside it where it may end (what follows opens too)
    positions: int = 0  # its distinct stack positions (parses that entered at other offsets)
    value: bool = False  # every match is one JSON value (then maybe whitespace)
    branches: tuple[_Shape, ...] = ()  # its alternatives, through nested alternations


_EMPTY = _Shape(nullable=True, lead=(), whole=True, lead_stacks=(0,))


def _text_of(a: _Shape, b: _Shape) -> bool:
    """Whether two shapes match alike (all but the counts)."""
    return (a.nullable, a.first, a.cont, a.chars, a.lead, a.whole, a.value) == (
        b.nullable,
        b.first,
        b.cont,
        b.chars,
        b.lead,
        b.whole,
        b.value,
    ) and [(x.lead, x.first, x.value) for x in a.branches] == [
        (x.lead, x.first, x.value) for x in b.branches
    ]


def _no_counts(shape: _Shape) -> _Shape:
    return replace(
        shape,
        enter=0,
        lead_stacks=(0,) * (len(shape.lead) + 1),
        live=0,
        end=0,
        positions=0,
        branches=tuple(_no_counts(b) for b in shape.branches),
    )


def _stacks_within(shape: _Shape, k: int) -> int:
    """Most stacks ``shape`` holds within the first ``k`` items of its lead."""
    if not shape.lead_stacks:
        return max(shape.enter, shape.live)
    return shape.lead_stacks[min(k, len(shape.lead_stacks) - 1)]


class _WidthAnalysis:
    """Upper bounds on the parse stacks of the rules of a grammar (see the section note).

    Rules are solved parts first, and a rule is never narrower than a part of it,
    so the analysis stops at the first rule of ``named`` wider than ``limit``
    (``widest``): the innermost one. ``values``: rules known to match single JSON
    values (the converter's schema rules).

    Example::

        _WidthAnalysis(rules, limit=32, named={"root"}).widest  # None, or a rule name
    """

    def __init__(
        self,
        rules: dict[str, str],
        limit: int,
        *,
        named: set[str] | None = None,
        values: set[str] | None = None,
    ) -> None:
        self.cap = limit + 1  # every count stops there: past the limit, only "too many" matters
        self.values = _VALUE_PRIMITIVES | (values or set())
        self.rules = rules
        self.trees: dict[str, _Node] = {}  # parsed as reached
        self.refs: dict[str, list[str]] = {}  # the rules each one refers to
        self.shapes: dict[str, _Shape] = {}
        self._terminals: dict[_Node, _Shape] = {}
        self.widest: str | None = None
        for component in self._components():
            self._solve(component)
            for name in component:
                if (named is None or name in named) and self.width(name) > limit:
                    self.widest = name
                    return

    def width(self, rule: str) -> int:
        shape = self.shapes[rule]
        return max(shape.enter, shape.live)

    def reaches(self, start: str, rule: str) -> bool:
        """Whether ``rule`` is ``start`` or a part of it, at any depth."""
        seen = {start}
        todo = [start]
        while todo:
            name = todo.pop()
            if name == rule:
                return True
            self._tree(name)
            for ref in self.refs[name]:
                if ref not in seen:
                    seen.add(ref)
                    todo.append(ref)
        return False

    # -- rules: a fixed point over each strongly connected component ---------------------

    def _tree(self, name: str) -> _Node:
        tree = self.trees.get(name)
        if tree is None:
            if name not in self.rules:
                raise AssertionError(f"undefined GBNF rule {name}")
            tree = self.trees[name] = _parse_gbnf(self.rules[name])
            self.refs[name] = sorted(_refs(tree))
        return tree

    def _rule(self, name: str) -> _Shape:
        shape = self._shape(self._tree(name))
        if name in self.values:
            branches = tuple(replace(b, value=True) for b in shape.branches)
            shape = replace(shape, value=True, branches=branches)
        return shape

    def _solve(self, component: list[str]) -> None:
        if len(component) == 1 and component[0] not in self.refs[component[0]]:
            self.shapes[component[0]] = self._rule(component[0])
            return
        # Recursive rules: first what they match (nullable, characters, leads, branches),
        # which only grows from nothing; then, with that fixed, the counts from zero, so
        # they settle at the least bound (an early overcount could sustain itself).
        for name in component:
            self.shapes[name] = _Shape()
        for phase in (_text_of, _Shape.__eq__):
            for _ in range(4 * self.cap + 16):
                changed = False
                for name in component:
                    shape = self._rule(name)
                    if not phase(shape, self.shapes[name]):
                        self.shapes[name], changed = shape, True
                if not changed:
                    break
            else:  # no bound found: as wide as it gets
                for name in component:
                    self.shapes[name] = replace(self.shapes[name], live=self.cap)
                return
            if phase is _text_of:
                for name in component:
                    self.shapes[name] = _no_counts(self.shapes[name])

    def _components(self) -> Iterator[list[str]]:
        """Tarjan's strongly connected components, each after those it refers to."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        on_stack: set[str] = set()
        stack: list[str] = []
        for start in reversed(self.rules):  # the root last written: parts of it first
            if start in index:
                continue
            index[start] = low[start] = len(index)
            stack.append(start)
            on_stack.add(start)
            self._tree(start)
            work: list[tuple[str, list[str]]] = [(start, list(self.refs[start]))]
            while work:
                name, todo = work[-1]
                if todo:
                    ref = todo.pop()
                    if ref not in index:
                        index[ref] = low[ref] = len(index)
                        stack.append(ref)
                        on_stack.add(ref)
                        self._tree(ref)
                        work.append((ref, list(self.refs[ref])))
                    elif ref in on_stack:
                        low[name] = min(low[name], index[ref])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[name])
                if low[name] == index[name]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == name:
                            break
                    yield component

    # -- expressions --------------------------------------------------------------------

    def _shape(self, node: _Node) -> _Shape:
        kind = node[0]
        if kind == "ref":
            return self.shapes.get(node[1], _Shape())
        if kind == "seq":
            return self._seq([self._shape(item) for item in node[1]])
        if kind == "alt":
            return self._alt([self._shape(item) for item in node[1]])
        if kind == "rep":
            return self._repeat(self._shape(node[1]), node[2], node[3])
        shape = self._terminals.get(node)
        if shape is None:
            shape = self._terminals[node] = self._terminal(node)
        return shape

    def _terminal(self, node: _Node) -> _Shape:
        if node[0] == "lit":
            text: str = node[1]
            if not text:
                return _EMPTY
            bits = [_char_bit(ord(c)) for c in text]
            chars = 0
            for bit in set(bits):
                chars |= bit
            lead = tuple((bit, False) for bit in bits[:_LEAD_MAX])
            held = list(accumulate([_weight(bit) for bit in bits[: _LEAD_MAX + 1]] + [0], max))
            return _Shape(
                first=bits[0],
                chars=chars,
                lead=lead,
                whole=len(bits) <= _LEAD_MAX,
                enter=held[0],
                lead_stacks=tuple(held[: len(lead) + 1]),
                live=max((_weight(bit) for bit in bits[1:]), default=0),
                positions=min(len(text), self.cap),
            )
        w = _weight(node[1])
        return _Shape(
            first=node[1],
            chars=node[1],
            lead=((node[1], False),),
            whole=True,
            enter=w,
            lead_stacks=(w, w),
            positions=1,
        )

    def _seq(self, items: list[_Shape]) -> _Shape:
        if len(items) == 1:
            return items[0]
        cap, n = self.cap, len(items)
        # What opens on entering items[i:], and whether all of items[i:] may be empty.
        enter = [0] * (n + 1)
        first: list[Chars] = [0] * (n + 1)
        empty_after = [True] * (n + 1)
        for i in range(n - 1, -1, -1):
            x = items[i]
            enter[i] = min(cap, x.enter + (enter[i + 1] if x.nullable else 0))
            first[i] = x.first | first[i + 1] if x.nullable else x.first
            empty_after[i] = x.nullable and empty_after[i + 1]
        live = end = 0
        cont = chars = window = window_len = window_chars = 0
        for i, x in enumerate(items):
            chars |= x.chars
            # Parses in different items at once, where one may end but others go on with
            # a character the next items may start with: a window of items, each holding
            # a parse at any of its positions.
            going_on = window_chars if window_len > 1 else items[i - 1].cont if i else 0
            if window_len and going_on & first[i]:
                window = min(cap, window + max(x.positions, x.live))
                window_chars |= x.chars
                window_len += 1
            else:
                window, window_chars, window_len = x.live, x.chars, 1
            at_end = min(cap, x.end + enter[i + 1])
            live = max(live, x.live, at_end)
            if window_len > 1:
                at_end = max(at_end, min(cap, window + enter[i + 1]))
                live = max(live, at_end)
            if empty_after[i + 1]:
                end = max(end, at_end)
                cont |= x.cont | first[i + 1]
                if window_len > 1:
                    cont |= window_chars
        # The lead: the items' leads while each is all of its item.
        lead: _Lead = ()
        whole = True
        stacks = [enter[0]]
        for i, x in enumerate(items):
            if i:  # where the item before ends and this one opens
                stacks[-1] = max(stacks[-1], min(cap, items[i - 1].end + enter[i]))
            if len(x.lead_stacks) == len(x.lead) + 1:  # a running maximum, as stacks is
                base = stacks[-1]
                stacks += [max(base, s) for s in x.lead_stacks[1:]]
            else:
                for k in range(1, len(x.lead) + 1):
                    stacks.append(max(stacks[-1], _stacks_within(x, k)))
            lead = lead + x.lead
            if len(lead) > _LEAD_MAX:
                lead, whole = lead[:_LEAD_MAX], False
                break
            if not x.whole:
                whole = False
                break
        if not whole:
            while lead and lead[-1][1]:  # what may be absent at its end tells nothing
                lead = lead[:-1]
        return _Shape(
            nullable=empty_after[0],
            first=first[0],
            cont=cont,
            chars=chars,
            lead=lead,
            whole=whole,
            enter=enter[0],
            lead_stacks=tuple(stacks[: len(lead) + 1]),
            live=live,
            end=end,
            positions=min(cap, sum(x.positions for x in items)),
        )

    def _alt(self, items: list[_Shape]) -> _Shape:
        cap = self.cap
        branches: list[_Shape] = []
        for x in items:
            branches.extend(x.branches or (x,))
        if len(branches) == 1:
            return branches[0]
        if len(branches) > cap:  # more than the cap: as wide as it gets
            return self._saturated(branches[: cap + 1])
        matching = [b for b in branches if b.first]
        if len(matching) == 1:  # x | "": x?, as the chains of optional copies are
            return self._repeat(matching[0], 0, 1)
        # Branches that may stay open together past their leads: connected components
        # of "may start alike and their leads do not tell them apart".
        parent = list(range(len(branches)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def first_root(i: int) -> int:
            while first_parent[i] != i:
                first_parent[i] = first_parent[first_parent[i]]
                i = first_parent[i]
            return i

        first_parent = list(range(len(branches)))  # may start alike
        together_to = [0] * len(branches)  # lead items a branch may match beside another

        def pair(i: int, j: int) -> None:
            a, b = branches[i], branches[j]
            if not a.first & b.first:
                return
            if first_root(i) != first_root(j):
                first_parent[first_root(i)] = first_root(j)
            apart = _divergence(a.lead, b.lead)
            if apart is None:
                if root(i) != root(j):
                    parent[root(i)] = root(j)
            else:
                together_to[i] = max(together_to[i], apart[0])
                together_to[j] = max(together_to[j], apart[1])

        # Leads that start with fixed characters (names, enum values) are compared as
        # sorted text: a branch shares the longest start with a neighbour, and only
        # where one such start begins another do the whole leads need comparing.
        texts = [_fixed_text(b.lead) for b in branches]
        order = sorted((i for i, text in enumerate(texts) if text), key=texts.__getitem__)
        for pos, i in enumerate(order):
            text = texts[i]
            for j in order[pos + 1 :]:
                if not texts[j].startswith(text):
                    other, n = texts[j], 0
                    while text[n] == other[n]:  # (neither starts the other)
                        n += 1
                    together_to[i] = max(together_to[i], n)
                    together_to[j] = max(together_to[j], n)
                    if n and first_root(i) != first_root(j):
                        first_parent[first_root(i)] = first_root(j)
                    break
                pair(i, j)
        for i, text in enumerate(texts):
            if not text:
                for j in range(len(branches)):
                    if j != i and (texts[j] or j < i):
                        pair(i, j)
        groups: dict[int, list[_Shape]] = {}
        for i, b in enumerate(branches):
            groups.setdefault(root(i), []).append(b)
        # Branches that may start alike are open together until their leads tell them
        # apart (then each holds what it holds that far), or all along if they never do.
        enter = min(cap, sum(b.enter for b in branches))
        live = enter
        by_first: dict[int, list[int]] = {}
        for i, b in enumerate(branches):
            alone = len(groups[root(i)]) == 1
            held = _stacks_within(b, together_to[i]) if alone else max(b.enter, b.live)
            by_first.setdefault(first_root(i), []).append(held)
        for held_together in by_first.values():
            live = max(live, min(cap, sum(held_together)))
        end = 0
        cont = chars = first = 0
        for group in groups.values():
            for b in group:
                cont |= b.cont
                chars |= b.chars
                first |= b.first
            if len(group) == 1:
                live, end = max(live, group[0].live), max(end, group[0].end)
                continue
            together = min(cap, sum(b.live for b in group))
            live, end = max(live, together), max(end, together)
            # Where one branch may end, others may be anywhere inside theirs. Not so for
            # JSON values other than numbers: a complete value starts no longer one.
            values = all(b.value for b in group)
            for b in group:
                if not values or b.first & _NUMBER_START:
                    cont |= b.chars
        lead = _common_lead([b.lead for b in branches])
        lead_stacks = tuple(
            min(cap, sum(_stacks_within(b, k) for b in branches)) for k in range(len(lead) + 1)
        )
        return _Shape(
            nullable=any(b.nullable for b in branches),
            first=first,
            cont=cont,
            chars=chars,
            lead=lead,
            enter=enter,
            lead_stacks=lead_stacks,
            live=live,
            end=end,
            positions=min(cap, sum(b.positions for b in branches)),
            value=all(b.value for b in branches),
            branches=tuple(branches),
        )

    def _saturated(self, branches: list[_Shape]) -> _Shape:
        first = chars = 0
        for b in branches:
            first, chars = first | b.first, chars | b.chars
        cap = self.cap
        return _Shape(
            nullable=any(b.nullable for b in branches),
            first=first,
            cont=chars,
            chars=chars,
            enter=min(cap, sum(b.enter for b in branches)),
            live=cap,
            end=cap,
            positions=cap,
            branches=tuple(branches),
        )

    def _repeat(self, x: _Shape, lo: int, hi: int | None) -> _Shape:
        if hi == 0:
            return _EMPTY
        if lo == hi == 1:
            return x
        if lo > 1 or (hi is not None and hi > 1):
            # llama.cpp writes x{m,n} as m copies, then nested optional ones.
            tail = self._repeat(x, 0, None) if hi is None else None
            for _ in range((hi or lo) - lo):
                tail = self._repeat(x if tail is None else self._seq([x, tail]), 0, 1)
            return self._seq([x] * lo + ([tail] if tail is not None else []))
        cont = x.cont | x.first
        if hi == 1:  # x?
            single = x.whole and x.lead is not None and len(x.lead) == 1 and not x.nullable
            lead: _Lead = ((x.lead[0][0], True),) if single and x.lead is not None else ()
            return replace(
                x,
                nullable=True,
                cont=cont,
                lead=lead,
                whole=single,
                lead_stacks=(x.enter, x.enter) if single else (x.enter,),
                value=False,
                branches=(),
            )
        cap = self.cap
        if x.nullable or x.cont & x.first:
            # A new copy may start where the last one may also go on: copies open at once.
            live = end = min(cap, max(x.live, x.positions) + x.enter)
        else:
            end = min(cap, x.end + x.enter)
            live = max(x.live, end)
        return replace(
            x,
            nullable=x.nullable or lo == 0,
            cont=cont,
            lead=x.lead if lo else (),
            whole=False,
            lead_stacks=x.lead_stacks if lo else (x.enter,),
            live=live,
            end=end,
            positions=min(cap, x.positions * (lo + 1)),
            value=False,
            branches=(),
        )


# -- the converter ---------------------------------------------------------------------


@functools.cache
def _converter_class() -> Any:
    lg: Any = importlib.import_module("llama_cpp.llama_grammar")

    class Converter(lg.SchemaConverter):  # type: ignore[misc]
        """llama.cpp's converter with bounded repetitions, safe literals and integer bounds."""

        def __init__(
            self, max_repeat: int, max_output_chars: int | None, max_alternatives: int | None
        ) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
            self.max_repeat = max_repeat
            self.max_output_chars = max_output_chars
            self.max_alternatives = max_alternatives
            self.paths: dict[str, str] = {}  # rule -> the schema path it was written for
            self.values: set[str] = set()  # rules of schemas: each matches one JSON value
            self.used = 0  # repetition rules written so far
            self._keys: dict[tuple[str, str], str] = {(k, v): k for k, v in self._rules.items()}
            self._next_suffix: dict[str, int] = {}
            self._chains: dict[tuple[str, bool], list[str]] = {}
            self._ref_rules: dict[str, str] = {}

        # -- rules ------------------------------------------------------------------

        def _add_rule(self, name: str, rule: str) -> str:
            # The port's collision scan is quadratic in rules of one name; same result.
            esc = lg.INVALID_RULE_CHARS_RE.sub("-", name)
            key = self._keys.get((esc, rule))
            if key is not None:
                return key
            if esc in self._rules:
                i = self._next_suffix.get(esc, 0)
                while f"{esc}{i}" in self._rules:
                    i += 1
                self._next_suffix[esc] = i + 1
                esc_key = f"{esc}{i}"
            else:
                esc_key = esc
            self._rules[esc_key] = rule
            self._keys[(esc, rule)] = esc_key
            return esc_key

        def _format_literal(self, literal: str) -> str:
            # The port leaves backslashes unescaped: a property name could end the literal.
            return gbnf_literal(literal)

        def _literal_trie(
            self, name: str, entries: list[tuple[str, str]], *, split_start: bool = True
        ) -> str:
            """Alternatives ``text tail`` for each (text, GBNF tail), sharing their prefixes.

            Written one after another, texts with a common start (``"value1"``,
            ``"value2"``...) each hold a parse stack until they differ, and every
            stack costs a pass over the vocabulary per token; as a trie they hold
            one per distinct next character, and characters followed alike share
            a class. Returns the root's alternatives. ``split_start=False`` writes
            the start all texts share into each first branch (``"\"f\"" | "\"g\""``).
            """
            items = sorted(set(entries))
            texts = [text for text, _ in items]
            nodes: list[list[tuple[str, str, int | None]]] = []  # (edge, tail, child node)
            todo: list[tuple[int, int, int]] = []  # (first item, end, depth) per node

            def node(lo: int, hi: int, depth: int) -> int:
                nodes.append([])
                todo.append((lo, hi, depth))
                return len(nodes) - 1

            node(0, len(items), 0)
            done = 0
            while done < len(todo):
                lo, hi, depth = todo[done]
                alts = nodes[done]
                done += 1
                i = lo
                while i < hi and len(texts[i]) == depth:  # texts ending here sort first
                    alts.append(("", items[i][1], None))
                    i += 1
                while i < hi:
                    j = i + 1
                    while j < hi and texts[j][depth] == texts[i][depth]:
                        j += 1
                    if j - i == 1:
                        alts.append((texts[i][depth:], items[i][1], None))
                    else:
                        stop = len(os.path.commonprefix([texts[i], texts[j - 1]]))
                        alts.append((texts[i][depth:stop], "", node(i, j, stop)))
                    i = j
            rules: dict[int, str] = {}

            def body(k: int, prefix: str) -> str:
                lead = gbnf_literal(prefix) if prefix else ""
                alts = [" ".join(filter(None, [lead, t])) or '""' for e, t, _ in nodes[k] if not e]
                # Edges that go on alike (same rest, same subtree: the digits of "1".."99")
                # become one character class: one stack, not one per character.
                heads: dict[tuple[str, str, str], list[int]] = {}
                for edge, tail, child in nodes[k]:
                    if edge:
                        after = (edge[1:], tail, rules[child] if child is not None else "")
                        heads.setdefault(after, []).append(ord(edge[0]))
                for (rest, tail, child_rule), firsts in heads.items():
                    if len(firsts) == 1:
                        head = gbnf_literal(prefix + chr(firsts[0]) + rest)
                    else:
                        spec = "".join(
                            _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                            for lo, hi in _merge([(c, c) for c in firsts])
                        )
                        head = " ".join(
                            filter(None, [lead, f"[{spec}]", gbnf_literal(rest) if rest else ""])
                        )
                    alts.append(" ".join(filter(None, [head, tail, child_rule])))
                return " | ".join(alts)

            start = nodes[0][0] if len(nodes[0]) == 1 else ("", "", None)
            lifted = start[2] if not split_start and not start[1] else None
            for k in range(len(nodes) - 1, 0, -1):  # children first
                if k != lifted:
                    rules[k] = str(self._add_rule(f"{name}-trie", body(k, "")))
                    self.paths.setdefault(rules[k], name)
            return body(lifted, start[0]) if lifted is not None else body(0, "")

        def resolve_refs(self, schema: Any, url: str) -> Any:
            # Every local $ref, at any depth (the port skips what lies beside a $ref,
            # and would fetch remote ones if allowed); ``url`` keeps tools apart.
            def walk(node: Any) -> None:
                if isinstance(node, list):
                    for x in node:
                        walk(x)
                elif isinstance(node, dict):
                    ref = node.get("$ref")
                    if isinstance(ref, str):
                        if not ref.startswith("#"):
                            raise _SchemaProblem("only local $refs ('#/...') are supported")
                        node["$ref"] = f"{url}{ref}"
                        self._refs.setdefault(f"{url}{ref}", _pointer(schema, ref))
                    for value in node.values():
                        walk(value)

            walk(schema)
            return schema

        def _resolve_ref(self, ref: Any) -> str:
            # The port returns a recursive ref's raw last segment as GBNF text.
            key = self._ref_rules.get(ref)
            if key is not None:
                return key
            if not isinstance(ref, str) or ref not in self._refs:
                raise _SchemaProblem(f"unresolved $ref {_clip(repr(ref))}")
            base = ref.split("/")[-1][:40] or "ref"
            base = base + "-" if base in lg.RESERVED_NAMES else base
            key = self._add_rule(base, f"\0{ref}")  # a placeholder until the target is built
            self._ref_rules[ref] = key
            target = self.visit(self._refs[ref], f"{base}-def")
            self._rules[key] = target
            return key

        # -- repetitions --------------------------------------------------------------

        def _repeat(self, item: str, lo: int, hi: int | None, *, sep: str = "", what: str) -> str:
            """``lo`` to ``hi`` (None: any number of) copies of the atom ``item``, ``sep`` between.

            ``item`` must not match the empty string. Copies are chains of shared
            rules (``r-x3 ::= r r-x2``), each new link charged to the budget.
            """
            if hi is not None and self.max_output_chars is not None and hi > self.max_output_chars:
                hi = None  # each copy is at least one character: never reached
            if sep:
                if hi == 0:
                    return ""
                unit = self._unit(f"{sep} {item}")
                first = _atomic(item)
                more = None if hi is None else hi - 1  # copies after the first
                if lo >= 1:
                    return " ".join(filter(None, [first, self._tail(unit, lo - 1, more, what)]))
                rest = self._tail(unit, 0, more, what)
                return f"({first} {rest})?" if rest else f"{first}?"
            return self._tail(self._unit(item), lo, hi, what)

        def _unit(self, text: str) -> str:
            if re.fullmatch(r"[A-Za-z0-9-]{1,32}", text):
                return text
            return str(self._add_rule("rep", text))

        def _tail(self, unit: str, lo: int, hi: int | None, what: str) -> str:
            n_opt = 0 if hi is None else hi - lo
            exact = self._chains.get((unit, False), [])
            opt = self._chains.get((unit, True), [])
            new = max(0, lo - len(exact)) + max(0, n_opt - len(opt))
            if new:
                self.used += new
                if self.used > self.max_repeat:
                    more = f" ({self.used:,} in all)" if self.used != new else ""
                    raise _OverBudget(
                        f"{what} needs {new:,} grammar repetitions{more}; "
                        f"the limit is {self.max_repeat} ({REPEAT_SETTING})"
                    )
            parts = [self._chain(unit, lo, optional=False) if lo else ""]
            if hi is None:
                parts.append(f"{unit}*")
            elif n_opt:
                parts.append(self._chain(unit, n_opt, optional=True))
            return " ".join(p for p in parts if p)

        def _chain(self, unit: str, n: int, *, optional: bool) -> str:
            """The rule for exactly (or at most) ``n`` copies of ``unit``; links shared."""
            links = self._chains.setdefault((unit, optional), [])
            suffix = "o" if optional else "x"
            while len(links) < n:
                body = f"{unit} {links[-1]}" if links else unit
                links.append(
                    self._add_rule(
                        f"{unit}-{suffix}{len(links) + 1}", f'{body} | ""' if optional else body
                    )
                )
            return links[n - 1]

        # -- schemas ------------------------------------------------------------------

        def visit(self, schema: Any, name: str) -> str:
            rule = self._visit_schema(schema, name)
            self.paths.setdefault(rule, name)
            self.values.add(rule)
            return rule

        def _visit_schema(self, schema: Any, name: str) -> str:
            """The port's dispatch, in its order, with its repetitions bounded."""
            if not isinstance(schema, dict):
                raise _SchemaProblem(f"a schema must be an object, not {type(schema).__name__}")
            kind = schema.get("type")
            fmt = schema.get("format")
            rule_name = name + "-" if name in lg.RESERVED_NAMES else name or "root"
            if schema.get("$ref") is not None:
                return str(self._add_rule(rule_name, self._resolve_ref(schema["$ref"])))
            if "oneOf" in schema or "anyOf" in schema:
                alts = schema.get("oneOf") or schema.get("anyOf")
                if not isinstance(alts, list) or not alts:
                    raise _SchemaProblem("'anyOf' and 'oneOf' must be non-empty arrays")
                return str(self._add_rule(rule_name, self._generate_union_rule(name, alts)))
            if isinstance(kind, list):
                if not kind:
                    raise _SchemaProblem("'type' must not be an empty array")
                alts = [{"type": t} for t in kind]
                return str(self._add_rule(rule_name, self._generate_union_rule(name, alts)))
            if "const" in schema:
                return str(self._add_rule(rule_name, self._generate_constant_rule(schema["const"])))
            if "enum" in schema:
                values = schema["enum"]
                if not isinstance(values, list) or not values:
                    raise _SchemaProblem("'enum' must be a non-empty array")
                trie = self._literal_trie(rule_name, [(json.dumps(v), "") for v in values])
                return str(self._add_rule(rule_name, trie))
            if kind is not None and not isinstance(kind, str):
                raise _SchemaProblem("'type' must be a string or an array of strings")
            if kind in (None, "object") and (
                "properties" in schema
                or ("additionalProperties" in schema and schema["additionalProperties"] is not True)
            ):
                props = schema.get("properties", {})
                required = schema.get("required", [])
                if not isinstance(props, dict):
                    raise _SchemaProblem("'properties' must be an object")
                if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                    raise _SchemaProblem("'required' must be an array of strings")
                extra = schema.get("additionalProperties")
                body = self._build_object_rule(list(props.items()), set(required), name, extra)
                return str(self._add_rule(rule_name, body))
            if kind in (None, "object") and "allOf" in schema:
                parts = schema["allOf"]
                if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                    raise _SchemaProblem("'allOf' must be an array of schemas")
                return str(super().visit(schema, name))
            if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
                return self._visit_array(schema, name, rule_name)
            if kind in (None, "string") and "pattern" in schema:
                return str(self._visit_pattern(schema["pattern"], rule_name))
            if (
                kind in (None, "string")
                and isinstance(fmt, str)
                and (re.match(r"^uuid[1-5]?$", fmt) or f"{fmt}-string" in lg.STRING_FORMAT_RULES)
            ):
                return str(super().visit(schema, name))
            if kind == "string" and ("minLength" in schema or "maxLength" in schema):
                lo, hi = _count(schema, "minLength") or 0, _count(schema, "maxLength")
                if hi is not None and hi < lo:
                    raise _SchemaProblem("'maxLength' is less than 'minLength'")
                char = self._add_primitive("char", lg.PRIMITIVE_RULES["char"])
                what = _what(schema, "minLength", "maxLength")
                rep = self._repeat(char, lo, hi, what=what)
                body = " ".join(filter(None, ['"\\""', rep, '"\\"" space']))
                return str(self._add_rule(rule_name, body))
            if kind == "integer":
                rule = _integer_rule(schema)
                if rule is not None:
                    return str(self._add_rule(rule_name, f"({rule}) space"))
            if kind == "object" or len(schema) == 0:
                return str(super().visit(schema, name))
            if kind not in lg.PRIMITIVE_RULES:
                raise _SchemaProblem(f"unsupported schema at '{_clip(name)}' (type {kind!r})")
            return str(super().visit(schema, name))

        def _visit_array(self, schema: dict[str, Any], name: str, rule_name: str) -> str:
            items = schema.get("items")
            if not items and "prefixItems" in schema:
                items = schema["prefixItems"]
            sub = f"{name}{'-' if name else ''}"
            if isinstance(items, list):
                tuple_rules = [self.visit(item, f"{sub}tuple-{i}") for i, item in enumerate(items)]
                body = '"[" space ' + ' "," space '.join(tuple_rules) + ' "]" space'
                return str(self._add_rule(rule_name, body))
            item_rule = self.visit(items, f"{sub}item")
            lo, hi = _count(schema, "minItems") or 0, _count(schema, "maxItems")
            if hi is not None and hi < lo:
                raise _SchemaProblem("'maxItems' is less than 'minItems'")
            what = _what(schema, "minItems", "maxItems")
            rep = self._repeat(item_rule, lo, hi, sep='"," space', what=what)
            return str(
                self._add_rule(rule_name, " ".join(filter(None, ['"[" space', rep, '"]" space'])))
            )

        def _visit_pattern(self, pattern: Any, name: str) -> str:
            if not isinstance(pattern, str):
                raise _SchemaProblem("'pattern' must be a string")
            expr = _Pattern(self, pattern).translate()
            return str(self._add_rule(name, f'"\\"" ({expr}) "\\"" space'))

        def _build_object_rule(
            self,
            properties: list[tuple[str, Any]],
            required: set[str],
            name: str,
            additional_properties: Any,
        ) -> str:
            # The upstream rule shape, built in linear time (the port recurses once per
            # optional property from every optional property, and omits the comma
            # before additional properties).
            sub = f"{name}{'-' if name else ''}"
            kv: dict[str, str] = {}
            for prop_name, prop_schema in properties:
                value = self.visit(prop_schema, f"{sub}{prop_name}")
                kv[prop_name] = self._add_rule(
                    f"{sub}{prop_name}-kv",
                    f'{self._format_literal(json.dumps(prop_name))} space ":" space {value}',
                )
            required_props = [k for k, _ in properties if k in required]
            # (rule name, kv rule, is the additional-properties entry)
            optional = [(k, kv[k], False) for k, _ in properties if k not in required]
            if additional_properties is True or isinstance(additional_properties, dict):
                value = self.visit(
                    {} if additional_properties is True else additional_properties,
                    f"{sub}additional-value",
                )
                string = self._add_primitive("string", lg.PRIMITIVE_RULES["string"])
                extra = self._add_rule(f"{sub}additional-kv", f'{string} ":" space {value}')
                optional.append(("additional", extra, True))

            # pick[j]: one of the optional properties from j on, then maybe (after a
            # comma) more from the next one on. Each choice sits after one shared comma,
            # and its alternatives differ by name right away: llama.cpp keeps one parse
            # stack per property name still possible (upstream kept two per property).
            pick = ""
            for j in range(len(optional) - 1, -1, -1):
                key, kv_rule, many = optional[j]
                if many:  # additional properties: always the last entry, any number of them
                    body = f'{kv_rule} ( "," space {kv_rule} )*'
                else:
                    body = f'{kv_rule} ( "," space {pick} )?' if pick else kv_rule
                    body = f"{body} | {pick}" if pick else body
                pick = self._add_rule(f"{sub}{key}-pick", body)
                self.paths.setdefault(pick, name)
            rule = '"{" space ' + ' "," space '.join(kv[k] for k in required_props)
            if pick:
                rule += f' ( "," space {pick} )?' if required_props else f" {pick}?"
            return rule + ' "}" space'

        def format_grammar(self) -> str:
            # This port lets raw control characters into strings, which is not JSON
            # (json.loads rejects them); llama.cpp's current converter excludes them.
            if self._rules.get("char") == lg.PRIMITIVE_RULES["char"].content:
                self._rules["char"] = (
                    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
                )
            return "\n".join(f"{k} ::= {v}" for k, v in sorted(self._rules.items()))

    return Converter


def _pointer(schema: Any, ref: str) -> Any:
    """The part of ``schema`` a local ``$ref`` (``#/$defs/x``) points at."""
    target = schema
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise _SchemaProblem(f"$ref {_clip(repr(ref))} points at nothing")
    return target


def _what(schema: dict[str, Any], lo_key: str, hi_key: str) -> str:
    keys = [f"{k} {schema[k]}" for k in (lo_key, hi_key) if schema.get(k) is not None]
    return " and ".join(keys) or lo_key


def _converter(max_repeat: int, max_output_chars: int | None, max_alternatives: int | None) -> Any:
    return _converter_class()(max_repeat, max_output_chars, max_alternatives)


def _visit(conv: Any, schema: Any, name: str, param: str) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"The JSON schema in '{param}' must be an object.", param=param)
    try:
        resolved = conv.resolve_refs(json.loads(json.dumps(schema)), name)
        return str(conv.visit(resolved, name))
    except InvalidRequest as exc:
        if exc.param is not None:
            raise
        # e.g. an empty integer range: name the field the schema came from.
        message = f"Invalid JSON schema in '{param}': {exc.message}"
        raise InvalidRequest(message, param=param) from exc
    except _OverBudget as exc:
        message = f"The JSON schema in '{param}' is too large to constrain decoding: {exc}."
        raise InvalidRequest(message, param=param) from exc
    except _SchemaProblem as exc:
        raise InvalidRequest(f"Invalid JSON schema in '{param}': {exc}.", param=param) from exc
    except MemoryError:
        raise
    except Exception as exc:  # the port's own failures on odd input: schema input is user input
        reason = _clip(f"{type(exc).__name__}: {exc}", 200)
        raise InvalidRequest(f"Invalid JSON schema in '{param}': {reason}", param=param) from exc


_EXPLICIT_REPEAT = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{([0-9]+)(?:,([0-9]*))?\}')
_MAX_EXPLICIT_REPEAT = 64  # llama.cpp expands x{m,n} into n rules; ours are all tiny


def _set_root(conv: Any, rule: str) -> None:
    if conv._add_rule("root", rule) != "root":  # no schema names a rule "root"
        raise AssertionError("the grammar's root rule was taken")


def _finish(conv: Any, param: str) -> str:
    """The grammar text, checked to hold no ``{m,n}`` that llama.cpp would expand widely."""
    text = str(conv.format_grammar())
    for m in _EXPLICIT_REPEAT.finditer(text):
        if m[1] is not None and max(int(m[1]), int(m[2] or 0)) > _MAX_EXPLICIT_REPEAT:
            raise InvalidRequest(f"The constraint grammar for '{param}' is too large.", param=param)
    return text


def _check_widths(conv: Any, checks: list[tuple[str, str, str | None]]) -> None:
    """A 400 naming the field when a rule may hold more parse stacks than allowed.

    ``checks``: (rule, request field, the schema path its rules were named under).
    """
    limit = conv.max_alternatives
    if limit is None:
        return
    named = set(conv.paths) | {rule for rule, _, _ in checks}
    try:
        analysis = _WidthAnalysis(conv._rules, limit, named=named, values=conv.values)
    except (RecursionError, AssertionError) as exc:  # nested past Python's stack: unchecked
        param = checks[-1][1]
        message = f"The constraint grammar for '{param}' is too deeply nested to check its width."
        raise InvalidRequest(message, param=param) from exc
    widest = analysis.widest
    if widest is None:
        return
    # The field: the first check whose rule reaches it (the last one reaches everything).
    param, top = checks[-1][1], checks[-1][2]
    for rule, field, rule_top in checks:
        if analysis.reaches(rule, widest):
            param, top = field, rule_top
            break
    path = conv.paths.get(widest)
    where = ""
    if path is not None and top is not None and path != top:
        where = f" at '{_clip(path[len(top) + 1 :] if path.startswith(f'{top}-') else path)}'"
    what = (
        "The tools of this request are" if param == "tools" else f"The JSON schema in '{param}' is"
    )
    raise InvalidRequest(
        f"{what} too wide to constrain decoding{where}: more than {limit} grammar "
        "alternatives (enum values, anyOf/oneOf branches, optional properties, pattern "
        "alternatives, tools) may be open at one point of the output, and each costs every "
        f"token a pass over the vocabulary; the limit is {limit} ({ALTERNATIVES_SETTING})",
        param=param,
    )


def json_schema_grammar(
    schema: dict[str, Any],
    *,
    param: str = "response_format",
    max_repeat: int = DEFAULT_MAX_REPEAT,
    max_output_chars: int | None = None,
    max_alternatives: int | None = None,
) -> str:
    """A grammar whose sentences are exactly the JSON documents valid for ``schema``.

    ``max_repeat`` bounds the repetition rules the grammar may hold;
    ``max_output_chars`` (when known) is the longest output the request can
    produce, beyond which a maximum is not worth spelling out;
    ``max_alternatives`` (None: unchecked) bounds the parse stacks the grammar
    may hold at one point (its width, what sampling a token costs).
    """
    conv = _converter(max_repeat, max_output_chars, max_alternatives)
    _set_root(conv, _visit(conv, schema, "schema", param))
    text = _finish(conv, param)
    _check_widths(conv, [("root", param, "schema")])
    return text


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(
    tools: list[ToolSpec],
    framing: CallFraming,
    *,
    max_calls: int,
    max_repeat: int = DEFAULT_MAX_REPEAT,
    max_output_chars: int | None = None,
    max_alternatives: int | None = None,
) -> str:
    """Output that is one to ``max_calls`` calls of the given tools, arguments per schema.

    The tools share one repetition budget (``max_repeat``): it bounds the grammar.
    ``max_alternatives`` bounds the width of each tool's arguments (a 400 naming
    its field) and of the whole grammar (naming ``tools``).
    """
    if not tools:
        raise InvalidRequest("No tools to call.", param="tools")
    conv = _converter(max_repeat, max_output_chars, max_alternatives)
    lit = conv._format_literal
    # Every call starts alike up to the tool's name, so the calls share that start
    # and branch on the name (a trie): the tools are not each a parse stack.
    names: list[tuple[str, str]] = []
    checks: list[tuple[str, str, str | None]] = []  # widths to check: see _check_widths
    for i, tool in enumerate(tools):
        args = _visit(conv, tool.parameters or {"type": "object"}, f"tool-{i}-args", tool.param)
        parts = ["space", lit(","), "space", lit(json.dumps(framing.args_key)), "space"]
        parts += [lit(":"), "space", args, lit("}")]
        if framing.call_close:
            parts.append(lit(framing.call_close))
        rest = conv._add_rule(f"tool-{i}-call", " ".join(parts))
        checks.append((rest, tool.param, f"tool-{i}-args"))
        names.append((json.dumps(tool.name), rest))
    head = [lit(framing.call_open)] if framing.call_open else []
    head += [lit("{"), "space", lit(json.dumps(framing.name_key)), "space", lit(":"), "space"]
    trie = conv._literal_trie("call-name", names, split_start=False)
    call = conv._add_rule("call", f"{' '.join(head)} ( {trie} )")
    more = f"({lit(framing.sep)} {call}){{0,{max_calls - 1}}}" if max_calls > 1 else ""
    root = " ".join(
        p
        for p in (
            lit(framing.prefix) if framing.prefix else "",
            call,
            more,
            lit(framing.suffix) if framing.suffix else "",
        )
        if p
    )
    _set_root(conv, root)
    text = _finish(conv, "tools")
    _check_widths(conv, [*checks, ("root", "tools", None)])
    return text
