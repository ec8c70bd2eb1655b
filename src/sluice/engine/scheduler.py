"""Choosing the next batch: a pure function over slot state, and the pacer that sizes it.

Every generating sequence gets its next token in every step (decode is what
users see), except that a step which prefills a short prompt may leave them
out for one step (see :func:`plan_batch`). A prompt that fits in one batch
("short": a chat turn, a question) is prefilled whole in one step, ahead of the
rest, so its time to first token is what it would be alone. A longer prompt is prefilled in chunks, whole
batches when nothing else is running. While other sequences are generating or
short prompts are being prefilled, its chunks are paced by time (the
:class:`PrefillPacer`): it earns a share of the machine (``factor`` times the
time the others use) and spends it in chunks big enough to run at llama.cpp's
efficient speed, rather than in a sliver every step. Among equals the prompt
with the least left goes first (ties: oldest admission). A long prompt cannot
starve: at most one short prompt per slot can be ahead of it, and its share
accrues in every step it sits out.
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
    decode_tokens: int = 1  # a generating slot's tokens: its next one and any forced after it


@dataclass(frozen=True, slots=True)
class Planned:
    seq: int
    n_tokens: int  # a generating slot's decode_tokens; a chunk size for a prefilling one
    prefill: bool
    short: bool = False  # a short prompt prefilled whole (see plan_batch)


def is_short(slot: SlotView, short_prompt: int) -> bool:
    """A prompt prefilled whole, ahead of long ones: what it had to prefill fits in a batch."""
    return max(slot.prefill_total, slot.prompt_remaining) <= short_prompt


def plan_batch(
    slots: Sequence[SlotView],
    n_batch: int,
    prefill_budget: int | None = None,
    short_prompt: int = 0,
    min_chunk: int = 1,
    max_chunk: int | None = None,
    decode_may_wait: bool = False,
    tile: int = 1,
) -> list[Planned]:
    """Decode tokens first, then short prompts whole, then chunks of long ones, within ``n_batch``.

    ``decode_may_wait``: a step that prefills short prompts leaves the generating
    sequences out (the engine allows it when they were in the step before, so they
    wait at most one such step). They lose nothing: llama.cpp runs each ubatch with
    the same number of tokens per sequence when sequences have their own KV
    streams, so one token each and a 250-token prompt were two graph runs anyway,
    and their token would have come at the end of both. The short prompt's first
    token comes one decode earlier, as if it were alone.

    ``prefill_budget``: prompt tokens of long prompts a step may prefill while
    others wait on it (a slot that is not paused is generating, or a short
    prompt is in the step); None: no bound but ``n_batch``. Then a chunk
    smaller than ``min_chunk`` (unless it ends its prompt) is not worth its
    cost: the prompt waits for a larger budget. A chunk that does not end its
    prompt is cut to a multiple of ``tile`` (llama.cpp's CPU attention pads a
    partial tile of query rows to a whole one). Prompts of at most
    ``short_prompt`` tokens to prefill go first and whole, outside that bound.
    Paused slots are left out.

    >>> plan_batch([SlotView(0, SlotState.GENERATING),
    ...             SlotView(1, SlotState.PREFILLING, prompt_remaining=900)], 512)
    [Planned(seq=0, n_tokens=1, prefill=False, short=False), Planned(seq=1, n_tokens=511, prefill=True, short=False)]
    """
    plan: list[Planned] = []
    budget = n_batch
    prefilling = sorted(
        (
            s
            for s in slots
            if s.state is SlotState.PREFILLING and s.prompt_remaining > 0 and not s.paused
        ),
        key=lambda s: (not is_short(s, short_prompt), s.prompt_remaining, s.admitted_at),
    )
    shorts = [s for s in prefilling if is_short(s, short_prompt)]
    if not (shorts and decode_may_wait):
        for slot in slots:
            if (
                slot.state is SlotState.GENERATING
                and not slot.paused
                and budget >= slot.decode_tokens
            ):
                plan.append(Planned(slot.seq, slot.decode_tokens, False))
                budget -= slot.decode_tokens
    for slot in shorts:
        n = min(slot.prompt_remaining, budget)
        if n > 0:
            plan.append(Planned(slot.seq, n, True, True))
            budget -= n
    if prefill_budget is None or not plan:
        paced = budget if max_chunk is None else min(budget, max_chunk)
    elif any(p.short for p in plan):
        paced = 0  # a short prompt's first token waits on this step: no chunk in it
    else:
        paced = min(budget, prefill_budget)
    for slot in prefilling[len(shorts) :]:
        n = min(slot.prompt_remaining, paced)
        if tile < n < slot.prompt_remaining:
            n -= n % tile
        if n <= 0 or (n < min(min_chunk, slot.prompt_remaining) and paced < budget):
            continue
        plan.append(Planned(slot.seq, n, True))
        budget -= n
        paced -= n
    return plan


def deferred(slots: Sequence[SlotView], plan: Sequence[Planned], short_prompt: int = 0) -> bool:
    """Whether a long prompt that could run got nothing in this plan (it earns a share)."""
    planned = {p.seq for p in plan}
    return any(
        s.state is SlotState.PREFILLING
        and s.prompt_remaining > 0
        and not s.paused
        and not is_short(s, short_prompt)
        and s.seq not in planned
        for s in slots
    )


class PrefillPacer:
    """Shares time between generating sequences and a long prompt's prefill.

    Every step a long prompt sits out while others run earns it credit:
    ``factor`` times that step's time. Once the credit pays for a whole chunk
    (:meth:`chunk`: about ``chunk_seconds`` of prefill at the measured speed,
    at least ``min_chunk`` tokens) or for the rest of the prompt,
    :meth:`budget` lets it run; the chunk's measured prefill time is then
    debited, so an estimate that was too low is paid back by waiting longer.
    Over time the prefill gets ``factor / (1 + factor)`` of the machine and the
    generating sequences the rest, and the longest gap they see is one chunk.

    Why not a sliver in every step: llama.cpp's CPU attention runs chunks of
    64 query rows or more through a tiled kernel, smaller ones row by row.
    Measured on SmolLM2-135M, 2 threads, 3,000 tokens in: a 32-token chunk
    costs 11.1 ms per token, a 64-token one 7.0, a 512-token one 5.2.

    It learns from the steps the engine runs (exponential moving averages):
    how long a decode-only step takes for a given number of generating
    sequences, and how long a prompt token of a long prompt adds (prefill gets
    slower as a prompt grows, since attention reads the whole cache).

    >>> p = PrefillPacer(1.0, 512, min_chunk=4, chunk_seconds=0.04)
    >>> p.observe(0.010, n_decode=4, deferred=True)        # 10 ms, a long prompt waited
    >>> p.observe(0.090, n_decode=4, n_long=40)            # 40 prompt tokens added 80 ms
    >>> p.seconds_per_token, round(p.credit, 3)            # 2 ms each; 10 ms earned, 80 spent
    (0.002, -0.07)
    >>> for _ in range(11): p.observe(0.010, n_decode=4, deferred=True)
    >>> p.budget(), p.chunk()                               # 40 ms of credit; 40 ms chunks
    (20, 20)
    """

    ALPHA = 0.25  # weight of the newest measurement

    def __init__(
        self, factor: float, n_batch: int, min_chunk: int = 1, chunk_seconds: float = 0.5
    ) -> None:
        self.factor = min(max(0.0, factor), 1e6)  # NaN -> 0, inf -> a finite bound
        self.n_batch = n_batch
        self.min_chunk = max(1, min(min_chunk, n_batch))
        self.chunk_seconds = max(0.0, chunk_seconds)
        self._decode: dict[int, float] = {}  # seconds per decode-only step, by sequences
        self._per_token: float | None = None  # seconds of prefill per long-prompt token
        self.credit = 0.0  # seconds of prefill a long prompt has earned (< 0: owes)

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

    def measured(self, n_decode: int) -> float | None:
        """The decode-only step time for exactly ``n_decode`` sequences, if measured."""
        return self._decode.get(n_decode)

    @property
    def seconds_per_token(self) -> float | None:
        return self._per_token

    def observe(
        self,
        seconds: float,
        n_decode: int,
        n_long: int = 0,
        n_short: int = 0,
        deferred: bool = False,
        extra: bool = False,
    ) -> None:
        """Learn from one step: its wall time, its decode tokens, its prompt tokens (of
        long prompts' chunks and of short prompts), and whether a long prompt that could
        have run sat it out. ``extra``: a sequence decoded more than its next token (a
        draft, forced tokens): the step is not a plain decode's measure."""
        if n_long:
            base: float | None = 0.0
            if n_short:
                base = None
            elif n_decode:
                base = self.decode_seconds(n_decode)
            # Without a known base the whole step counts as the prompt's.
            spent = seconds if base is None else max(seconds - base, 0.0)
            if base is not None:
                self._per_token = self._ewma(self._per_token, spent / n_long)
            if n_decode or n_short:  # a paced chunk: pay for it
                self.credit -= spent
            return
        if n_decode and not n_short and not extra:
            self._decode[n_decode] = self._ewma(self._decode.get(n_decode), seconds)
        if not deferred:
            self.credit = 0.0  # no long prompt waiting: nothing to carry over
            return
        self.credit += self.factor * seconds
        if self._per_token is not None:  # never more banked than a whole batch
            self.credit = min(self.credit, self._per_token * self.n_batch)

    def chunk(self) -> int:
        """The size of a paced chunk: about ``chunk_seconds`` of prefill, >= ``min_chunk``."""
        if not self._per_token:
            return self.min_chunk
        return self._whole(self.chunk_seconds / self._per_token)

    def max_chunk(self) -> int:
        """The largest chunk of a long prompt when nothing else runs: about twice
        ``chunk_seconds`` (a request arriving meanwhile waits at most that long; on this
        CPU a 1 s chunk costs ~5% more per token than a whole batch, late in a 3,000-token
        prompt 12%)."""
        if not self._per_token:
            return self.n_batch
        return self._whole(2 * self.chunk_seconds / self._per_token)

    def _whole(self, tokens: float) -> int:
        """``tokens`` within [min_chunk, n_batch], rounded down to a multiple of min_chunk."""
        n = max(self.min_chunk, min(int(tokens), self.n_batch))
        return max(self.min_chunk, n - n % self.min_chunk)

    def budget(self) -> int:
        """Prompt tokens of long prompts the next step may prefill beside others (what the
        credit pays for, at most a chunk; the planner runs less only to end a prompt)."""
        if self.credit < 0:
            return 0
        if not self._per_token:
            return self.min_chunk  # the first chunk measures the speed
        return min(int(self.credit / self._per_token), self.chunk())  # rounded by plan_batch
