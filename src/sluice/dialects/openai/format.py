"""OpenAI wire dialects: ``chat.completion.chunk`` and ``text_completion``.

Pure: events in, frames out. The stream contract (llama.cpp's server, OpenAI's SDKs):

1. chat: a role frame per choice (after validation), then content frames
   without ``role``, then a terminal ``delta: {}`` with ``finish_reason``;
2. with ``stream_options.include_usage`` one ``choices: []`` usage chunk;
3. ``data: [DONE]`` (the last frame of :meth:`end`).

A failure after the first byte is one ``event: error`` frame (:meth:`error`),
and the stream ends there, without ``[DONE]``. Non-streaming bodies are
rendered from the neutral fold (:func:`chat_completion_body`).

Example::

    fmt = ChatStreamFormatter(meta)
    for event in events:
        frames.extend(fmt.frames(event))
    frames.extend(fmt.end())
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.core.backend import StreamMeta
from sluice.core.errors import as_sluice_error, error_frame_payload
from sluice.core.events import (
    Event,
    Finish,
    ReasoningDelta,
    Start,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallStart,
)
from sluice.core.fold import FoldResult
from sluice.core.frames import DONE, Frame, UsageTotals


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """Per-response constants every chunk repeats (pitfall 1: one id, one created)."""

    id: str
    created: int
    model: str
    prompt_owners: frozenset[int]
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False

    @classmethod
    def of(
        cls,
        stream: StreamMeta,
        *,
        chat: bool,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ) -> ResponseMeta:
        """A response's OpenAI constants: a fresh id and time, the answering model."""
        return cls(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=stream.model,
            prompt_owners=stream.prompt_owners,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            logprobs=stream.logprobs,
        )


def chat_logprobs(lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": null}``."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob if lp.logprob is not None else 0.0,
                "bytes": list(lp.bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in lp.top
                ],
            }
            for lp in lps
        ],
        "refusal": None,
    }


def text_logprobs(lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object, offsets counted from ``offset``."""
    tokens: list[str] = []
    offsets: list[int] = []
    for lp in lps:
        tokens.append(lp.token)
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [
            {t.token: t.logprob for t in lp.top} if lp.logprob is not None else None for lp in lps
        ],
        "text_offset": offsets,
    }


class _StreamFormatter:
    object_name = ""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self.usage = UsageTotals(meta.prompt_owners)

    def _chunk(self, choices: list[dict[str, Any]]) -> Frame:
        body: dict[str, Any] = {
            "id": self.meta.id,
            "object": self.object_name,
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.meta.continuous_usage:
            body["usage"] = self.usage.as_dict()
        return Frame(body)

    def _account(self, event: Event) -> None:
        if isinstance(event, Start):
            self.usage.start(event.choice, event.prompt_tokens)
        elif isinstance(event, TextDelta) and not event.echo:
            self.usage.add_tokens(event.choice, event.token_count)
        elif isinstance(event, Finish):
            self.usage.finish(event)

    def end(self) -> list[Frame]:
        """Frames after the last choice finished: the usage chunk if asked, ``[DONE]``."""
        if not self.meta.include_usage:
            return [DONE]
        body = self._chunk([]).data
        assert isinstance(body, dict)
        body["usage"] = self.usage.as_dict()
        return [Frame(body), DONE]

    def error(self, error: BaseException) -> list[Frame]:
        """The in-stream failure: one ``event: error`` frame; nothing follows it."""
        return [Frame(error_frame_payload(as_sluice_error(error)), event="error", ascii=True)]


class ChatStreamFormatter(_StreamFormatter):
    """Events -> ``chat.completion.chunk`` frames."""

    object_name = "chat.completion.chunk"

    def frames(self, event: Event) -> list[Frame]:
        self._account(event)
        if isinstance(event, Start):
            return [self._choice(event.choice, {"role": "assistant"})]
        if isinstance(event, TextDelta):
            if not event.text:
                return []  # never an empty content chunk (pitfall 4)
            lps = chat_logprobs(event.logprobs) if self.meta.logprobs and event.logprobs else None
            return [self._choice(event.choice, {"content": event.text}, logprobs=lps)]
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return []
            # Both names: reasoning_content (DeepSeek, vLLM, llama.cpp) and reasoning (newer).
            return [
                self._choice(
                    event.choice, {"reasoning_content": event.text, "reasoning": event.text}
                )
            ]
        if isinstance(event, ToolCallStart):
            call = {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            return [self._choice(event.choice, {"tool_calls": [call]})]
        if isinstance(event, ToolCallDelta):
            if not event.arguments:
                return []
            call = {"index": event.index, "function": {"arguments": event.arguments}}
            return [self._choice(event.choice, {"tool_calls": [call]})]
        if isinstance(event, Finish):
            return [self._choice(event.choice, {}, finish=event.reason)]
        return []

    def _choice(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        logprobs: dict[str, Any] | None = None,
        finish: str | None = None,
    ) -> Frame:
        return self._chunk(
            [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        )


class TextStreamFormatter(_StreamFormatter):
    """Events -> ``text_completion`` frames (logprobs in every chunk)."""

    object_name = "text_completion"

    def __init__(self, meta: ResponseMeta) -> None:
        super().__init__(meta)
        self._offsets: dict[int, int] = {}

    def frames(self, event: Event) -> list[Frame]:
        self._account(event)
        if isinstance(event, TextDelta):
            if not event.text:
                return []
            offset = self._offsets.get(event.choice, 0)
            lps = None
            if self.meta.logprobs:
                lps = text_logprobs(event.logprobs or (), offset)
            self._offsets[event.choice] = offset + len(event.text)
            return [self._choice(event.choice, event.text, lps, None)]
        if isinstance(event, Finish):
            lps = text_logprobs((), 0) if self.meta.logprobs else None
            return [self._choice(event.choice, "", lps, event.reason)]
        return []

    def _choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None
    ) -> Frame:
        return self._chunk(
            [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]
        )


def _body(
    meta: ResponseMeta, object_name: str, result: FoldResult, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": object_name,
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": result.usage_dict(),
    }


def chat_completion_body(meta: ResponseMeta, result: FoldResult) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` body of a folded response."""
    choices = []
    for index, state in result.ordered():
        content = state.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reasoning = state.reasoning_text
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        calls = state.calls()
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ]
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(state.logprobs) if meta.logprobs else None,
                "finish_reason": state.finish_reason,
            }
        )
    return _body(meta, "chat.completion", result, choices)


def text_completion_body(meta: ResponseMeta, result: FoldResult) -> dict[str, Any]:
    """The non-streaming ``text_completion`` body of a folded response."""
    choices = [
        {
            "text": state.content,
            "index": index,
            "logprobs": text_logprobs(state.logprobs, 0) if meta.logprobs else None,
            "finish_reason": state.finish_reason,
        }
        for index, state in result.ordered()
    ]
    return _body(meta, "text_completion", result, choices)
