"""Prompt-lookup speculation: drafts from the text itself, and how long a draft pays.

Agents make models copy: a file rewritten with one change, a patch that repeats its
context, a quote. The next tokens are then very likely the ones that followed the
same few tokens earlier in the prompt or the answer. :class:`PromptLookup` finds the
longest recent n-gram (``NGRAM_MAX`` down to ``NGRAM_MIN`` tokens) that ends the text
and occurred before, and drafts what followed it. The engine decodes the draft in the
same step as the sequence's next token, with logits on every drafted row, samples
each row in turn with the request's own sampler chain (grammar, penalties, seed) and
keeps the drafted tokens up to the first one the sampler did not choose: the output
is the one plain decoding gives (see ``Engine._verify``). The rejected rows leave the
KV cache at once.

A drafted row is not free: on this 2-core CPU it costs about half a decode step
(measured with SmolLM2-135M: one extra row 1.56x the step, four 2.8x, eight 4.2x). A
sequence's draft length is therefore chosen (:meth:`DraftPolicy.length`) to maximize
the expected tokens per unit of time, from the sequence's own acceptance rate and
the measured cost of a row; beside other sequences (whose KV streams make llama.cpp
run the drafted rows as a graph of their own) a draft must pay for the step all of
them wait, so a busy batch gets short drafts or none.

Example::

    lookup = PromptLookup(prompt_tokens)
    lookup.extend([token])                 # every token of the answer, as it comes
    draft = lookup.draft(8)                # [] when the text has no earlier match
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NGRAM_MAX = 5  # the longest context matched: longer matches draft more reliably
NGRAM_MIN = 3  # shorter contexts repeat by chance in prose (measured acceptance ~0.2)

# Relative cost of drafted rows before the engine has measured it (SmolLM2-135M, 2
# threads): a step with k more rows costs about 1 + ROW_FIXED + ROW_COST * k steps.
ROW_FIXED = 0.15
ROW_COST = 0.40
# Beside other sequences the drafted rows are a graph run of their own (one sequence
# of k rows), costing about that much more of a one-sequence step.
GRAPH_FIXED = 0.5

PRIOR = 0.7  # a drafted token's chance to be kept, before the sequence has drafted
PRIOR_WEIGHT = 1.0  # the prior counts as this many drafted tokens
DECAY = 0.9  # each token verified since weighs an outcome by this much less
REFUSED_DECAY = 0.6  # and a refused one much less still: a copy that ends shows at once


class PromptLookup:
    """An index of a sequence's n-grams (prompt and answer) to the position after each,
    and where the text is copying from now.

    A copy keeps to its source: once a draft came from position ``s`` and the answer
    went on as the text there did, the next draft continues from the same place (the
    ``cursor``), not from the latest occurrence of the last few tokens, which in code
    (a repeated ``self.``, a closing bracket) is often another line."""

    __slots__ = ("_index", "cursor", "tokens")

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.cursor: int | None = None  # the source position of the next token, if copying
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; each n-gram that now has a token after it is indexed (the
        latest occurrence wins: recent text is the likelier source). A token that is
        not the one at the cursor ends the copy."""
        hist = self.tokens
        index = self._index
        for token in tokens:
            end = len(hist)  # the position the n-grams ending before ``token`` point at
            cursor = self.cursor
            if cursor is not None:
                self.cursor = cursor + 1 if cursor < end and hist[cursor] == token else None
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    index[tuple(hist[end - n : end])] = end
            hist.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens: what follows the copy's source, else what followed the
        longest earlier occurrence of the text's last n-gram; [] without one."""
        if k <= 0:
            return []
        hist = self.tokens
        end = len(hist)
        start = self.cursor
        if start is None or start >= end:
            start = None
            for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
                if end >= n:
                    start = self._index.get(tuple(hist[end - n :]))
                    if start is not None:
                        break
            if start is None:
                return []
            self.cursor = start
        draft = hist[start : min(start + k, end)]
        # A repeat that runs into the end continues with its own draft (a loop of
        # period end - start drafts past one period).
        while len(draft) < k:
            draft.append(draft[len(draft) - (end - start)])
        return draft


@dataclass(slots=True)
class Acceptance:
    """One sequence's drafting record: the chance that a drafted token is kept,
    estimated from recent drafts (each kept token a success, the refused one that ends
    a draft a failure), weighted toward the newest and starting from the prior."""

    kept: float = 0.0  # decayed counts
    refused: float = 0.0

    @property
    def rate(self) -> float:
        return (self.kept + PRIOR * PRIOR_WEIGHT) / (self.kept + self.refused + PRIOR_WEIGHT)

    def observe(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens kept its first ``accepted``."""
        # Token by token, each outcome fading the older ones: the newest count most, so
        # a copy that ends shows within a few drafts.
        for _ in range(accepted):
            self.kept = self.kept * DECAY + 1.0
            self.refused *= DECAY
        if accepted < drafted:
            self.kept *= REFUSED_DECAY
            self.refused = self.refused * DECAY + 1.0

    def shadow(self, kept: bool) -> None:
        """A step that did not draft: whether the token it sampled is the one the lookup
        would have drafted first. The record keeps learning without paying for rows, so
        a sequence that stopped drafting (or never could, beside others) starts when its
        text turns to copying."""
        if kept:
            self.kept = self.kept * DECAY + 1.0
            self.refused *= DECAY
        else:
            self.kept *= REFUSED_DECAY
            self.refused = self.refused * DECAY + 1.0


class DraftPolicy:
    """Chooses draft lengths from acceptance rates and the measured cost of a row."""

    def __init__(self, row_cost: float = ROW_COST) -> None:
        # Of a one-sequence step, per drafted row. Not learned from the steps: a step's
        # time varies by more than a row's cost on a shared machine, and an estimate
        # driven high by noise would stop the drafts that could correct it.
        self.row_cost = row_cost

    def length(self, rate: float, limit: int, sequences: int, share: float) -> int:
        """The draft length (0..``limit``) with the most expected tokens per time.

        ``sequences`` decode in the step; ``share`` is a one-sequence step's time over
        this step's (how much of the step a drafted graph run adds). With one sequence
        the choice maximizes (1 + E[kept]) / (1 + fixed + cost * k); beside others, the
        step's (sequences + E[kept]) / (1 + share * (graph + fixed + cost * k))."""
        if limit <= 0 or rate <= 0.0:
            return 0
        best, best_k = 0.0, 0
        kept = 0.0
        p = 1.0
        fixed = ROW_FIXED if sequences == 1 else share * (GRAPH_FIXED + ROW_FIXED)
        scale = 1.0 if sequences == 1 else share
        for k in range(1, limit + 1):
            p *= rate
            kept += p
            value = (sequences + kept) / (1.0 + fixed + scale * self.row_cost * k)
            if value > best:
                best, best_k = value, k
        # A gain within noise is not worth the rows.
        return best_k if best > sequences * 1.02 else 0
