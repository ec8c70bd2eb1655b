"""OpenAI's Responses stream and response object: events in, numbered SSE frames out.

One object serves both: fed every event it answers the stream's frames, and
:meth:`ResponsesFormatter.response` is the response object (the non-streaming
answer, what ``GET /v1/responses/{id}`` returns, and what the terminal event
carries), built by the same code from the same events. The stream:

1. ``response.created``, (``response.queued`` in background mode),
   ``response.in_progress``;
2. each output item, ``output_index`` 0, 1, ...: ``response.output_item.added``,
   then a message's ``response.content_part.added``, ``response.output_text.delta``
   (with ``logprobs: []``), ``response.output_text.done``,
   ``response.content_part.done``; a function call's
   ``response.function_call_arguments.delta`` / ``.done``; reasoning's
   ``response.reasoning_text.delta`` / ``.done``; then
   ``response.output_item.done`` with the whole item. An item's ``id`` (and a
   call's ``call_id``) is the same in every event and in the final response;
3. exactly one terminal event: ``response.completed``, ``response.incomplete``
   (``max_output_tokens``) or ``response.failed`` (``error.code``, e.g.
   ``context_length_exceeded``). A cancelled response gets no terminal event:
   its status, retrieved, says ``cancelled``, and its followers get ``response.cancelled``.

Every frame's data has ``type`` (also the SSE event name) and ``sequence_number``,
from 0, one more per frame.

Example::

    fmt = ResponsesFormatter(ResponseFields(id="resp_1", model="smollm2", ...))
    frames = fmt.start()
    for event in events:
        frames += fmt.frames(event)
    frames += fmt.end()
    fmt.response()["status"]      # "completed"
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.responses import Response

from sluice.core.errors import ContextOverflow, SluiceError, as_sluice_error, spec_for
from sluice.core.events import (
    Event,
    Finish,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from sluice.core.frames import Frame
from sluice.server.sse import error_response as openai_error_response

RESPONSE_PREFIX = "resp_"


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(24)


@dataclass(slots=True)
class ResponseFields:
    """What the response object echoes of its request, and its identity."""

    id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    background: bool = False
    store: bool = True
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = field(default_factory=lambda: {"effort": None, "summary": None})
    metadata: dict[str, Any] = field(default_factory=dict)
    truncation: str = "disabled"
    user: str | None = None


@dataclass(slots=True)
class OutputItem:
    """One item of a response's output as it is written: a message, a function call or
    reasoning, its text so far (``pieces``); ``whole()`` is its object. (Also what
    ``resume.py`` reads a passed-through stream's items into.)"""

    kind: Literal["message", "function_call", "reasoning"]
    id: str
    pieces: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    done: bool = False

    def whole(self) -> dict[str, Any]:
        text = "".join(self.pieces)
        status = "completed" if self.done else "in_progress"
        if self.kind == "message":
            content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            return {
                "type": "message",
                "id": self.id,
                "status": status,
                "role": "assistant",
                "content": content,
            }
        if self.kind == "function_call":
            return {
                "type": "function_call",
                "id": self.id,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": text,
                "status": status,
            }
        return {
            "type": "reasoning",
            "id": self.id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }


def error_object(error: SluiceError) -> dict[str, Any]:
    """A failed response's ``error``: ``{code, message}`` (a context overflow's code is
    ``context_length_exceeded``, which Codex shows as a context error)."""
    spec = spec_for(error)
    code = spec.code or spec.type
    if isinstance(error, ContextOverflow):
        code = "context_length_exceeded"
    return {"code": code, "message": error.message}


# The neutral request's field names that this dialect spells otherwise.
_WIRE_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}


def error_response(error: SluiceError) -> Response:
    """A pre-stream error: OpenAI's body, with the field named as this dialect names it
    (a context overflow is about ``input``, not ``messages``)."""
    if error.param in _WIRE_PARAMS:
        error.param = _WIRE_PARAMS[error.param]
    return openai_error_response(error)


