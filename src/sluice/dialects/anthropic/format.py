"""Anthropic's Messages stream and body: events in, named SSE frames (and the body) out.

One object serves both: fed every event it answers the stream's frames, and
:meth:`MessagesFormatter.message` is the non-streaming body, built by the same
code from the same events. The stream's contract (Anthropic's streaming reference,
and what Claude Code's accumulator needs):

1. ``message_start`` once the request is admitted (``content: []``, the prompt's usage:
   a local model's admission says how much of it the prompt cache holds);
2. content blocks numbered 0, 1, 2 ... in order: each ``content_block_start``
   before its first ``content_block_delta`` and its ``content_block_stop`` before
   the next block starts (a delta for a block never started is Claude Code's
   "Content block not found"); text as ``text_delta``, reasoning as a ``thinking``
   block (``thinking_delta``, one ``signature_delta`` before it stops), a tool call as
   a ``tool_use`` block whose input streams as ``input_json_delta`` fragments;
3. ``message_delta`` with ``stop_reason``, ``stop_sequence`` and the cumulative
   usage, then ``message_stop``.

A failure after the start is one ``event: error`` frame, and the stream ends.
``ping`` events are the keep-alive (:data:`PING`), not SSE comments.

Usage follows Anthropic's split: ``input_tokens`` are the prompt tokens not read
from the prompt cache, ``cache_read_input_tokens`` those that were; their sum is
the prompt. ``message_start`` waits for the local engine's admission (its first
``Progress``), which knows the split; an upstream's stream says it only at the end,
so there ``message_start`` counts the whole prompt as input and ``message_delta``
corrects it.

Example::

    fmt = MessagesFormatter(model="smollm2", max_tokens=64)
    frames = []
    for event in events:
        frames.extend(fmt.frames(event))
    frames.extend(fmt.end())
    body = fmt.message()          # the same message, as the non-streaming answer
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from typing import Any, Literal

from starlette.responses import Response

from sluice.core.errors import ContextOverflow, SluiceError, as_sluice_error, spec_for
from sluice.core.events import (
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from sluice.core.frames import Frame

log = logging.getLogger("sluice.api")

PING = b'event: ping\ndata: {"type":"ping"}\n\n'

StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]

# Anthropic's error ``type`` per HTTP status of sluice's error table (core/errors.py).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for a call id of the backend (the same id both ways:
    the client sends it back in its ``tool_result``)."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + call_id.removeprefix("call_")


def error_body(error: SluiceError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for ``error``.

    A prompt over the context says "prompt is too long", the words Claude Code
    looks for before it compacts the conversation.
    """
    status = spec_for(error).status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if isinstance(error, ContextOverflow):
        message = (
            f"prompt is too long: {error.prompt_tokens} tokens > {error.n_ctx} maximum "
            "(the model's context window)"
        )
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: SluiceError) -> Response:
    """A pre-stream error: the table's status, Anthropic's body."""
    body = json.dumps(error_body(error), ensure_ascii=True, separators=(",", ":"))
    return Response(body, spec_for(error).status, error.headers(), media_type="application/json")


def error_frame(error: BaseException) -> bytes:
    """An in-stream error as encoded bytes (for a failure the formatter never saw)."""
    payload = json.dumps(error_body(as_sluice_error(error)), ensure_ascii=True)
    return f"event: error\ndata: {payload}\n\n".encode()


def _frame(kind: str, **fields: Any) -> Frame:
    return Frame({"type": kind, **fields}, event=kind)


