"""A Gemini stream (``alt=sse``) passed through to an upstream that speaks the Gemini API
itself (``native_apis = ["gemini"]``), continued by another replica when its replica
drops it mid-answer.

The Gemini API cannot continue an answer, so the rest comes through the slot's OpenAI
chat: the request as chat messages (``to_request``, as the translated path sends it)
with the text so far as the assistant's final message to continue
(``upstream.resume.ChatContinued``). Its chunks become the rest of the first stream's
records, with its ``responseId`` and ``modelVersion``; the last carries the finish and
the whole answer's ``usageMetadata``.

Not continued: an answer whose function calls had begun, or with several candidates,
or at its ``maxOutputTokens``; a stream sent as one JSON array (no ``alt=sse``).

Example::

    answer = await dispatcher.passthrough(..., resumable=GeminiPartial)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from sluice.core.errors import SluiceError
from sluice.dialects.gemini.format import GeminiFormatter
from sluice.dialects.gemini.schema import GenerateContentRequest, parse
from sluice.upstream.codec import upstream_body
from sluice.upstream.resume import ChatContinued, ChatSplice, Continuation


def _request(body: Mapping[str, Any]) -> GenerateContentRequest | None:
    try:
        return parse(dict(body), GenerateContentRequest)
    except SluiceError:
        return None


class GeminiPartial(ChatContinued):
    """The first stream's records, read: its ids, and the text so far (``partial``)."""

    def __init__(self) -> None:
        super().__init__(self._to_chat)
        self.names: dict[str, Any] = {}  # responseId, modelVersion
        self.include_thoughts = False

    def _to_chat(self, body: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The Gemini request as the OpenAI chat stream the translated path sends."""
        model, request = body.get("model"), _request(body)
        if not isinstance(model, str) or request is None:
            return None
        self.include_thoughts = request.include_thoughts
        try:
            neutral = request.to_request(model)
        except SluiceError:
            return None
        return upstream_body(neutral, model)

    def add_chunk(self, data: Mapping[str, Any]) -> None:
        for name in ("responseId", "modelVersion"):
            if name in data and name not in self.names:
                self.names[name] = data[name]
        candidates = data.get("candidates")
        if not isinstance(candidates, list):
            return
        partial = self.partial
        for candidate in candidates:
            if not isinstance(candidate, Mapping):
                continue
            if candidate.get("index", 0) != 0:
                partial.resumable = False
                continue
            content = candidate.get("content")
            parts = content.get("parts") if isinstance(content, Mapping) else None
            for part in parts if isinstance(parts, list) else ():
                if not isinstance(part, Mapping):
                    continue
                if "functionCall" in part:
                    partial.resumable = False
                text = part.get("text")
                if isinstance(text, str) and text:
                    (partial.reasoning if part.get("thought") else partial.content).append(text)
            if parts:
                partial.tokens += 1  # one a record, as the tap counts

    def splice(self, ask: Continuation) -> ChatSplice:
        formatter = GeminiFormatter(
            str(self.names.get("modelVersion") or ""),
            include_thoughts=self.include_thoughts,
            response_id=self.names.get("responseId"),
        )
        return ChatSplice(self.partial, ask.skip, formatter, _record)


def _record(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\r\n\r\n"  # Google's framing
