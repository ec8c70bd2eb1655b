"""Upstream answers passed through unchanged, read for the slot's figures: the taps."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from sluice.metrics.slots import RequestMeter


class OpenAIChunkTap:
    """Feeds a RequestMeter from an OpenAI upstream's decoded ``data:`` objects.

    The bytes go to the client unchanged; this only reads the parsed chunks.
    TTFT is keyed to the first chunk with content (not the role-only chunk);
    each content-bearing choice delta counts one token until ``usage`` gives
    the exact counts.

    Example::

        tap = OpenAIChunkTap(slot.request())
        async for data in decoder:          # each parsed `data:` JSON object
            tap.chunk(data)
        tap.finish()                        # or tap.finish(error=True)
    """

    def __init__(self, meter: RequestMeter) -> None:
        self._meter = meter
        self._error = False
        self._prompt: int | None = None
        self._completion: int | None = None
        self._cached: int | None = None
        self._named = False
        self.on_id: Callable[[str], None] | None = None  # hears the response's id once

    @property
    def meter(self) -> RequestMeter:
        return self._meter

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's tokens, once the upstream's usage has said."""
        return self._prompt

    def _name(self, response_id: object) -> None:
        self._named = True
        if isinstance(response_id, str) and response_id and self.on_id is not None:
            self.on_id(response_id)

    def chunk(self, data: Mapping[str, Any]) -> None:
        """One streamed chunk (chat ``delta`` or completions ``text``)."""
        self.event(data)

    def event(self, data: Mapping[str, Any]) -> bool:
        """One streamed event: :meth:`chunk`, and whether it ends the answer
        (:meth:`ended`), in one pass over its choices (this runs for every event a
        gateway forwards)."""
        if not self._named:
            self._name(data.get("id"))
        if data.get("error"):
            self._error = True
        choices = data.get("choices")
        ended = False
        if isinstance(choices, list):
            bearing = 0
            for choice in choices:
                if isinstance(choice, Mapping):
                    if _carries_content(choice):
                        bearing += 1
                    if choice.get("finish_reason"):
                        ended = True
            if bearing:
                self._meter.tokens(bearing)
        else:
            ended = "error" in data
        usage = data.get("usage")
        if usage is not None:
            self._usage(usage)
        return ended

    def body(self, data: Mapping[str, Any]) -> None:
        """A non-streaming answer: the first token is when it arrived."""
        if data.get("error"):
            self._error = True
            return
        self._meter.first_token()
        self._usage(data.get("usage"))
        if self._completion is not None:
            self._meter.tokens(self._completion)

    def finish(self, error: bool = False) -> None:
        """The response ended (idempotent); ``error`` for a transport/upstream failure."""
        self._meter.finish(
            prompt_tokens=self._prompt,
            completion_tokens=self._completion,
            error=error or self._error,
            cached_tokens=self._cached,
        )

    def ended(self, data: Mapping[str, Any]) -> bool:
        """Whether ``data`` completes the answer (a finish or an error)."""
        choices = data.get("choices")
        if not isinstance(choices, list):
            return "error" in data
        return any(isinstance(c, Mapping) and c.get("finish_reason") for c in choices)

    def _usage(self, usage: object) -> None:
        if not isinstance(usage, Mapping):
            return
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if _is_count(prompt):
            self._prompt = prompt
        if _is_count(completion):
            self._completion = completion
        self._cached_in(usage.get("prompt_tokens_details"), "cached_tokens")

    def _cached_in(self, details: object, field: str) -> None:
        """The prompt's cached tokens, where a usage object's ``details`` give them."""
        if isinstance(details, Mapping) and _is_count(details.get(field)):
            self._cached = details[field]


class _SplitTap(OpenAIChunkTap):
    """A tap whose :meth:`chunk` and :meth:`ended` read different fields: ``event``
    asks both."""

    def event(self, data: Mapping[str, Any]) -> bool:
        self.chunk(data)
        return self.ended(data)


