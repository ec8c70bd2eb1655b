"""Events -> Gemini's ``GenerateContentResponse`` records, streamed or folded into one.

Streamed (``streamGenerateContent``), each record carries the new parts of one
candidate: text as it comes, a thought part (``"thought": true``) for reasoning when
``includeThoughts`` asked for it, a function call whole once its arguments are complete
(``args`` an object). A candidate's last record carries its ``finishReason`` and the
``usageMetadata`` (the others leave it out: the same few counters each token). Folded
(``generateContent``), the same parts are joined into one record per response. An error after the first record is one record
``{"error": {"code", "message", "status"}}``; before it, a real status with that body.

Example::

    fmt = GeminiFormatter("smollm2", include_thoughts=False)
    records = [r for e in events for r in fmt.frames(e)] + fmt.end()
    body = fmt.response()       # the same answer as one record
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import orjson
from starlette.responses import Response

from sluice.core.errors import SluiceError, as_sluice_error, spec_for
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

# Google's status name per HTTP status (google.rpc.Code), for the error body.
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS"}


def error_body(error: SluiceError) -> dict[str, Any]:
    status = spec_for(error).status
    return {
        "error": {
            "code": status,
            "message": error.message,
            "status": _STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"),
        }
    }


def error_response(error: SluiceError) -> Response:
    """A pre-stream error: a real status and Google's ``{"error": {...}}``."""
    body = orjson.dumps(error_body(error))
    return Response(body, spec_for(error).status, error.headers(), media_type="application/json")


def error_frame(error: BaseException) -> bytes:
    """An error after the stream began: one ``data:`` record with the error."""
    return b"data: " + orjson.dumps(error_body(as_sluice_error(error))) + b"\n\n"


