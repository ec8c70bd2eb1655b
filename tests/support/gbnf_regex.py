"""GBNF as sluice writes it, read back: tokens, and a Python regex for non-recursive grammars.

Test-only. The regex inlines every rule reference, so it exists only for
grammars without recursion (a JSON schema without ``$ref`` cycles and
without the recursive ``value``/``object`` primitives), and only for small
bounds (each link of a repetition chain is one nested group).

Example::

    rx = grammar_regex(json_schema_grammar({"type": "string", "maxLength": 3}))
    assert rx.fullmatch('"abc"') and not rx.fullmatch('"abcd"')
"""

from __future__ import annotations

import re

TOKEN = re.compile(
    r"""\s*(?:
    (?P<lit>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<name>[A-Za-z0-9-]+)
  | (?P<rep>\{[0-9]+(?:,[0-9]*)?\})
  | (?P<op>[()|*+?.])
)""",
    re.VERBOSE,
)
_SIMPLE = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}


def rules(grammar: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in grammar.splitlines():
        name, sep, body = line.partition(" ::= ")
        assert sep, f"not a rule line: {line!r}"
        assert name not in out, f"rule {name} defined twice"
        out[name] = body
    return out


def tokens(body: str) -> list[tuple[str, str]]:
    """(kind, text) for each token of a rule body; AssertionError on anything else."""
    out: list[tuple[str, str]] = []
    pos = 0
    body = body.rstrip()
    while pos < len(body):
        m = TOKEN.match(body, pos)
        assert m and m.end() > pos, f"bad GBNF at {body[pos : pos + 40]!r}"
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m[kind]))
        pos = m.end()
    return out


def _chars(text: str) -> list[int]:
    """Code points of the inside of a GBNF literal or class, escapes decoded."""
    out: list[int] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out.append(ord(c))
            i += 1
            continue
        e = text[i + 1]
        if e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            out.append(int(text[i + 2 : i + 2 + n], 16))
            i += 2 + n
        else:
            assert e in _SIMPLE, f"unknown escape \\{e}"
            out.append(ord(_SIMPLE[e]))
            i += 2
    return out


def _class_regex(text: str) -> str:
    inner = text[1:-1]
    negated = inner.startswith("^")
    if negated:
        inner = inner[1:]
    # Ranges: a '-' between two members (escaped '-' is \x2D or \-, a member).
    raw = re.findall(r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|.", inner)
    parts: list[str] = []
    i = 0
    while i < len(raw):
        lo = _chars(raw[i])[0]
        if i + 2 < len(raw) and raw[i + 1] == "-":
            hi = _chars(raw[i + 2])[0]
            parts.append(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}")
            i += 3
        else:
            parts.append(re.escape(chr(lo)))
            i += 1
    return f"[{'^' if negated else ''}{''.join(parts)}]"


def grammar_regex(grammar: str, root: str = "root") -> re.Pattern[str]:
    table = rules(grammar)
    done: dict[str, str] = {}

    def rule(name: str, stack: tuple[str, ...]) -> str:
        if name in done:
            return done[name]
        assert name in table, f"undefined rule {name}"
        assert name not in stack, f"recursive rule {name}: no regex"
        parts: list[str] = []
        for kind, text in tokens(table[name]):
            if kind == "lit":
                # One symbol: a postfix operator applies to all of it.
                parts.append(f"(?:{re.escape(''.join(chr(c) for c in _chars(text[1:-1])))})")
            elif kind == "cls":
                parts.append(_class_regex(text))
            elif kind == "name":
                parts.append(f"(?:{rule(text, (*stack, name))})")
            elif kind == "op" and text == ".":
                parts.append("(?s:.)")
            elif kind == "op" and text == "(":
                parts.append("(?:")
            else:
                parts.append(text)
        done[name] = "".join(parts)
        return done[name]

    return re.compile(rule(root, ()), re.DOTALL)


def explicit_repeats(grammar: str) -> list[tuple[int, int | None]]:
    """Every ``{m,n}`` outside literals and classes (what llama.cpp expands)."""
    out: list[tuple[int, int | None]] = []
    for body in rules(grammar).values():
        for kind, text in tokens(body):
            if kind == "rep":
                lo, _, hi = text[1:-1].partition(",")
                out.append((int(lo), int(hi) if hi else (None if "," in text else int(lo))))
    return out
