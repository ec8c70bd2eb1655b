"""plan_batch: the pure batch planner (decode first, then shortest-remaining prefill chunks)."""

from __future__ import annotations

import pytest

from sluice.engine.scheduler import Planned, PrefillPacer, SlotView, deferred, plan_batch
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
        Planned(2, 400, True, short=True),
    ]
    # Even with room left and budget to spend, no chunk rides along: the short prompt's
    # first token waits on this step.
    slots[2] = SlotView(2, PRE, prompt_remaining=40, prefill_total=40, admitted_at=1)
    assert plan_batch(slots, 512, 64, short_prompt=512) == [
        Planned(0, 1, False),
        Planned(2, 40, True, short=True),
    ]
    assert deferred(slots, [Planned(0, 1, False), Planned(2, 40, True, short=True)], 512)
    # Nothing generating: the short prompt still goes alone; the long one then gets
    # whole batches.
    assert plan_batch(slots[1:], 512, 64, short_prompt=512) == [Planned(2, 40, True, short=True)]
    assert plan_batch(slots[1:2], 512, 64, short_prompt=512) == [Planned(1, 512, True)]
    # Unpaced (no budget given), the long prompt takes the rest of the batch.
    assert plan_batch(slots[1:], 512, None, short_prompt=512) == [
        Planned(2, 40, True, short=True),
        Planned(1, 472, True),
    ]


def test_generating_slots_may_sit_out_a_short_prompts_step() -> None:
    """Their token would come after the prompt's graph run anyway; its first token comes
    sooner. Only when the engine allows it (they ran in the step before)."""
    slots = [
        SlotView(0, GEN),
        SlotView(1, GEN, paused=True),
        SlotView(2, PRE, prompt_remaining=300, prefill_total=300),
        SlotView(3, GEN),
    ]
    assert plan_batch(slots, 512, 64, 512, decode_may_wait=True) == [
        Planned(2, 300, True, short=True)
    ]
    assert plan_batch(slots, 512, 64, 512, decode_may_wait=False) == [
        Planned(0, 1, False),
        Planned(3, 1, False),
        Planned(2, 300, True, short=True),
    ]
    # No short prompt: every generating slot runs, whatever the flag.
    long = SlotView(2, PRE, prompt_remaining=3000, prefill_total=3000)
    assert plan_batch([slots[0], long], 512, 64, 512, 64, decode_may_wait=True) == [
        Planned(0, 1, False),
        Planned(2, 64, True),
    ]


def test_the_tail_of_a_long_prompt_stays_paced() -> None:
    """What counts is the prompt's size at admission, not what is left of it."""
    tail = SlotView(1, PRE, prompt_remaining=300, prefill_total=3300)
    assert plan_batch([SlotView(0, GEN), tail], 512, 64, short_prompt=512) == [
        Planned(0, 1, False),
        Planned(1, 64, True),
    ]


def test_a_chunk_below_the_minimum_waits_unless_it_ends_the_prompt() -> None:
    long = SlotView(1, PRE, prompt_remaining=3000, prefill_total=3300)
    gen = SlotView(0, GEN)
    assert plan_batch([gen, long], 512, 40, 512, min_chunk=64) == [Planned(0, 1, False)]
    assert deferred([gen, long], [Planned(0, 1, False)], 512)
    assert plan_batch([gen, long], 512, 100, 512, min_chunk=64) == [
        Planned(0, 1, False),
        Planned(1, 100, True),
    ]
    # In whole tiles (llama.cpp pads a partial tile of query rows to a whole one).
    assert plan_batch([gen, long], 512, 100, 512, 64, tile=64)[1] == Planned(1, 64, True)
    assert plan_batch([gen, long], 512, 200, 512, 64, tile=64)[1] == Planned(1, 192, True)
    tail = SlotView(1, PRE, prompt_remaining=30, prefill_total=3300)
    assert plan_batch([gen, tail], 512, 40, 512, min_chunk=64) == [
        Planned(0, 1, False),
        Planned(1, 30, True),
    ]
    # Alone, the minimum does not apply, and max_chunk bounds the chunk.
    assert plan_batch([long], 512, 40, 512, min_chunk=64) == [Planned(1, 512, True)]
    assert plan_batch([long], 512, 40, 512, min_chunk=64, max_chunk=200) == [Planned(1, 200, True)]
    assert not deferred([long], [Planned(1, 200, True)], 512)
    assert plan_batch([long], 512, 40, 512, 64, 200, tile=64) == [Planned(1, 192, True)]
    # The end of a prompt goes whole, whatever its size.
    end = SlotView(1, PRE, prompt_remaining=130, prefill_total=3300)
    assert plan_batch([end], 512, 40, 512, 64, 200, tile=64) == [Planned(1, 130, True)]


