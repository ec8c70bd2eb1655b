"""Regex patterns, literals and character classes as GBNF inside a JSON string."""

from __future__ import annotations

import json
import re
from typing import Any

from sluice.grammar.spec import (
    _clip,
    _SchemaProblem,
)

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
