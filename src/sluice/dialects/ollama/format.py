"""Events -> Ollama's NDJSON lines (``/api/chat``, ``/api/generate``), or one body.

One formatter serves both: streamed, each event gives the lines to send (text and
thinking as deltas, a tool call whole once its arguments are complete, arguments as
an object); the last line has ``done: true``, ``done_reason`` and the counters
(durations in nanoseconds). Not streamed, :meth:`OllamaFormatter.body` is the same
answer in one object. An error after the first line is a line ``{"error": "..."}``.

Example::

    f = OllamaFormatter("smollm2", chat=True, started=time.monotonic())
    for event in events:
        lines = f.lines(event)
    last = f.end()
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from starlette.responses import Response

from sluice.core.errors import SluiceError, as_sluice_error, spec_for
from sluice.core.events import (
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)

NDJSON = "application/x-ndjson"


def dumps_line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def error_response(error: SluiceError) -> Response:
    """A pre-stream error: a real status and Ollama's ``{"error": "..."}``."""
    body = json.dumps({"error": error.message}, ensure_ascii=False).encode()
    return Response(body, spec_for(error).status, error.headers(), media_type="application/json")


def error_line(error: BaseException) -> bytes:
    """An error after the stream began: one line, the status stays 200."""
    return dumps_line({"error": as_sluice_error(error).message})


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as the object Ollama's clients expect."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"arguments": text}  # not JSON: kept, under a name, rather than lost
    return value if isinstance(value, dict) else {"value": value}


def _logprobs(entries: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.bytes),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in e.top
            ],
        }
        for e in entries
    ]


class OllamaFormatter:
    """One answer of ``/api/chat`` (``chat``) or ``/api/generate``, line by line."""

    def __init__(
        self, model: str, *, chat: bool, started: float, load_seconds: float = 0.0
    ) -> None:
        self.model = model
        self.chat = chat
        self.started = started  # time.monotonic() when the request arrived
        self.load_seconds = load_seconds
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finished: list[dict[str, Any]] = []  # tool calls in the order they ended
        self.reason = "stop"
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.prompt_ms = 0.0
        self.generation_ms = 0.0

    # -- streaming ----------------------------------------------------------------

    def lines(self, event: Event) -> list[bytes]:
        match event:
            case TextDelta(text=text, logprobs=logprobs, echo=False) if text or logprobs:
                self.text.append(text)
                extra = {"logprobs": _logprobs(logprobs)} if logprobs else {}
                if logprobs:
                    self.logprobs.extend(extra["logprobs"])
                return [self._line(content=text, **extra)]
            case ReasoningDelta(text=text) if text:
                self.thinking.append(text)
                return [self._line(content="", thinking=text)]
            case ToolCallStart(index=index, id=call_id, name=name):
                self.calls[index] = {"id": call_id, "name": name, "arguments": []}
            case ToolCallDelta(index=index, arguments=arguments):
                if index in self.calls:
                    self.calls[index]["arguments"].append(arguments)
            case ToolCallEnd(index=index) if index in self.calls:
                call = self._call(self.calls.pop(index))
                self.finished.append(call)
                return [self._line(content="", tool_calls=[call])]
            case Progress(phase="model_load", done=done, total=total, elapsed=elapsed):
                if done >= total:
                    self.load_seconds = elapsed
            case Start(prompt_tokens=prompt_tokens):
                self.prompt_tokens = prompt_tokens
            case Finish(reason=reason, usage=usage):
                self.reason = "length" if reason == "length" else "stop"
                if usage is not None:
                    self.prompt_tokens = usage.prompt_tokens
                    self.completion_tokens = usage.completion_tokens
                    self.prompt_ms = usage.prompt_ms
                    self.generation_ms = usage.generation_ms
        return []

    def end(self) -> list[bytes]:
        """The last line: done, the reason and the counters."""
        return [dumps_line(self._done(self._payload(content="")))]

    def error(self, error: BaseException) -> list[bytes]:
        return [error_line(error)]

    # -- not streamed ---------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The whole answer in one object (``stream: false``)."""
        extra: dict[str, Any] = {}
        if self.thinking:
            extra["thinking"] = "".join(self.thinking)
        if self.finished:
            extra["tool_calls"] = self.finished
        out = self._done(self._payload(content="".join(self.text), **extra))
        if self.logprobs:
            out["logprobs"] = self.logprobs
        return out

    # -- helpers --------------------------------------------------------------------

    def _call(self, call: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": call["id"],
            "function": {"name": call["name"], "arguments": _arguments("".join(call["arguments"]))},
        }

    def _payload(self, *, content: str, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": now_rfc3339()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if "thinking" in extra:
                message["thinking"] = extra.pop("thinking")
            if "tool_calls" in extra:
                message["tool_calls"] = extra.pop("tool_calls")
            out["message"] = message
        else:
            out["response"] = content
            if "thinking" in extra:
                out["thinking"] = extra.pop("thinking")
        out.update(extra)
        return out

    def _line(self, *, content: str, **extra: Any) -> bytes:
        out = self._payload(content=content, **extra)
        out["done"] = False
        return dumps_line(out)

    def _done(self, out: dict[str, Any]) -> dict[str, Any]:
        total = time.monotonic() - self.started
        out.update(
            done=True,
            done_reason=self.reason,
            total_duration=int(total * 1e9),
            load_duration=int(self.load_seconds * 1e9),
            prompt_eval_count=self.prompt_tokens,
            prompt_eval_duration=int(self.prompt_ms * 1e6),
            eval_count=self.completion_tokens,
            eval_duration=int(self.generation_ms * 1e6),
        )
        return out