def test_the_pacer_shares_time_by_credit_in_whole_chunks() -> None:
    pacer = PrefillPacer(0.5, 512, min_chunk=16, chunk_seconds=0.1)
    # Nothing measured: the first chunk is the minimum, and it measures the speed.
    assert (pacer.budget(), pacer.chunk(), pacer.max_chunk()) == (16, 16, 512)
    pacer.observe(0.030, n_decode=1, n_long=16)  # decode time unknown: the whole step
    assert pacer.seconds_per_token is None and pacer.credit == pytest.approx(-0.030)
    assert pacer.budget() == 0  # in debt: decode steps first
    pacer.observe(0.020, n_decode=4, deferred=True)
    pacer.observe(0.020, n_decode=4, deferred=True)
    pacer.observe(0.020, n_decode=4, deferred=True)
    assert pacer.credit == pytest.approx(0.0)  # 3 x 0.5 x 20 ms paid it back
    pacer.observe(0.020 + 0.002 * 16, n_decode=4, n_long=16)
    assert pacer.seconds_per_token == pytest.approx(0.002)
    assert pacer.chunk() == 48  # 100 ms at 2 ms a token: 50, in whole multiples of 16
    assert pacer.max_chunk() == 96  # twice that, alone
    assert pacer.credit == pytest.approx(-0.032)
    # Each decode step earns 10 ms; a 48-token chunk costs 96 ms: one chunk per ~10 steps.
    steps = 0
    while pacer.budget() < pacer.chunk():
        pacer.observe(0.020, n_decode=4, deferred=True)
        steps += 1
    assert steps == 13  # 32 ms of debt + 96 ms of chunk, 10 ms a step
    # Credit never banks more than a whole batch, and is dropped once no prompt waits.
    for _ in range(1000):
        pacer.observe(0.020, n_decode=4, deferred=True)
    assert pacer.credit == pytest.approx(0.002 * 512)
    pacer.observe(0.020, n_decode=4)
    assert pacer.credit == 0.0
    # Short prompts in a step: no decode time is learnt from it, and the waiting long
    # prompt earns its share of it.
    pacer.observe(0.5, n_decode=4, n_short=300, deferred=True)
    assert pacer.decode_seconds(4) == pytest.approx(0.020)
    assert pacer.credit == pytest.approx(0.25)
    # Alone (no decode in the step), prefill time is the whole step and costs no credit.
    pacer.observe(0.5, n_decode=0, n_long=250)
    assert pacer.credit == pytest.approx(0.25)
    assert pacer.seconds_per_token == pytest.approx(0.002 + 0.25 * (0.002 - 0.002))


def test_the_pacer_learns_slower_prefill_deeper_into_a_prompt() -> None:
    pacer = PrefillPacer(1.0, 512, min_chunk=8, chunk_seconds=0.2)
    pacer.observe(0.020, n_decode=2)
    for _ in range(20):
        pacer.observe(0.020 + 0.004 * 100, n_decode=2, n_long=100)
    assert pacer.seconds_per_token == pytest.approx(0.004)
    assert pacer.chunk() == 48  # 50, in whole multiples of 8


def test_the_pacer_stays_within_its_bounds() -> None:
    pacer = PrefillPacer(1e9, 512, min_chunk=64, chunk_seconds=100)
    pacer.observe(1.0, n_decode=1)
    pacer.observe(1.001, n_decode=1, n_long=1)
    assert pacer.chunk() == 512 and pacer.max_chunk() == 512
    pacer.observe(1.0, n_decode=1, deferred=True)
    assert pacer.budget() == 512
    assert PrefillPacer(float("nan"), 512).factor == 0
    tiny = PrefillPacer(1.0, 512, min_chunk=64, chunk_seconds=0.0)
    tiny.observe(0.01, n_decode=1)
    tiny.observe(0.02, n_decode=1, n_long=10)
    assert tiny.chunk() == 64 and tiny.max_chunk() == 64
    # factor 0: a long prompt waits while others generate.
    zero = PrefillPacer(0.0, 512, min_chunk=8)
    zero.observe(0.01, n_decode=1)
    zero.observe(0.02, n_decode=1, n_long=10)
    for _ in range(100):
        zero.observe(0.01, n_decode=1, deferred=True)
    assert zero.budget() == 0
