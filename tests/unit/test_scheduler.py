"""plan_batch: the pure batch planner (decode first, then shortest-remaining prefill chunks)."""

from __future__ import annotations

import pytest

from sluice.engine.scheduler import Planned, PrefillPacer, SlotView, plan_batch
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


def test_prefill_is_paced_while_others_decode_but_not_when_alone() -> None:
    long = SlotView(1, PRE, prompt_remaining=5000, prefill_total=5000)
    assert plan_batch([SlotView(0, GEN), long], 512, 128, short_prompt=512) == [
        Planned(0, 1, False),
        Planned(1, 128, True),
    ]
    assert plan_batch([long], 512, 128, short_prompt=512) == [Planned(1, 512, True)]


def test_a_short_prompt_goes_whole_and_first_beside_generating_slots() -> None:
    """A chat turn is prefilled in one step (its TTFT as if alone); the long one waits."""
    slots = [
        SlotView(0, GEN),
        SlotView(1, PRE, prompt_remaining=3000, prefill_total=3300, admitted_at=0),
        SlotView(2, PRE, prompt_remaining=400, prefill_total=400, admitted_at=1),
    ]
    assert plan_batch(slots, 512, 64, short_prompt=512) == [
        Planned(0, 1, False),
        Planned(2, 400, True),
    ]
    # With time left after the short one, the long one gets the rest of the budget.
    slots[2] = SlotView(2, PRE, prompt_remaining=40, prefill_total=40, admitted_at=1)
    assert plan_batch(slots, 512, 64, short_prompt=512) == [
        Planned(0, 1, False),
        Planned(2, 40, True),
        Planned(1, 24, True),
    ]


def test_the_tail_of_a_long_prompt_stays_paced() -> None:
    """What counts is the prompt's size at admission, not what is left of it."""
    tail = SlotView(1, PRE, prompt_remaining=300, prefill_total=3300)
    assert plan_batch([SlotView(0, GEN), tail], 512, 64, short_prompt=512) == [
        Planned(0, 1, False),
        Planned(1, 64, True),
    ]


def test_the_pacer_sizes_prefill_by_measured_time() -> None:
    pacer = PrefillPacer(2.0, 512)
    assert pacer.budget(4) == PrefillPacer.FIRST_GUESS  # nothing measured yet
    pacer.observe(0.030, n_decode=1, n_prefill=60)  # decode time for 1 unknown: ignored
    assert pacer.seconds_per_token is None
    pacer.observe(0.020, n_decode=4, n_prefill=0)
    pacer.observe(0.020 + 0.003 * 100, n_decode=4, n_prefill=100)
    assert pacer.seconds_per_token == pytest.approx(0.003)
    assert pacer.budget(4) == 13  # 2 x 20 ms / 3 ms
    assert pacer.budget(2) == 13  # nearest count measured
    # Prefill gets slower deeper into a prompt: the budget follows.
    for _ in range(20):
        pacer.observe(0.020 + 0.006 * 100, n_decode=4, n_prefill=100)
    assert pacer.budget(4) == 8  # ~40 ms / 6 ms = 6, raised to the floor of 8
    # Alone (no decode in the step), prefill time is the whole step.
    alone = PrefillPacer(2.0, 512)
    alone.observe(0.5, n_decode=0, n_prefill=250)
    assert alone.seconds_per_token == pytest.approx(0.002)


def test_the_pacer_stays_within_its_floor_and_the_batch() -> None:
    pacer = PrefillPacer(1e9, 512)
    pacer.observe(1.0, n_decode=1, n_prefill=0)
    pacer.observe(1.001, n_decode=1, n_prefill=1)
    assert pacer.budget(1) == 512
    assert PrefillPacer(float("nan"), 512).factor == 0
    zero = PrefillPacer(0.0, 512)
    zero.observe(0.01, n_decode=1, n_prefill=0)
    zero.observe(0.02, n_decode=1, n_prefill=10)
    assert zero.budget(1) == 8