class AnthropicEventTap(_SplitTap):
    """The same, for an upstream that speaks Anthropic's Messages API natively.

    Each content delta counts one token until ``message_delta``'s cumulative usage
    gives the exact count; ``input_tokens`` plus the cache reads is the prompt.
    """

    def chunk(self, data: Mapping[str, Any]) -> None:
        kind = data.get("type")
        if kind == "content_block_delta":
            self._meter.tokens(1)
        elif kind == "message_start":
            message = data.get("message")
            if isinstance(message, Mapping):
                self._name(message.get("id"))
                self._anthropic_usage(message.get("usage"))
        elif kind == "message_delta":
            self._anthropic_usage(data.get("usage"))
        elif kind == "error":
            self._error = True

    def body(self, data: Mapping[str, Any]) -> None:
        if data.get("type") == "error":
            self._error = True
            return
        self._meter.first_token()
        self._anthropic_usage(data.get("usage"))
        if self._completion is not None:
            self._meter.tokens(self._completion)

    def ended(self, data: Mapping[str, Any]) -> bool:
        return data.get("type") in ("message_stop", "error")

    def _anthropic_usage(self, usage: object) -> None:
        if not isinstance(usage, Mapping):
            return
        fresh = usage.get("input_tokens")
        if _is_count(fresh):
            prompt: int = fresh
            for key in ("cache_read_input_tokens", "cache_creation_input_tokens"):
                cached = usage.get(key)
                if _is_count(cached):
                    prompt += cached
            self._prompt = prompt
            self._cached_in(usage, "cache_read_input_tokens")
        output = usage.get("output_tokens")
        if _is_count(output):
            self._completion = output


class ResponsesEventTap(_SplitTap):
    """The same, for an upstream that serves OpenAI's Responses API natively: each text or
    arguments delta counts one token until the terminal event's usage says."""

    _TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")

    def chunk(self, data: Mapping[str, Any]) -> None:
        kind = data.get("type")
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self._meter.tokens(1)
        elif kind == "response.created" and not self._named:
            response = data.get("response")
            self._name(response.get("id") if isinstance(response, Mapping) else None)
        elif kind in ("response.failed", "error"):
            self._error = True
        if kind in self._TERMINAL:
            self._response_usage(data.get("response"))

    def body(self, data: Mapping[str, Any]) -> None:
        if data.get("error"):
            self._error = True
            return
        self._meter.first_token()
        self._response_usage(data)
        if self._completion is not None:
            self._meter.tokens(self._completion)

    def ended(self, data: Mapping[str, Any]) -> bool:
        return data.get("type") in self._TERMINAL

    def _response_usage(self, response: object) -> None:
        usage = response.get("usage") if isinstance(response, Mapping) else None
        if not isinstance(usage, Mapping):
            return
        if _is_count(usage.get("input_tokens")):
            self._prompt = usage["input_tokens"]
        if _is_count(usage.get("output_tokens")):
            self._completion = usage["output_tokens"]
        self._cached_in(usage.get("input_tokens_details"), "cached_tokens")


class GeminiRecordTap(_SplitTap):
    """The same, for an upstream that speaks Google's Gemini API natively: each record
    whose candidates carry parts counts one token until ``usageMetadata`` says (the
    candidates' tokens plus the thoughts'); a candidate's ``finishReason`` or an
    ``error`` ends the answer."""

    def chunk(self, data: Mapping[str, Any]) -> None:
        if not self._named:
            self._name(data.get("responseId"))
        if data.get("error"):
            self._error = True
            return
        candidates = data.get("candidates")
        if isinstance(candidates, list):
            bearing = sum(1 for c in candidates if _has_parts(c))
            if bearing:
                self._meter.tokens(bearing)
        self._gemini_usage(data.get("usageMetadata"))

    def body(self, data: Mapping[str, Any]) -> None:
        if data.get("error"):
            self._error = True
            return
        self._name(data.get("responseId"))
        self._meter.first_token()
        self._gemini_usage(data.get("usageMetadata"))
        if self._completion is not None:
            self._meter.tokens(self._completion)

    def ended(self, data: Mapping[str, Any]) -> bool:
        if "error" in data:
            return True
        candidates = data.get("candidates")
        return isinstance(candidates, list) and any(
            isinstance(c, Mapping) and c.get("finishReason") for c in candidates
        )

    def _gemini_usage(self, usage: object) -> None:
        if not isinstance(usage, Mapping):
            return
        if _is_count(usage.get("promptTokenCount")):
            self._prompt = usage["promptTokenCount"]
        self._cached_in(usage, "cachedContentTokenCount")
        answer = usage.get("candidatesTokenCount")
        if _is_count(answer):
            thoughts = usage.get("thoughtsTokenCount")
            self._completion = answer + (thoughts if _is_count(thoughts) else 0)


def _has_parts(candidate: object) -> bool:
    content = candidate.get("content") if isinstance(candidate, Mapping) else None
    parts = content.get("parts") if isinstance(content, Mapping) else None
    return isinstance(parts, list) and bool(parts)


def _carries_content(choice: Mapping[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        for key in ("content", "reasoning_content", "reasoning"):
            value = delta.get(key)
            if value and isinstance(value, str):
                return True
        tool_calls = delta.get("tool_calls")
        return isinstance(tool_calls, list) and bool(tool_calls)
    text = choice.get("text")  # /v1/completions
    return isinstance(text, str) and bool(text)


def _is_count(value: object) -> TypeGuard[int]:
    # bool is an int subclass; a JSON true is not a count
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
