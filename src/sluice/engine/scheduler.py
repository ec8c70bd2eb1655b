"""Choosing the next batch: a pure function over slot state.

Every generating sequence gets its next token in every step (decode is what
users see); what is left of the token budget goes to prompt prefill in
chunks, the prompt with the least left first (ties: oldest admission). So a
long prompt never stalls anyone's next token, and a short prompt that arrives
during a long prefill gets its first token without waiting for it. A long
prompt cannot starve: at most one short prompt per slot can be ahead of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.engine.types import SlotState


@dataclass(frozen=True, slots=True)
class SlotView:
    """What the planner needs to know about one slot."""

    seq: int
    state: SlotState
    prompt_remaining: int = 0  # prompt tokens not yet in the KV cache
    admitted_at: int = 0  # admission order, breaks prefill ties
    paused: bool = False  # its client has not taken what it already has: skip it


@dataclass(frozen=True, slots=True)
class Planned:
    seq: int
    n_tokens: int  # 1 for a generating slot; a chunk size for a prefilling one
    prefill: bool


def plan_batch(
    slots: Sequence[SlotView], n_batch: int, prefill_while_decoding: int | None = None
) -> list[Planned]:
    """Decode tokens first, then prefill chunks shortest-remaining first, within ``n_batch``.

    Paused slots are left out; the prefill cap applies only while some slot
    that is not paused is generating.

    >>> plan_batch([SlotView(0, SlotState.GENERATING),
    ...             SlotView(1, SlotState.PREFILLING, prompt_remaining=900)], 512)
    [Planned(seq=0, n_tokens=1, prefill=False), Planned(seq=1, n_tokens=511, prefill=True)]
    """
    plan: list[Planned] = []
    budget = n_batch
    for slot in slots:
        if slot.state is SlotState.GENERATING and not slot.paused and budget > 0:
            plan.append(Planned(slot.seq, 1, False))
            budget -= 1
    if prefill_while_decoding is not None and plan:
        # Others are waiting for their next token: keep this step short.
        budget = min(budget, prefill_while_decoding)
    prefilling = sorted(
        (
            s
            for s in slots
            if s.state is SlotState.PREFILLING and s.prompt_remaining > 0 and not s.paused
        ),
        key=lambda s: (s.prompt_remaining, s.admitted_at),
    )
    for slot in prefilling:
        if budget <= 0:
            break
        n = min(slot.prompt_remaining, budget)
        plan.append(Planned(slot.seq, n, True))
        budget -= n
    return plan
