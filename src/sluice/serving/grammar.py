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

Any failure on a schema is an :class:`InvalidRequest` naming the request field.

Example::

    hermes = CallFraming(call_open="<tool_call>", call_close="</tool_call>")
    g = tool_call_grammar([ToolSpec("get_weather", schema)], hermes, max_calls=1)
    g = json_schema_grammar(schema, param="response_format.json_schema.schema",
                            max_repeat=4096, max_output_chars=n_ctx * longest_piece)
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from sluice.errors import InvalidRequest

DEFAULT_MAX_REPEAT = 4096
REPEAT_SETTING = "--max-grammar-repeat"


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
        neg_hi = -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        alts += [f'"-" {p}' for p in _natural_range(neg_lo, neg_hi)]
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


# -- the converter ---------------------------------------------------------------------


@functools.cache
def _converter_class() -> Any:
    lg: Any = importlib.import_module("llama_cpp.llama_grammar")

    class Converter(lg.SchemaConverter):  # type: ignore[misc]
        """llama.cpp's converter with bounded repetitions, safe literals and integer bounds."""

        def __init__(self, max_repeat: int, max_output_chars: int | None) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
            self.max_repeat = max_repeat
            self.max_output_chars = max_output_chars
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
                return str(
                    self._add_rule(
                        rule_name, " | ".join(self._generate_constant_rule(v) for v in values)
                    )
                )
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

            def first(kv_rule: str, many: bool) -> str:
                return f'{kv_rule} ( "," space {kv_rule} )*' if many else kv_rule

            def later(kv_rule: str, many: bool) -> str:
                return f'( "," space {kv_rule} )' + ("*" if many else "?")

            # rest[j]: the optional properties from j on, each after a comma, each optional.
            rest: list[str] = [""] * (len(optional) + 1)
            for j in range(len(optional) - 1, 0, -1):
                _, kv_rule, many = optional[j]
                body = " ".join(filter(None, [later(kv_rule, many), rest[j + 1]]))
                rest[j] = self._add_rule(f"{sub}{optional[j - 1][0]}-rest", body)
            rule = '"{" space ' + ' "," space '.join(kv[k] for k in required_props)
            if optional:
                alts = [
                    " ".join(filter(None, [first(kv_rule, many), rest[i + 1]]))
                    for i, (_, kv_rule, many) in enumerate(optional)
                ]
                inner = " | ".join(alts)
                rule += f' ( "," space ( {inner} ) )?' if required_props else f" ( {inner} )?"
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


def _converter(max_repeat: int, max_output_chars: int | None) -> Any:
    return _converter_class()(max_repeat, max_output_chars)


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


def json_schema_grammar(
    schema: dict[str, Any],
    *,
    param: str = "response_format",
    max_repeat: int = DEFAULT_MAX_REPEAT,
    max_output_chars: int | None = None,
) -> str:
    """A grammar whose sentences are exactly the JSON documents valid for ``schema``.

    ``max_repeat`` bounds the repetition rules the grammar may hold;
    ``max_output_chars`` (when known) is the longest output the request can
    produce, beyond which a maximum is not worth spelling out.
    """
    conv = _converter(max_repeat, max_output_chars)
    _set_root(conv, _visit(conv, schema, "schema", param))
    return _finish(conv, param)


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
) -> str:
    """Output that is one to ``max_calls`` calls of the given tools, arguments per schema.

    The tools share one repetition budget (``max_repeat``): it bounds the grammar.
    """
    if not tools:
        raise InvalidRequest("No tools to call.", param="tools")
    conv = _converter(max_repeat, max_output_chars)
    lit = conv._format_literal
    calls = []
    for i, tool in enumerate(tools):
        args = _visit(conv, tool.parameters or {"type": "object"}, f"tool-{i}-args", tool.param)
        body = " ".join(
            [
                lit("{"),
                "space",
                lit(json.dumps(framing.name_key)),
                "space",
                lit(":"),
                "space",
                lit(json.dumps(tool.name)),
                "space",
                lit(","),
                "space",
                lit(json.dumps(framing.args_key)),
                "space",
                lit(":"),
                "space",
                args,
                lit("}"),
            ]
        )
        parts = [
            p
            for p in (
                lit(framing.call_open) if framing.call_open else "",
                body,
                lit(framing.call_close) if framing.call_close else "",
            )
            if p
        ]
        calls.append(conv._add_rule(f"tool-{i}-call", " ".join(parts)))
    call = conv._add_rule("call", " | ".join(calls))
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
    return _finish(conv, "tools")
