"""Medians, percentiles, ratios, and the order in which the sides of a comparison run."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def med(xs: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(xs) if xs else float("nan")


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, interpolated between the two nearest ranks (NaN if empty)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN where ``b`` is 0 or NaN."""
    return a / b if b and not math.isnan(b) else math.nan


def rotated(xs: Sequence[T], k: int) -> tuple[T, ...]:
    """``xs`` rotated left by ``k``: round ``k``'s order, so that no side always runs first
    (and none always right after another)."""
    xs = tuple(xs)
    k %= len(xs)
    return xs[k:] + xs[:k]