class ResponsesFormatter:
    """Events of one response -> numbered Responses frames; also the response object."""

    def __init__(self, fields: ResponseFields) -> None:
        self.fields = fields
        self.status: str = "queued" if fields.background else "in_progress"
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._calls: dict[int, OutputItem] = {}
        self.seq = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.reasoning_tokens = 0
        self._counted = 0
        self.failure: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self._usage_known = False
        self._ended = False

    # -- the stream --------------------------------------------------------------------

    def _frame(self, kind: str, **data: Any) -> Frame:
        frame = Frame({"type": kind, "sequence_number": self.seq, **data}, event=kind)
        self.seq += 1
        return frame

    def start(self) -> list[Frame]:
        """``response.created`` (``queued`` first in background mode), ``in_progress``."""
        out = [self._frame("response.created", response=self.response())]
        if self.fields.background:
            out.append(self._frame("response.queued", response=self.response()))
        self.status = "in_progress"
        out.append(self._frame("response.in_progress", response=self.response()))
        return out

    def frames(self, event: Event) -> list[Frame]:
        if getattr(event, "choice", 0) != 0 or self._ended:
            return []
        item = self._open
        if item is not None and item.kind == "message" and type(event) is TextDelta:
            self._counted += event.token_count  # the common case: more of the open text
            return self._text(item, event.text) if event.text else []
        if isinstance(event, Start):
            self.prompt_tokens = event.prompt_tokens
            return []
        if isinstance(event, TextDelta):
            if event.echo:
                return []
            self._counted += event.token_count
            if not event.text:
                return []
            out = self._close()
            message = self._add("message", "msg_")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._open_item(message)
            out.append(
                self._frame(
                    "response.content_part.added",
                    item_id=message.id,
                    output_index=self._index(message),
                    content_index=0,
                    part=part,
                )
            )
            return out + self._text(message, event.text)
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return []
            out = []
            thinking = item
            if thinking is None or thinking.kind != "reasoning":
                out += self._close()
                thinking = self._add("reasoning", "rs_")
                out += self._open_item(thinking)
            thinking.pieces.append(event.text)
            out.append(
                self._frame(
                    "response.reasoning_text.delta",
                    item_id=thinking.id,
                    output_index=self._index(thinking),
                    content_index=0,
                    delta=event.text,
                )
            )
            return out
        if isinstance(event, ToolCallStart):
            out = self._close()
            new = self._add("function_call", "fc_")
            new.call_id, new.name = event.id, event.name
            self._calls[event.index] = new
            return out + self._open_item(new)
        if isinstance(event, ToolCallDelta):
            call = self._calls.get(event.index)
            if call is None or call.done or not event.arguments:
                return []
            call.pieces.append(event.arguments)
            if call is not self._open:  # interleaved calls: the arguments still count
                return []
            return [
                self._frame(
                    "response.function_call_arguments.delta",
                    item_id=call.id,
                    output_index=self._index(call),
                    delta=event.arguments,
                )
            ]
        if isinstance(event, ToolCallEnd):
            ended = self._calls.get(event.index)
            return self._close() if ended is not None and ended is self._open else []
        if isinstance(event, Finish):
            out = self._close()
            if event.usage is not None:
                self._usage_known = True
                self.prompt_tokens = event.usage.prompt_tokens or self.prompt_tokens
                self.cached_tokens = event.usage.cached_tokens
                self.output_tokens = event.usage.completion_tokens
                self.reasoning_tokens = event.usage.reasoning_tokens
            if event.reason == "length":
                self.incomplete = {"reason": "max_output_tokens"}
            return out
        return []

    def end(self) -> list[Frame]:
        """The terminal event: ``response.completed`` or ``response.incomplete``."""
        if self._ended:
            return []
        out = self._close()
        self._ended = True
        if not self._usage_known:
            self.output_tokens = self._counted
        self.status = "incomplete" if self.incomplete else "completed"
        kind = "response.incomplete" if self.incomplete else "response.completed"
        return out + [self._frame(kind, response=self.response())]

    def error(self, error: BaseException) -> list[Frame]:
        """A failure after the start: ``response.failed`` with the error."""
        if self._ended:
            return []
        out = self._close()
        self._ended = True
        self.status = "failed"
        self.failure = error_object(as_sluice_error(error))
        if not self._usage_known:
            self.output_tokens = self._counted
        return out + [self._frame("response.failed", response=self.response())]

    @property
    def ended(self) -> bool:
        return self._ended

    def cancel(self) -> list[Frame]:
        """Cancelled (``POST .../cancel``, ``/v1/requests/{id}/cancel``, a stream dropped
        past its grace): the items open so far closed, then the terminal
        ``response.cancelled`` (status ``cancelled``) for whoever still follows."""
        if self._ended:
            return []
        out = self._close()
        self._ended = True
        self.status = "cancelled"
        if not self._usage_known:
            self.output_tokens = self._counted
        return out + [self._frame("response.cancelled", response=self.response())]

    # -- the response object -----------------------------------------------------------

    def response(self) -> dict[str, Any]:
        f = self.fields
        cached = min(self.cached_tokens, self.prompt_tokens)
        usage = None
        if self.status not in ("queued", "in_progress"):
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.prompt_tokens + self.output_tokens,
            }
        return {
            "id": f.id,
            "object": "response",
            "created_at": f.created_at,
            "status": self.status,
            "background": f.background,
            "error": self.failure,
            "incomplete_details": self.incomplete,
            "instructions": f.instructions,
            "max_output_tokens": f.max_output_tokens,
            "model": f.model,
            "output": [item.whole() for item in self.items],
            "parallel_tool_calls": f.parallel_tool_calls,
            "previous_response_id": f.previous_response_id,
            "reasoning": f.reasoning,
            "store": f.store,
            "temperature": f.temperature,
            "text": f.text,
            "tool_choice": f.tool_choice,
            "tools": f.tools,
            "top_p": f.top_p,
            "truncation": f.truncation,
            "usage": usage,
            "user": f.user,
            "metadata": f.metadata,
        }

    # -- items -------------------------------------------------------------------------

    def _add(
        self, kind: Literal["message", "function_call", "reasoning"], prefix: str
    ) -> OutputItem:
        item = OutputItem(kind, new_id(prefix))
        self.items.append(item)
        return item

    def _index(self, item: OutputItem) -> int:
        return self.items.index(item) if item is not self.items[-1] else len(self.items) - 1

    def _open_item(self, item: OutputItem) -> list[Frame]:
        self._open = item
        return [
            self._frame(
                "response.output_item.added", output_index=self._index(item), item=item.whole()
            )
        ]

    def _text(self, item: OutputItem, text: str) -> list[Frame]:
        item.pieces.append(text)
        return [
            self._frame(
                "response.output_text.delta",
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        ]

    def _close(self) -> list[Frame]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = self._index(item)
        text = "".join(item.pieces)
        out: list[Frame] = []
        if item.kind == "message":
            out.append(
                self._frame(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(
                self._frame(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        elif item.kind == "function_call":
            out.append(
                self._frame(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=text,
                )
            )
        else:
            out.append(
                self._frame(
                    "response.reasoning_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
        item.done = True
        out.append(self._frame("response.output_item.done", output_index=index, item=item.whole()))
        return out
