"""A Responses stream passed through to an upstream that speaks Responses itself
(``native_apis = ["responses"]``), continued by another replica when its replica drops
it mid-answer.

The Responses API cannot continue an answer (it has no prefill), so the rest comes
through the slot's OpenAI chat: the request as chat messages (``neutral_request``, as the
translated path sends it) with the text so far as the assistant's final message to
continue (``upstream.resume.ChatContinued``). Its chunks become the rest of the first
stream's events: deltas of the item left open (its id, its index), numbered on from the
first stream's last ``sequence_number``, then that item's ``done`` events and the
terminal ``response.completed`` (or ``incomplete``) whose response is the first
stream's with the whole output and usage.

Not continued: a request that names a ``previous_response_id`` (the upstream holds that
history; sluice does not), an answer whose function calls (or other tool items) had
begun, an item with several content parts, an answer at its ``max_output_tokens``.

Example::

    answer = await dispatcher.passthrough(..., resumable=ResponsesPartial)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.core.errors import SluiceError
from sluice.dialects.responses.format import OutputItem, ResponseFields, ResponsesFormatter
from sluice.dialects.responses.schema import parse
from sluice.upstream.codec import upstream_body
from sluice.upstream.resume import ChatContinued, ChatSplice, Continuation, named_event

_OPENINGS = ("response.created", "response.queued", "response.in_progress")
_REASONING_DELTAS = ("response.reasoning_text.delta", "response.reasoning_summary_text.delta")


def _to_chat(body: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The Responses request as the OpenAI chat stream the translated path sends; None
    when it continues a response the upstream stored, or does not translate."""
    if body.get("previous_response_id") or not isinstance(body.get("model"), str):
        return None
    try:
        request = parse(dict(body)).neutral_request([])
    except SluiceError:
        return None
    return upstream_body(request, body["model"])


class ResponsesPartial(ChatContinued):
    """The first stream's events, read: its response, its output items, its last
    sequence number; and the text so far (``partial``)."""

    def __init__(self) -> None:
        super().__init__(_to_chat)
        self.response: dict[str, Any] = {}  # its latest snapshot (created, in progress)
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.seq = -1

    def add_chunk(self, data: Mapping[str, Any]) -> None:
        seq = data.get("sequence_number")
        if isinstance(seq, int) and not isinstance(seq, bool):
            self.seq = max(self.seq, seq)
        kind = data.get("type")
        partial = self.partial
        if kind in _OPENINGS:
            response = data.get("response")
            if isinstance(response, Mapping):
                self.response = dict(response)
        elif kind == "response.output_item.added":
            item = data.get("item")
            item_type = item.get("type") if isinstance(item, Mapping) else None
            if item_type not in ("message", "reasoning") or not isinstance(item, Mapping):
                partial.resumable = False  # a call (or a tool's item) begun
                return
            self.open = OutputItem(item_type, str(item.get("id") or ""))
            self.items.append(self.open)
        elif kind == "response.output_text.delta" or kind in _REASONING_DELTAS:
            delta = data.get("delta")
            item = self.open
            if not isinstance(delta, str) or item is None:
                return
            if data.get("content_index", 0) not in (0, None) or data.get("summary_index", 0):
                partial.resumable = False  # several parts: sluice writes one
            item.pieces.append(delta)
            (partial.content if item.kind == "message" else partial.reasoning).append(delta)
            partial.tokens += 1
        elif kind == "response.function_call_arguments.delta":
            partial.resumable = False
        elif kind == "response.output_item.done":
            if self.open is not None:
                self.open.done = True
            self.open = None

    def splice(self, ask: Continuation) -> ChatSplice:
        return ChatSplice(self.partial, ask.skip, _Continued(self), named_event)


class _Continued(ResponsesFormatter):
    """The formatter as if it had written the first stream: its items, the open one,
    its sequence numbers; the response object the first stream's, its status, output
    and usage the whole answer's."""

    def __init__(self, first: ResponsesPartial) -> None:
        base = first.response
        super().__init__(ResponseFields(id=str(base.get("id") or ""), model=""))
        self._base = base
        self.status = "in_progress"
        self.items = first.items
        self._open = first.open
        self.seq = first.seq + 1

    def response(self) -> dict[str, Any]:
        own = super().response()
        changed = ("status", "error", "incomplete_details", "output", "usage")
        return {**self._base, **{k: own[k] for k in changed}}
