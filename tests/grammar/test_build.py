"""Grammar building: integer bounds (checked exhaustively via an equivalent regex), tool shapes."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from sluice.core.errors import InvalidRequest
from sluice.grammar import (
    CallFraming,
    ToolSpec,
    integer_range_rule,
    json_schema_grammar,
    tool_call_grammar,
)
from tests.support.gbnf_regex import grammar_regex


def _regex(rule: str) -> re.Pattern[str]:
    # The rule uses only quoted single characters, [a-b] classes, |, ( and ).
    return re.compile(rule.replace('" "', "").replace('"', "").replace(" ", "").replace("(", "(?:"))


@pytest.mark.parametrize(
    ("lo", "hi"),
    [
        (1, 20),
        (0, 0),
        (-5, 5),
        (7, 1234),
        (-300, -17),
        (0, None),
        (13, None),
        (None, 50),
        (99, 100),
        (100, 199),
        (5, 5),
        (-1, 0),
    ],
)
def test_integer_range_matches_exactly_the_bounded_integers(lo: int | None, hi: int | None) -> None:
    rule = integer_range_rule(lo, hi)
    assert rule is not None
    rx = _regex(rule)
    for n in range(-2000, 2000):
        ok = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(rx.fullmatch(str(n))) == ok, (lo, hi, n)
    assert not rx.fullmatch("01") and not rx.fullmatch("-0")


def test_unbounded_integer_has_no_special_rule() -> None:
    assert integer_range_rule(None, None) is None
    with pytest.raises(InvalidRequest):
        integer_range_rule(5, 1)


@pytest.mark.parametrize(
    ("bounds", "lo", "hi"),
    [
        ({"minimum": 1, "maximum": 20}, 1, 20),
        ({"exclusiveMinimum": 0, "exclusiveMaximum": 21}, 1, 20),
        ({"minimum": 0.5, "maximum": 20.9}, 1, 20),
        ({"exclusiveMinimum": 0.5, "exclusiveMaximum": 20.5}, 1, 20),
        ({"minimum": 0, "exclusiveMinimum": True, "maximum": 20}, 1, 20),  # draft 4
        ({"minimum": -3, "maximum": 20, "exclusiveMinimum": 0}, 1, 20),  # the tighter bound
    ],
)
def test_schema_grammar_accepts_exactly_the_bounded_integers(
    bounds: dict[str, Any], lo: int, hi: int
) -> None:
    g = json_schema_grammar(
        {"type": "object", "properties": {"n": {"type": "integer", **bounds}}, "required": ["n"]}
    )
    rx = grammar_regex(g)
    accepted = [n for n in range(-100, 1000) if rx.fullmatch(json.dumps({"n": n}))]
    assert accepted == list(range(lo, hi + 1))
    assert not rx.fullmatch('{"n": 01}') and not rx.fullmatch('{"n": 1.0}')


def test_integer_bounds_beyond_fifteen_digits() -> None:
    # An upper bound past 15 digits is the unbounded rule's 15 digits, not a 400 or a huge rule.
    g = json_schema_grammar({"type": "integer", "minimum": 0, "maximum": 1e300})
    rx = grammar_regex(g)
    assert rx.fullmatch("0 ") and rx.fullmatch("9" * 15) and not rx.fullmatch("1" + "0" * 15)
    with pytest.raises(InvalidRequest):
        json_schema_grammar({"type": "integer", "minimum": 1e20})


def test_invalid_schema_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest) as info:
        json_schema_grammar({"type": "nonsense"})
    assert info.value.param == "response_format"


def test_tool_grammar_frames_each_call() -> None:
    g = tool_call_grammar(
        [ToolSpec("f", {"type": "object"}), ToolSpec("g", {})],
        CallFraming(call_open="<tool_call>\n", call_close="\n</tool_call>"),
        max_calls=3,
    )
    assert '"<tool_call>\\n"' in g and '"\\"f\\""' in g and '"\\"g\\""' in g
    assert "{0,2}" in g
    one = tool_call_grammar([ToolSpec("f", {})], CallFraming(), max_calls=1)
    assert "{0," not in one
