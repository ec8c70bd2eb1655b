"""Reading generated GBNF back: character sets as bit masks, rule bodies as trees.

Sets of characters are bit masks: a bit per ASCII character, and the others share
128 more bits (code point modulo 128). Two sets that share a character always share
a bit, so a test for overlap errs only towards "may overlap": a wider count.
"""

from __future__ import annotations

import re
from typing import Any

from sluice.grammar.pattern import _subtract

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


_GBNF_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9_-]+|\{[0-9]+(?:,[0-9]*)?\}|[()|*+?.]|\S',
    re.DOTALL,
)
_GBNF_KIND = {'"': "lit", "[": "cls", "{": "rep", **dict.fromkeys("()|*+?.", "op")}
_GBNF_SIMPLE = {"n": "\n", "r": "\r", "t": "\t"}


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
