"""plan_batch: the pure batch planner (decode first, then shortest-remaining prefill chunks)."""

from __future__ import annotations

from sluice.engine.scheduler import Planned, SlotView, plan_batch
from sluice.engine.types import SlotState

GEN = SlotState.GENERATING
PRE = SlotState.PREFILLING
IDLE = SlotState.IDLE


def test_empty_and_idle_plan_nothing() -> None:
    assert plan_batch([], 512) == []
    assert plan_batch([SlotView(0, IDLE), SlotView(1, IDLE)], 512) == []


def test_every_generating_slot_gets_one_token() -> None:
    plan = plan_batch([SlotView(0, GEN), SlotView(1, IDLE), SlotView(2, GEN)], 512)
    assert plan == [Planned(0, 1, False), Planned(2, 1, False)]


def test_decode_first_then_prefill_gets_the_rest_of_the_budget() -> None:
    plan = plan_batch([SlotView(1, PRE, prompt_remaining=900), SlotView(0, GEN)], 512)
    assert plan == [Planned(0, 1, False), Planned(1, 511, True)]
    assert sum(p.n_tokens for p in plan) == 512


def test_prefill_is_fifo_by_admission_not_slot_order() -> None:
    slots = [
        SlotView(0, PRE, prompt_remaining=10, admitted_at=5),
        SlotView(1, PRE, prompt_remaining=10, admitted_at=2),
    ]
    assert plan_batch(slots, 15) == [Planned(1, 10, True), Planned(0, 5, True)]


def test_short_prompt_admitted_later_is_not_stuck_behind_a_long_prefill() -> None:
    slots = [
        SlotView(0, GEN),
        SlotView(1, PRE, prompt_remaining=5000, admitted_at=0),
        SlotView(2, PRE, prompt_remaining=20, admitted_at=1),
    ]
    assert plan_batch(slots, 512) == [
        Planned(0, 1, False),
        Planned(2, 20, True),
        Planned(1, 491, True),
    ]


def test_short_prefill_finishes_in_one_chunk_and_leftover_goes_on() -> None:
    slots = [
        SlotView(0, PRE, prompt_remaining=3, admitted_at=0),
        SlotView(1, PRE, prompt_remaining=100, admitted_at=1),
        SlotView(2, PRE, prompt_remaining=100, admitted_at=2),
    ]
    assert plan_batch(slots, 8) == [Planned(0, 3, True), Planned(1, 5, True)]


def test_budget_smaller_than_generating_slots() -> None:
    slots = [SlotView(i, GEN) for i in range(5)] + [SlotView(5, PRE, prompt_remaining=4)]
    plan = plan_batch(slots, 3)
    assert plan == [Planned(0, 1, False), Planned(1, 1, False), Planned(2, 1, False)]


def test_prefilling_with_nothing_left_is_skipped() -> None:
    assert plan_batch([SlotView(0, PRE, prompt_remaining=0)], 8) == []


def test_long_prompt_is_chunked_over_steps_while_decode_continues() -> None:
    """Simulate the loop: a 50-token prompt with n_batch 8 next to one generating slot."""
    remaining = 50
    steps = 0
    while remaining:
        plan = plan_batch([SlotView(0, GEN), SlotView(1, PRE, prompt_remaining=remaining)], 8)
        assert plan[0] == Planned(0, 1, False)  # the generating slot is never starved
        assert sum(p.n_tokens for p in plan) <= 8
        remaining -= plan[1].n_tokens
        steps += 1
    assert steps == 8  # ceil(50 / 7)


def test_planned_total_never_exceeds_n_batch() -> None:
    slots = [SlotView(0, GEN), SlotView(1, GEN)] + [
        SlotView(i, PRE, prompt_remaining=7 * i, admitted_at=i) for i in range(2, 6)
    ]
    for n_batch in range(1, 60):
        plan = plan_batch(slots, n_batch)
        assert sum(p.n_tokens for p in plan) <= n_batch
        assert len({p.seq for p in plan}) == len(plan)


def test_prefill_is_capped_while_others_decode_but_not_when_alone() -> None:
    long = SlotView(1, PRE, prompt_remaining=5000)
    assert plan_batch([SlotView(0, GEN), long], 512, 128) == [
        Planned(0, 1, False),
        Planned(1, 128, True),
    ]
    assert plan_batch([long], 512, 128) == [Planned(1, 512, True)]
