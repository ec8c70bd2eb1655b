"""Grammar building: integer bounds (checked exhaustively via an equivalent regex), tool shapes."""

from __future__ import annotations

import re

import pytest

from sluice.engine.grammar import (
    CallFraming,
    ToolSpec,
    integer_range_rule,
    json_schema_grammar,
    tool_call_grammar,
)
from sluice.errors import InvalidRequest


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


def test_schema_grammar_uses_integer_bounds() -> None:
    g = json_schema_grammar(
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 20}}}
    )
    assert "[1-9]" in g and "root ::=" in g


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
