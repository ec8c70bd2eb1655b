"""A sequence's reasoning block, as the engine sees it: counted, and closed on budget.

The service (``local/completions.py``) says where a family's reasoning starts and
ends (its markers, learned from the chat template) and how many tokens it may take;
the engine watches each output token's text (control tokens written out) and counts
the tokens of the block, its markers included. When the count reaches the budget
and the model has not closed the block itself, the engine forces ``closer`` (an
optional message, then the family's end marker) as the next tokens: forced tokens
cost no decode step of their own, the grammar and the sampler chain take them as
if sampled, and the answer (or the forced call) follows.

Example::

    limit = ReasoningLimit(start=b"<think>", ends=(b"</think>",), closer=[1, 2], budget=64)
    track = ReasoningTrack(limit)
    track.feed(b"<think>")     # in the block: 1 token counted
    track.spent                # True once 64 tokens were counted in an open block
"""

from __future__ import annotations

from dataclasses import dataclass

_WHITESPACE = b" \t\r\n"


@dataclass(frozen=True, slots=True)
class ReasoningLimit:
    """Where one request's reasoning block is and what it may cost.

    ``start``: the start marker (empty with ``opened``: the prompt already opened the
    block, so the output begins inside it); ``ends``: what ends the block (its end
    marker, and the answer's opening markup where a family has one); ``closer``: the
    tokens forced when the budget is spent; ``budget``: tokens the block may take
    before that (None: no limit, the block is only counted).
    """

    start: bytes
    ends: tuple[bytes, ...]
    closer: tuple[int, ...] = ()
    budget: int | None = None
    opened: bool = False


class ReasoningTrack:
    """One sequence's place relative to its reasoning block (engine thread)."""

    __slots__ = ("_head", "_keep", "_tail", "limit", "state", "tokens")

    WAITING, INSIDE, DONE = 0, 1, 2

    def __init__(self, limit: ReasoningLimit) -> None:
        self.limit = limit
        self.state = self.INSIDE if limit.opened else self.WAITING
        self.tokens = 0  # the block's tokens so far (markers included)
        self._head = b""  # the output before the block is known to open (or not)
        self._tail = b""  # the block's last bytes, where an end marker may be forming
        self._keep = max((len(e) for e in limit.ends), default=1)

    @property
    def active(self) -> bool:
        return self.state != self.DONE

    @property
    def spent(self) -> bool:
        """In the block with its budget used up: the closer must come next."""
        budget = self.limit.budget
        return self.state == self.INSIDE and budget is not None and self.tokens >= budget

    def room(self) -> int | None:
        """Tokens the block may still take before the closer (None: no bound)."""
        budget = self.limit.budget
        if self.state == self.DONE or budget is None:
            return None
        return max(0, budget - self.tokens)

    def feed(self, piece: bytes) -> None:
        """One output token's text (control tokens as their text)."""
        if self.state == self.WAITING:
            head = (self._head + piece).lstrip(_WHITESPACE)
            if head:
                self.tokens += 1  # the start marker's tokens are the block's
            start = self.limit.start
            if not start or head.startswith(start):
                self.state = self.INSIDE
                self._head = b""
                self._inside(head[len(start) :])
            elif not start.startswith(head):
                self.state = self.DONE  # the output did not open a block
                self.tokens = 0
                self._head = b""
            else:
                self._head = head
            return
        if self.state == self.INSIDE:
            self.tokens += 1
            self._inside(piece)

    def close(self) -> None:
        """The block was closed by force (or can no longer be): stop watching."""
        self.state = self.DONE

    def _inside(self, piece: bytes) -> None:
        tail = self._tail + piece
        if any(end in tail for end in self.limit.ends if end):
            self.state = self.DONE
            self._tail = b""
            return
        self._tail = tail[-self._keep :]
