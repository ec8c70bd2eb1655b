"""Non-streaming responses: a fold over the same event stream into one neutral result.

Each dialect renders the :class:`FoldResult` (OpenAI's bodies in
``dialects/openai/format.py``); there is no second code path for non-streaming.

Example::

    fold = Fold(stream.meta.prompt_owners)
    async for event in stream:
        fold.add(event)          # raises the error of an ErrorEvent
    body = chat_completion_body(openai_meta, fold.result())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.core.errors import SluiceError, as_sluice_error
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    ReasoningDelta,
    Start,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallStart,
)
from sluice.core.frames import UsageTotals


@dataclass(slots=True)
class ToolCallResult:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ChoiceState:
    """One choice being folded: one small state object per choice."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCallResult] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) if self.reasoning else None

    def calls(self) -> list[ToolCallResult]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]


@dataclass(slots=True)
class FoldResult:
    """A whole response: its choices by index, and usage summed over them."""

    choices: dict[int, ChoiceState]
    usage: UsageTotals

    def ordered(self) -> list[tuple[int, ChoiceState]]:
        return sorted(self.choices.items())

    def usage_dict(self) -> dict[str, Any]:
        return self.usage.as_dict()


class Fold:
    def __init__(self, prompt_owners: frozenset[int]) -> None:
        self.choices: dict[int, ChoiceState] = {}
        self.usage = UsageTotals(prompt_owners)

    def add(self, event: Event) -> None:
        if isinstance(event, ErrorEvent):
            if isinstance(event.error, SluiceError):
                raise event.error
            raise as_sluice_error(event.error) from event.error
        if isinstance(event, Start):
            self.choices.setdefault(event.choice, ChoiceState())
            self.usage.start(event.choice, event.prompt_tokens)
        elif isinstance(event, TextDelta):
            state = self.choices.setdefault(event.choice, ChoiceState())
            state.text.append(event.text)
            if event.logprobs:
                state.logprobs.extend(event.logprobs)
            if not event.echo:
                self.usage.add_tokens(event.choice, event.token_count)
        elif isinstance(event, ReasoningDelta):
            self.choices.setdefault(event.choice, ChoiceState()).reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            state = self.choices.setdefault(event.choice, ChoiceState())
            state.tool_calls[event.index] = ToolCallResult(event.id, event.name)
        elif isinstance(event, ToolCallDelta):
            self.choices[event.choice].tool_calls[event.index].arguments += event.arguments
        elif isinstance(event, Finish):
            self.choices.setdefault(event.choice, ChoiceState()).finish_reason = event.reason
            self.usage.finish(event)

    def result(self) -> FoldResult:
        return FoldResult(self.choices, self.usage)
