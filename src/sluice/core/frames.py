"""What every wire formatter produces: frames, encoded by ``server/sse.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.core.events import Finish, Usage


@dataclass(frozen=True, slots=True)
class Frame:
    """One SSE event: an optional ``event:`` name and a JSON (or literal) payload."""

    data: dict[str, Any] | str
    event: str | None = None
    # Escape non-ASCII as \uXXXX: error messages may quote the client's input, lone
    # surrogates included, which are valid JSON escaped but cannot be encoded raw.
    ascii: bool = False


DONE = Frame("[DONE]")


class UsageTotals:
    """Sums per-choice usage into the response's usage object.

    The prompt of a response is counted once per distinct prompt: with
    ``n > 1`` every choice shares one prompt.
    """

    def __init__(self, prompt_owners: frozenset[int]) -> None:
        self._owners = prompt_owners
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}
        self.reasoning_tokens: dict[int, int] = {}

    def start(self, choice: int, prompt_tokens: int) -> None:
        if choice in self._owners:
            self.prompt_tokens[choice] = prompt_tokens

    def add_tokens(self, choice: int, n: int) -> None:
        self.completion_tokens[choice] = self.completion_tokens.get(choice, 0) + n

    def finish(self, event: Finish) -> None:
        usage: Usage | None = event.usage
        if usage is None:
            return
        self.completion_tokens[event.choice] = usage.completion_tokens
        self.reasoning_tokens[event.choice] = usage.reasoning_tokens
        if event.choice in self._owners:
            self.prompt_tokens[event.choice] = usage.prompt_tokens
            self.cached_tokens[event.choice] = usage.cached_tokens

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(sum(self.cached_tokens.values()))},
            "completion_tokens_details": {
                "reasoning_tokens": int(sum(self.reasoning_tokens.values()))
            },
        }