class _Candidate:
    """One candidate's parts so far (the folded answer): text pieces kept in lists, joined
    once at the end, so a long answer costs no repeated copying."""

    __slots__ = ("calls", "finish", "parts", "tokens")

    def __init__(self) -> None:
        self.parts: list[Any] = []  # [thought?, [pieces]] for text, or a part dict
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, arguments so far]
        self.finish: str | None = None
        self.tokens = 0

    def text(self, piece: str, thought: bool) -> None:
        last = self.parts[-1] if self.parts else None
        if isinstance(last, list) and last[0] is thought:
            last[1].append(piece)
        else:
            self.parts.append([thought, [piece]])

    def folded(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for part in self.parts:
            if isinstance(part, list):
                text: dict[str, Any] = {"text": "".join(part[1])}
                if part[0]:
                    text["thought"] = True
                out.append(text)
            else:
                out.append(part)
        return out


class GeminiFormatter:
    """One response's records (streamed), or its one record (folded)."""

    def __init__(self, model: str, *, include_thoughts: bool, response_id: str | None = None):
        self.model = model
        self.include_thoughts = include_thoughts
        self.id = response_id or secrets.token_urlsafe(12)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._output = 0  # output tokens of every candidate (a Finish's usage corrects)
        self._thoughts = 0  # of those, the reasoning's (from each Finish's usage)
        self._candidates: dict[int, _Candidate] = {}
        self._held: dict[str, Any] | None = None  # the newest parts' candidate record

    def _candidate(self, index: int) -> _Candidate:
        found = self._candidates.get(index)
        if found is None:
            found = self._candidates[index] = _Candidate()
        return found

    # -- the stream --------------------------------------------------------------------

    def frames(self, event: Event) -> list[Frame]:
        if isinstance(event, TextDelta):
            if event.echo:
                return []
            candidate = self._candidate(event.choice)
            candidate.tokens += event.token_count
            self._output += event.token_count
            if not event.text:
                return []
            candidate.text(event.text, False)
            return self._hold(event.choice, {"text": event.text})
        if isinstance(event, ReasoningDelta):
            if not self.include_thoughts or not event.text:
                return []
            self._candidate(event.choice).text(event.text, True)
            return self._hold(event.choice, {"text": event.text, "thought": True})
        if isinstance(event, ToolCallStart):
            self._candidate(event.choice).calls[event.index] = [event.id, event.name, ""]
            return []
        if isinstance(event, ToolCallDelta):
            call = self._candidate(event.choice).calls.get(event.index)
            if call is not None:
                call[2] += event.arguments
            return []
        if isinstance(event, ToolCallEnd):
            candidate = self._candidate(event.choice)
            call = candidate.calls.pop(event.index, None)
            if call is None:
                return []
            call_id, name, arguments = call
            args = _arguments(arguments)
            if args is None:
                candidate.finish = "MALFORMED_FUNCTION_CALL"
                return []
            part = {"functionCall": {"name": name, "args": args, "id": call_id}}
            candidate.parts.append(part)
            return self._hold(event.choice, part)
        if isinstance(event, Start):
            self.prompt_tokens = max(self.prompt_tokens, event.prompt_tokens)
            return []
        if isinstance(event, Progress):
            if event.phase == "prompt_processing":
                self.prompt_tokens = event.total or self.prompt_tokens
                self.cached_tokens = event.cached
            return []
        if isinstance(event, Finish):
            candidate = self._candidate(event.choice)
            if candidate.finish is None:
                candidate.finish = _FINISH.get(event.reason, "OTHER")
            if event.usage is not None:
                self.prompt_tokens = event.usage.prompt_tokens or self.prompt_tokens
                self.cached_tokens = event.usage.cached_tokens
                self._output += event.usage.completion_tokens - candidate.tokens
                candidate.tokens = event.usage.completion_tokens
                self._thoughts += event.usage.reasoning_tokens
            held, self._held = self._held, None
            if held is not None and held["index"] == event.choice:
                # The finish goes with the candidate's last parts (a client may take a
                # record without parts for an empty answer).
                return [Frame(self._record([held | {"finishReason": candidate.finish}]))]
            done = {
                "content": {"role": "model", "parts": []},
                "finishReason": candidate.finish,
                "index": event.choice,
            }
            return [*self._flush(held), Frame(self._record([done]))]
        return []

    def end(self) -> list[Frame]:
        held, self._held = self._held, None
        return self._flush(held)

    def error(self, error: BaseException) -> list[Frame]:
        held, self._held = self._held, None
        return [*self._flush(held), Frame(error_body(as_sluice_error(error)))]

    def _hold(self, choice: int, part: dict[str, Any]) -> list[Frame]:
        """A new part: held until the next event, which may be its candidate's finish;
        the record held before goes out."""
        held = self._held
        self._held = {"content": {"role": "model", "parts": [part]}, "index": choice}
        return [] if held is None else [Frame(self._record([held], usage=False))]

    def _flush(self, held: dict[str, Any] | None) -> list[Frame]:
        return [] if held is None else [Frame(self._record([held]))]

    def _record(self, candidates: list[dict[str, Any]], usage: bool = True) -> dict[str, Any]:
        record: dict[str, Any] = {
            "candidates": candidates,
            "modelVersion": self.model,
            "responseId": self.id,
        }
        if usage:  # a candidate's last record, and the folded answer
            record["usageMetadata"] = self.usage()
        return record

    # -- the folded answer -------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        output = self._output
        thoughts = min(self._thoughts, output)
        return {  # as Gemini counts: the candidates' tokens leave the thoughts out
            "promptTokenCount": self.prompt_tokens,
            "candidatesTokenCount": output - thoughts,
            "totalTokenCount": self.prompt_tokens + output,
            "cachedContentTokenCount": min(self.cached_tokens, self.prompt_tokens),
            "thoughtsTokenCount": thoughts,
        }

    def response(self) -> dict[str, Any]:
        candidates = [
            {
                "content": {"role": "model", "parts": c.folded()},
                "finishReason": c.finish or "STOP",
                "index": i,
            }
            for i, c in sorted(self._candidates.items())
        ]
        return self._record(candidates)


def _arguments(text: str) -> dict[str, Any] | None:
    """A call's arguments as the object Gemini carries; None where they do not parse."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
