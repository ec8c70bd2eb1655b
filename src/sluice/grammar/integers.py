"""Integer ranges as GBNF: the integers within a schema's bounds, digit by digit."""

from __future__ import annotations

import math
from typing import Any

from sluice.core.errors import InvalidRequest
from sluice.grammar.spec import (
    _SchemaProblem,
)

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
