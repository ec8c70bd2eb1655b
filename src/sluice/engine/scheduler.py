"""Choosing the next batch: a pure function over slot state, and the pacer that sizes it.

Every generating sequence gets its next token in every step (decode is what
users see); what is left of the token budget goes to prompt prefill in
chunks. A prompt that fits in one batch ("short": a chat turn, a question)
is prefilled whole in one step, ahead of the rest, so its time to first
token is what it would be alone. A longer prompt is prefilled in chunks; while
other sequences are generating, its chunk is sized by time (the
:class:`PrefillPacer`: a multiple of the step's decode time, from the measured
prefill speed), so their tokens keep coming at a bounded pace. Among equals the
prompt with the least left goes first (ties: oldest admission). A long prompt
cannot starve: at most one short prompt per slot can be ahead of it, and it gets
at least a floor of tokens in every step with time left.
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
    prefill_total: int = 0  # prompt tokens to prefill at admission (not cached)


@dataclass(frozen=True, slots=True)
class Planned:
    seq: int
    n_tokens: int  # 1 for a generating slot; a chunk size for a prefilling one
    prefill: bool


def plan_batch(
    slots: Sequence[SlotView],
    n_batch: int,
    prefill_budget: int | None = None,
    short_prompt: int = 0,
) -> list[Planned]:
    """Decode tokens first, then prefill: short prompts whole, then chunks, within ``n_batch``.

    ``prefill_budget``: prompt tokens a step may prefill while some slot that is
    not paused is generating (None: no bound but ``n_batch``). Prompts of at
    most ``short_prompt`` tokens to prefill go first and whole, outside that
    bound (their own time to first token is the point); the bound applies to the
    chunks of longer ones. Paused slots are left out.

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
    # Others are waiting for their next token: keep the chunks of long prompts short.
    paced = budget if prefill_budget is None or not plan else prefill_budget

    def short(s: SlotView) -> bool:
        return max(s.prefill_total, s.prompt_remaining) <= short_prompt

    prefilling = sorted(
        (
            s
            for s in slots
            if s.state is SlotState.PREFILLING and s.prompt_remaining > 0 and not s.paused
        ),
        key=lambda s: (not short(s), s.prompt_remaining, s.admitted_at),
    )
    for slot in prefilling:
        if budget <= 0:
            break
        n = min(slot.prompt_remaining, budget if short(slot) else min(budget, paced))
        if n <= 0:
            continue
        plan.append(Planned(slot.seq, n, True))
        budget -= n
        paced -= n
    return plan


class PrefillPacer:
    """Sizes the prefill of a step that generating sequences wait on, by time.

    From the steps the engine runs it learns how long a decode-only step takes
    for a given number of generating sequences, and how long a prompt token of
    prefill adds (exponential moving averages: prefill gets slower as a prompt
    grows, since attention reads the whole cache). :meth:`budget` is then the
    number of prompt tokens that take about ``factor`` times the decode time, so
    during a long prefill the generating sequences' gap between tokens is about
    ``1 + factor`` times their gap without it.

    >>> p = PrefillPacer(2.0, 512)
    >>> p.observe(0.010, n_decode=4, n_prefill=0)   # 10 ms for 4 tokens
    >>> p.observe(0.110, n_decode=4, n_prefill=50)  # 50 prompt tokens added 100 ms
    >>> p.budget(4)                                  # 20 ms of prefill
    10
    """

    ALPHA = 0.25  # weight of the newest measurement
    FIRST_GUESS = 32  # tokens, before any measurement

    def __init__(self, factor: float, n_batch: int, floor: int = 8) -> None:
        self.factor = min(max(0.0, factor), 1e6)  # NaN -> 0, inf -> a finite bound
        self.n_batch = n_batch
        self.floor = max(1, min(floor, n_batch))
        self._decode: dict[int, float] = {}  # seconds per decode-only step, by sequences
        self._per_token: float | None = None  # seconds of prefill per prompt token

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)

    def decode_seconds(self, n_decode: int) -> float | None:
        """The decode-only step time for ``n_decode`` sequences (the nearest count measured)."""
        if not self._decode:
            return None
        if n_decode in self._decode:
            return self._decode[n_decode]
        nearest = min(self._decode, key=lambda n: (abs(n - n_decode), n))
        return self._decode[nearest]

    @property
    def seconds_per_token(self) -> float | None:
        return self._per_token

    def observe(self, seconds: float, n_decode: int, n_prefill: int) -> None:
        """Learn from one step: its wall time, its decode tokens and its prompt tokens."""
        if n_prefill == 0:
            if n_decode:
                self._decode[n_decode] = self._ewma(self._decode.get(n_decode), seconds)
            return
        base = 0.0
        if n_decode:
            known = self.decode_seconds(n_decode)
            if known is None:
                return  # cannot tell the prefill's share of this step apart yet
            base = known
        self._per_token = self._ewma(self._per_token, max(seconds - base, 0.0) / n_prefill)

    def budget(self, n_decode: int) -> int:
        """Prompt tokens for a step beside ``n_decode`` generating sequences."""
        decode = self.decode_seconds(n_decode)
        if decode is None or not self._per_token:
            return max(self.floor, min(self.FIRST_GUESS, self.n_batch))
        tokens = int(self.factor * decode / self._per_token)
        return max(self.floor, min(tokens, self.n_batch))
