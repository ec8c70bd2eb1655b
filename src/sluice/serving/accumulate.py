"""Non-streaming responses: a fold over the same event stream.

Example::

    acc = ResponseAccumulator()
    async for event in stream:
        acc.add(event)          # raises the error of an ErrorEvent
    body = chat_completion_body(meta, acc)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.errors import EngineFailure, SluiceError
from sluice.events import (
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
from sluice.serving.formatters.base import UsageTotals
from sluice.serving.formatters.openai import ResponseMeta, chat_logprobs, text_logprobs


@dataclass(slots=True)
class ChoiceState:
    """One choice being folded: one small state object per choice."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def message(self) -> dict[str, Any]:
        content = "".join(self.text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            msg["content"] = content or None
            msg["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return msg


class ResponseAccumulator:
    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self.choices: dict[int, ChoiceState] = {}
        self.usage = UsageTotals(meta.prompt_owners)

    def add(self, event: Event) -> None:
        if isinstance(event, ErrorEvent):
            err = event.error
            if isinstance(err, SluiceError):
                raise err
            raise EngineFailure(str(err)) from err
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
            self.choices.setdefault(event.choice, ChoiceState()).tool_calls[event.index] = {
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
        elif isinstance(event, ToolCallDelta):
            call = self.choices[event.choice].tool_calls[event.index]
            call["function"]["arguments"] += event.arguments
        elif isinstance(event, Finish):
            self.choices.setdefault(event.choice, ChoiceState()).finish_reason = event.reason
            self.usage.finish(event)

    def _base(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.meta.id,
            "object": object_name,
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": self.usage.as_dict(),
        }

    def chat_completion(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            state = self.choices[index]
            choices.append(
                {
                    "index": index,
                    "message": state.message(),
                    "logprobs": chat_logprobs(state.logprobs) if self.meta.logprobs else None,
                    "finish_reason": state.finish_reason,
                }
            )
        return self._base("chat.completion", choices)

    def text_completion(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            state = self.choices[index]
            choices.append(
                {
                    "text": "".join(state.text),
                    "index": index,
                    "logprobs": text_logprobs(state.logprobs, 0) if self.meta.logprobs else None,
                    "finish_reason": state.finish_reason,
                }
            )
        return self._base("text_completion", choices)
