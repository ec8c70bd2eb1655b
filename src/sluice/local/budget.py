"""Reasoning budgets: how many tokens a request's reasoning block may take.

Every dialect's way of asking ends up as a :class:`~sluice.core.request.
GenerationRequest`'s ``reasoning_budget`` (tokens: Anthropic's
``thinking.budget_tokens``, Gemini's ``thinkingBudget``, llama-server's
``thinking_budget_tokens``) or ``reasoning_effort`` (OpenAI's and Responses'
effort, Ollama's ``think`` level, LM Studio's ``reasoning``, Gemini's
``thinkingLevel``), an effort mapped to tokens by a configurable table
(``--reasoning-efforts``). Without either, the server's ``--reasoning-budget``
holds; a forced call (``tool_choice`` required or a named function) that sets no
budget gets ``--call-reasoning-budget``, and never more than a quarter of its
``max_tokens``, so that the call comes within them.

A budget of 0 turns reasoning off; -1 (or None) is no limit.

Example::

    budgets = ReasoningBudgets.from_settings(settings)
    budgets.resolve(request, forced_call=True)   # 256 (the call's default)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.config import Settings
from sluice.config.settings import DEFAULT_EFFORTS
from sluice.core.errors import InvalidRequest
from sluice.core.request import GenerationRequest

UNLIMITED = -1
CALL_SHARE = 4  # a forced call's default budget: at most max_tokens / this


def parse_efforts(text: str, *, source: str = "--reasoning-efforts") -> dict[str, int]:
    """``name=tokens`` pairs, comma-separated; a ValueError that says what is wrong."""
    table: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        try:
            tokens = int(value)
        except ValueError:
            tokens = -2
        if not sep or not name or tokens < UNLIMITED:
            raise ValueError(
                f"{source}: {part!r} is not effort=tokens (tokens a whole number, "
                "0 for no reasoning, -1 for no limit)"
            )
        table[name] = tokens
    return table


@dataclass(frozen=True, slots=True)
class ReasoningBudgets:
    """The server's side of the budgets (settings)."""

    default: int = UNLIMITED  # --reasoning-budget
    forced_call: int = 256  # --call-reasoning-budget
    message: str = ""  # --reasoning-budget-message, written before the closing marker
    efforts: dict[str, int] = field(default_factory=lambda: parse_efforts(DEFAULT_EFFORTS))

    @classmethod
    def from_settings(cls, settings: Settings) -> ReasoningBudgets:
        """The settings' budgets; a ValueError names a bad ``--reasoning-efforts``."""
        return cls(
            default=max(UNLIMITED, settings.reasoning_budget),
            forced_call=max(UNLIMITED, settings.call_reasoning_budget),
            message=settings.reasoning_budget_message,
            efforts=parse_efforts(settings.reasoning_efforts),
        )

    def resolve(self, body: GenerationRequest, *, forced_call: bool = False) -> int:
        """The budget of ``body``'s reasoning in tokens (-1: no limit)."""
        budget = body.reasoning_budget
        if budget is None and body.reasoning_effort is not None:
            effort = body.reasoning_effort.strip().lower()
            if effort not in self.efforts:
                known = ", ".join(self.efforts)
                raise InvalidRequest(
                    f"reasoning_effort '{body.reasoning_effort[:32]}' is not one of {known} "
                    "(--reasoning-efforts)",
                    param="reasoning_effort",
                )
            budget = self.efforts[effort]
        if budget is not None and budget < 0:
            budget = UNLIMITED
        if budget is None:
            budget = self.default
            if forced_call and self.forced_call >= 0:
                budget = self.forced_call if budget < 0 else min(budget, self.forced_call)
                if body.max_tokens is not None and budget > 0:
                    # The rest is the calls': a family's markup in a vocabulary without
                    # it as tokens takes ~50 a call (MiniMax-M2 on SmolLM2). Never 0 by
                    # this: only a request turns reasoning off.
                    budget = min(budget, max(1, body.max_tokens // CALL_SHARE))
        return budget