def _text_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients send it back; sluice does
    not check it): a digest of the text, so the same thinking signs the same."""
    return "sluice-" + hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class MessagesFormatter:
    """Events of one response -> Anthropic's stream frames; also the body.

    ``model`` is named in the message as the client asked for it; ``max_tokens``
    tells a stop at the request's limit (``max_tokens``) from one at the end of the
    context (``model_context_window_exceeded``). Only choice 0 exists here.
    """

    def __init__(self, *, model: str, max_tokens: int, message_id: str | None = None) -> None:
        self.id = message_id or new_message_id()
        self.model = model
        self.max_tokens = max_tokens
        self.content: list[dict[str, Any]] = []  # each block as it started
        # each block's text, thinking or input JSON, in the pieces it came in (joined
        # once at the end: appending to one string would copy it at every token)
        self._pieces: list[list[str]] = []
        self._open: Literal["text", "thinking", "tool_use"] | None = None
        self._calls: dict[int, int] = {}  # tool call index -> its block's index
        self._open_call: int | None = None
        self._started = False
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self._counted_output = 0  # from the deltas, until a Finish's usage says
        self.stop_reason: StopReason | None = None
        self.stop_sequence: str | None = None
        self._finished = False

    # -- the stream ------------------------------------------------------------------

    def start(self) -> list[Frame]:
        """``message_start``: sent once, before anything else of the message."""
        if self._started:
            return []
        self._started = True
        message = self._message_head()
        message["usage"] = self._usage()
        return [_frame("message_start", message=message)]

    def frames(self, event: Event) -> list[Frame]:
        if getattr(event, "choice", 0) != 0 or self._finished:
            return []
        if self._open == "text" and type(event) is TextDelta and not event.echo:
            # The path of nearly every event: one more piece of the open text block.
            self._counted_output += event.token_count
            if not event.text:
                return []
            self._pieces[-1].append(event.text)
            delta = {"type": "text_delta", "text": event.text}
            return [Frame(_text_delta(len(self.content) - 1, delta), event="content_block_delta")]
        out: list[Frame] = []
        if isinstance(event, Start):
            self.prompt_tokens = event.prompt_tokens
            return []  # message_start waits for the admission: it knows the cache
        if isinstance(event, Progress):
            if event.phase == "prompt_processing" and not self._started:
                self.prompt_tokens = event.total or self.prompt_tokens
                self.cached_tokens = event.cached
            return self.start()
        out.extend(self.start())
        if isinstance(event, TextDelta):
            if event.echo:
                return out
            self._counted_output += event.token_count
            if event.text:
                out.extend(self._delta("text", {"type": "text_delta", "text": event.text}))
        elif isinstance(event, ReasoningDelta):
            if event.text:
                delta = {"type": "thinking_delta", "thinking": event.text}
                out.extend(self._delta("thinking", delta))
        elif isinstance(event, ToolCallStart):
            out.extend(self._close())
            block = {
                "type": "tool_use",
                "id": tool_use_id(event.id),
                "name": event.name,
                "input": {},
            }
            self._calls[event.index] = len(self.content)
            self._open_call = event.index
            out.extend(self._open_block("tool_use", block))
        elif isinstance(event, ToolCallDelta):
            out.extend(self._arguments_delta(event))
        elif isinstance(event, ToolCallEnd):
            if self._open_call == event.index:
                out.extend(self._close())
        elif isinstance(event, Finish):
            out.extend(self._close())
            out.extend(self._finish(event))
        return out

    def end(self) -> list[Frame]:
        """After the last event: ``message_stop`` (``message_delta`` first, if no
        Finish came)."""
        out = self.start()
        if not self._finished:
            out.extend(self._close())
            out.extend(self._finish(None))
        out.append(_frame("message_stop"))
        return out

    def error(self, error: BaseException) -> list[Frame]:
        """The in-stream failure: one ``event: error`` frame; nothing follows it."""
        return [Frame(error_body(as_sluice_error(error)), event="error", ascii=True)]

    # -- the body ----------------------------------------------------------------------

    def message(self) -> dict[str, Any]:
        """The whole message: the non-streaming answer."""
        body = self._message_head()
        body["content"] = [self._finished_block(i, b) for i, b in enumerate(self.content)]
        body["stop_reason"] = self.stop_reason
        body["stop_sequence"] = self.stop_sequence
        body["usage"] = self._usage()
        return body

    # -- blocks ------------------------------------------------------------------------

    def _message_head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
        }

    def _open_block(
        self, kind: Literal["text", "thinking", "tool_use"], block: dict[str, Any]
    ) -> list[Frame]:
        index = len(self.content)
        self.content.append(block)
        self._pieces.append([])
        self._open = kind
        return [_frame("content_block_start", index=index, content_block=block)]

    def _delta(self, kind: Literal["text", "thinking"], delta: dict[str, Any]) -> list[Frame]:
        out: list[Frame] = []
        if self._open != kind:
            out.extend(self._close())
            empty = {"type": "text", "text": ""}
            if kind == "thinking":
                empty = {"type": "thinking", "thinking": "", "signature": ""}
            out.extend(self._open_block(kind, empty))
        self._pieces[-1].append(delta[kind])
        out.append(_frame("content_block_delta", index=len(self.content) - 1, delta=delta))
        return out

    def _arguments_delta(self, event: ToolCallDelta) -> list[Frame]:
        if not event.arguments:
            return []
        if event.index != self._open_call or self._open != "tool_use":
            # A call whose block is already stopped (an upstream that interleaves
            # parallel calls): Anthropic's stream cannot reopen a block.
            log.warning("tool call %d: arguments after its block stopped, dropped", event.index)
            return []
        self._pieces[self._calls[event.index]].append(event.arguments)
        delta = {"type": "input_json_delta", "partial_json": event.arguments}
        return [_frame("content_block_delta", index=self._calls[event.index], delta=delta)]

    def _close(self) -> list[Frame]:
        if self._open is None:
            return []
        index = len(self.content) - 1
        out: list[Frame] = []
        if self._open == "thinking":
            signature = _signature("".join(self._pieces[index]))
            self.content[index] = {**self.content[index], "signature": signature}
            delta = {"type": "signature_delta", "signature": signature}
            out.append(_frame("content_block_delta", index=index, delta=delta))
        out.append(_frame("content_block_stop", index=index))
        self._open = None
        self._open_call = None
        return out

    def _finished_block(self, index: int, block: dict[str, Any]) -> dict[str, Any]:
        whole = "".join(self._pieces[index])
        kind = block["type"]
        if kind == "tool_use":
            return {**block, "input": _tool_input(whole)}
        return {**block, kind: whole}

    # -- the end -----------------------------------------------------------------------

    def _finish(self, event: Finish | None) -> list[Frame]:
        self._finished = True
        usage = event.usage if event is not None else None
        if usage is not None:
            self.prompt_tokens = usage.prompt_tokens or self.prompt_tokens
            self.cached_tokens = usage.cached_tokens
            self.output_tokens = usage.completion_tokens
        else:
            self.output_tokens = self._counted_output
        self.stop_reason, self.stop_sequence = self._stop(event)
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [_frame("message_delta", delta=delta, usage=self._usage())]

    def _stop(self, event: Finish | None) -> tuple[StopReason, str | None]:
        if self._calls:
            return "tool_use", None
        if event is None:
            return "end_turn", None
        if event.reason == "length":
            if self.output_tokens < self.max_tokens:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        if event.reason == "stop" and event.stop_string is not None:
            return "stop_sequence", event.stop_string
        if event.reason == "tool_calls":
            return "tool_use", None
        return "end_turn", None

    def _usage(self) -> dict[str, Any]:
        cached = min(self.cached_tokens, self.prompt_tokens)
        return {
            "input_tokens": self.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": self.output_tokens,
        }


def _tool_input(arguments: str) -> Any:
    """A call's streamed arguments as the block's ``input`` object."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw_arguments": arguments}  # never lose what the model wrote
    return value if isinstance(value, dict) else {"_value": value}
