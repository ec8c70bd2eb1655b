"""Reasoning budgets resolved from a request: its own budget, its effort through the
table, the server's setting, and a forced call's default."""

from __future__ import annotations

import pytest

from sluice.config import Settings
from sluice.core.errors import InvalidRequest
from sluice.core.request import GenerationRequest
from sluice.local.budget import ReasoningBudgets, parse_efforts


def req(**kw: object) -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "user", "content": "hi"}], **kw)  # type: ignore[arg-type]


def test_a_request_s_own_budget_wins() -> None:
    budgets = ReasoningBudgets(default=100)
    assert budgets.resolve(req(reasoning_budget=64, reasoning_effort="high")) == 64
    assert budgets.resolve(req(reasoning_budget=0)) == 0
    assert budgets.resolve(req(reasoning_budget=-1)) == -1
    assert budgets.resolve(req(reasoning_budget=-1), forced_call=True) == -1


def test_efforts_map_through_the_table() -> None:
    budgets = ReasoningBudgets.from_settings(Settings(reasoning_efforts="low=48, High=900"))
    assert budgets.resolve(req(reasoning_effort="low")) == 48
    assert budgets.resolve(req(reasoning_effort="HIGH")) == 900
    with pytest.raises(InvalidRequest) as err:
        budgets.resolve(req(reasoning_effort="medium"))
    assert err.value.param == "reasoning_effort" and "low, high" in str(err.value)


def test_the_default_table_is_litellm_s() -> None:
    budgets = ReasoningBudgets.from_settings(Settings())
    table = {e: budgets.resolve(req(reasoning_effort=e)) for e in ("none", "low", "high")}
    assert table == {"none": 0, "low": 1024, "high": 4096}
    assert budgets.resolve(req()) == -1  # no limit unless asked


def test_a_forced_call_gets_a_budget_within_a_quarter_of_its_max_tokens() -> None:
    budgets = ReasoningBudgets.from_settings(Settings())
    assert budgets.resolve(req(), forced_call=True) == 256
    assert budgets.resolve(req(max_tokens=200), forced_call=True) == 50
    assert budgets.resolve(req(max_tokens=2), forced_call=True) == 1  # never 0
    assert ReasoningBudgets(default=50).resolve(req(), forced_call=True) == 50
    assert ReasoningBudgets(forced_call=-1).resolve(req(), forced_call=True) == -1


@pytest.mark.parametrize("text", ["low", "low=x", "=5", "low=-2"])
def test_a_bad_table_is_refused_with_what_is_wrong(text: str) -> None:
    with pytest.raises(ValueError, match="--reasoning-efforts"):
        parse_efforts(text)
