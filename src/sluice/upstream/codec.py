"""Translation between sluice's neutral request/events and an upstream's OpenAI wire.

An upstream slot (llama-server, vLLM, SGLang, Ollama, another sluice) speaks
OpenAI. For an OpenAI request its bytes pass through unchanged; every other
dialect needs the upstream to look like any backend: ``open(request)`` ->
neutral events. This module is that translation, pure (no networking):

* :func:`upstream_body`: a :class:`GenerationRequest` as an OpenAI streaming
  body (the inverse of ``dialects/openai/schema.py``'s ``to_request``);
* :class:`ChunkDecoder`: the upstream's parsed ``data:`` chunks -> events;
* :func:`error_from_response`: a non-2xx answer before streaming -> a typed error;
* :func:`stream_meta`: the response's :class:`StreamMeta`.

Example::

    path, body = upstream_body(request, "Qwen/Qwen2.5-7B-Instruct")
    decoder = ChunkDecoder(chat=request.is_chat)
    for chunk in parsed_data_chunks:       # json.loads of each ``data:`` but [DONE]
        events.extend(decoder.feed(chunk))
    events.extend(decoder.end())
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.core.backend import StreamMeta
from sluice.core.errors import SluiceError, UpstreamFailed, UpstreamMalformed, UpstreamRejected
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    FinishReason,
    ReasoningDelta,
    Start,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    TopLogprob,
    Usage,
)
from sluice.core.request import GenerationRequest

CHAT_PATH = "/chat/completions"
TEXT_PATH = "/completions"

# llama.cpp's COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: a regex matched against the output
# so far, the same semantics sluice's own lazy grammars have (llama_runner passes the
# triggers to llama_sampler_init_grammar_lazy_patterns).
_TRIGGER_PATTERN = 2
_MAX_ERROR_TEXT = 2000  # a plain-text error body can be a whole HTML page

# -- request -------------------------------------------------------------------------


def upstream_body(request: GenerationRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The path (under the upstream's ``/v1``) and OpenAI JSON body for ``request``.

    Always streaming with usage: the decoder needs the upstream's token counts,
    and a non-streaming answer is a fold over the stream anyway. Fields at their
    default are left out so that a strict server (OpenAI itself) never sees a
    field it does not know unless the client asked for that feature, and so
    that servers with their own defaults (vLLM applies the model's
    ``generation_config``) keep them.
    """
    body: dict[str, Any] = {"model": model}
    if request.is_chat:
        path = CHAT_PATH
        body["messages"] = [_message(m) for m in request.messages or ()]
        for key, value in (
            ("tools", request.tools),
            ("tool_choice", request.tool_choice),
            ("parallel_tool_calls", request.parallel_tool_calls),
            ("response_format", request.response_format),
            ("reasoning_effort", request.reasoning_effort),
            # llama-server's (and sluice's) per-request reasoning budget
            ("thinking_budget_tokens", request.reasoning_budget),
            # llama-server's and vLLM's name for extra chat template variables
            ("chat_template_kwargs", request.template_kwargs),
        ):
            if value is not None:
                body[key] = value
        if request.continue_final:  # vLLM's, SGLang's and llama-server's names
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        if request.logprobs is not None:
            body["logprobs"] = True
            if request.logprobs > 0:
                body["top_logprobs"] = request.logprobs
    else:
        path = TEXT_PATH
        prompts = list(request.prompts or ())
        # One prompt goes as itself: not every server takes a list of prompts.
        body["prompt"] = prompts[0] if len(prompts) == 1 else prompts
        if request.logprobs is not None:
            body["logprobs"] = request.logprobs
        if request.echo:
            body["echo"] = True
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if request.max_tokens is not None:
        # max_tokens, not max_completion_tokens: every OpenAI-compatible server takes it.
        body["max_tokens"] = request.max_tokens
    if request.stop:
        body["stop"] = list(request.stop)
    if request.n != 1:
        body["n"] = request.n
    body.update(_sampling(request))
    return path, body


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """A neutral message as an OpenAI one: a copy, tool-call arguments as JSON text."""
    out = dict(message)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_wire_call(c) if isinstance(c, dict) else c for c in calls]
    return out


def _wire_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if isinstance(fn, dict) and not isinstance(fn.get("arguments", ""), str):
        # Chat templates accept an object, the OpenAI wire only a JSON string.
        return {**call, "function": {**fn, "arguments": json.dumps(fn["arguments"])}}
    return call


def _sampling(request: GenerationRequest) -> dict[str, Any]:
    s = request.sampling
    out: dict[str, Any] = {}
    # Fields the client left out (None) are not sent: the upstream's own defaults apply.
    if s.temperature is not None:
        out["temperature"] = s.temperature
    if s.top_p is not None:
        out["top_p"] = s.top_p
    if s.presence_penalty != 0.0:
        out["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty != 0.0:
        out["frequency_penalty"] = s.frequency_penalty
    if s.seed is not None:
        out["seed"] = s.seed
    if s.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    # llama.cpp / vLLM / SGLang extensions, only when asked for (strict servers reject them).
    if s.top_k is not None:
        out["top_k"] = s.top_k
    if s.min_p is not None:
        out["min_p"] = s.min_p
    if s.repeat_penalty is not None:
        # Both spellings: llama-server reads repeat_penalty, vLLM and SGLang
        # repetition_penalty; each ignores the other's.
        out["repeat_penalty"] = s.repeat_penalty
        out["repetition_penalty"] = s.repeat_penalty
    if s.penalty_last_n is not None:
        out["repeat_last_n"] = s.penalty_last_n  # llama-server only
    if s.ignore_eos:
        out["ignore_eos"] = True
    if s.grammar is not None and request.tools is None and request.response_format is None:
        # A raw GBNF grammar has no OpenAI spelling; llama-server's is the only one that
        # takes GBNF as is (vLLM and others ignore it). A grammar next to tools or a
        # response_format was derived from them, and the upstream derives its own.
        out["grammar"] = s.grammar
        if s.grammar_triggers:
            out["grammar_lazy"] = True
            out["grammar_triggers"] = [
                {"type": _TRIGGER_PATTERN, "value": p} for p in s.grammar_triggers
            ]
    return out


def stream_meta(
    request: GenerationRequest, model: str, *, slot: str, replica: str | None
) -> StreamMeta:
    """The meta of an upstream's answer to ``request``.

    Choice 0 is the only prompt owner: :class:`ChunkDecoder` puts the upstream's
    whole usage on it (see there).
    """
    prompts = 1 if request.is_chat else len(request.prompts or ())
    return StreamMeta(
        model=model,
        choices=prompts * request.n,
        prompt_owners=frozenset({0}),
        logprobs=request.logprobs is not None,
        slot=slot,
        replica=replica,
    )


# -- stream ----------------------------------------------------------------------------

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",  # the deprecated API's name for the same thing
    "abort": "abort",  # another sluice
}


class _Malformed(Exception):
    """Internal: the chunk is not an OpenAI chunk; becomes an UpstreamMalformed event."""


@dataclass(slots=True)
class _Choice:
    """One choice being decoded: its tool calls (index -> id) and whether it finished."""

    calls: dict[int, str] = field(default_factory=dict)
    last_call: int | None = None
    finished: bool = False
    stop_string: str | None = None  # the stop string that ended it, where the server says


class ChunkDecoder:
    """Decodes an upstream's OpenAI stream (chat or text) into sluice events.

    ``feed`` takes each parsed ``data:`` object; ``end`` is called at ``[DONE]``
    or a clean end of the stream. After an :class:`ErrorEvent` the decoder
    returns nothing more.

    Usage: the upstream's usage is the whole response's, so finishes are held
    back until its usage chunk (``choices: []``) or ``end()``; then the first
    choice's ``Finish`` carries the prompt, cached and *all* completion tokens,
    every other choice's ``Finish`` zero, so a fold's totals equal the
    upstream's (choice 0 is the only prompt owner, :func:`stream_meta`).
    Without usage from the upstream, ``Finish.usage`` is None and the fold
    counts the deltas (one token per content chunk, or one per logprob).

    Example::

        decoder = ChunkDecoder(chat=True)
        decoder.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
        # -> [Start(0, 0), TextDelta(0, "Hi", token_count=1)]
        decoder.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        # -> [] (held until usage)
        decoder.end()
        # -> [Finish(0, "stop")]
    """

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._choices: dict[int, _Choice] = {}
        self._held: dict[int, FinishReason] = {}
        self._usage: dict[str, Any] | None = None
        self._timings: dict[str, Any] | None = None
        self._usage_spent = False
        self._closed = False

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events of one parsed ``data:`` JSON object."""
        if self._closed:
            return []
        out: list[Event] = []
        try:
            if not isinstance(chunk, dict):
                raise _Malformed(f"a stream chunk is a JSON {_kind(chunk)}, not an object")
            # "error": null is no error (some servers send the key on every chunk)
            if chunk.get("error") is not None or chunk.get("object") == "error":
                message = _error_fields(chunk)[0] or "no message"
                return self._fail(out, UpstreamFailed(f"the upstream failed: {message}"))
            choices = chunk.get("choices")
            if not isinstance(choices, list):
                raise _Malformed("a stream chunk has no 'choices' list")
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                # The last one wins: with continuous usage every chunk has a running total.
                self._usage = usage
            timings = chunk.get("timings")  # llama-server's, on its last chunks
            if isinstance(timings, dict):
                self._timings = timings
            for choice in choices:
                self._choice(choice, out)
        except _Malformed as exc:
            return self._fail(out, UpstreamMalformed(f"the upstream's stream is malformed: {exc}"))
        if not choices and isinstance(usage, dict) and self._held:
            # The usage chunk: the response's totals, so every choice that finished is done.
            out.extend(self._release())
        return out

    @property
    def finished(self) -> bool:
        """Every choice begun has finished (or the decoder failed: nothing to go on)."""
        return (
            self._closed or bool(self._choices) and all(c.finished for c in self._choices.values())
        )

    def end(self) -> list[Event]:
        """The events at the end of the stream: held finishes, or the failure to finish."""
        if self._closed:
            return []
        self._closed = True
        out = self._release()
        if not self._choices:
            out.append(
                ErrorEvent(UpstreamFailed("the upstream ended the stream without an answer"))
            )
        elif not all(c.finished for c in self._choices.values()):
            out.append(ErrorEvent(UpstreamFailed("the upstream ended the stream before finishing")))
        return out

    # -- one choice of a chunk ---------------------------------------------------------

    def _choice(self, item: Any, out: list[Event]) -> None:
        if not isinstance(item, dict):
            raise _Malformed(f"a choice is a JSON {_kind(item)}, not an object")
        # Servers of the envelope-error chunk schema may leave it out (always 0).
        index = item.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise _Malformed(f"a choice's index is {index!r}")
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice()
            out.append(Start(index, prompt_tokens=0))
        if self.chat:
            self._delta(index, state, item.get("delta"), item.get("logprobs"), out)
        else:
            text = item.get("text")
            if text is not None and not isinstance(text, str):
                raise _Malformed(f"choices[{index}].text is a JSON {_kind(text)}")
            lps = _logprobs(item.get("logprobs"), chat=False)
            if text:
                out.append(TextDelta(index, text, token_count=len(lps) or 1, logprobs=lps or None))
        reason = item.get("finish_reason")
        if reason is not None:
            if not isinstance(reason, str):
                raise _Malformed(f"choices[{index}].finish_reason is {reason!r}")
            if not state.finished:
                state.finished = True
                out.extend(ToolCallEnd(index, i) for i in sorted(state.calls))
                self._held[index] = _FINISH.get(reason, "stop")
                # vLLM and SGLang name the stop string that matched (or a stop token id).
                matched = item.get("stop_reason")
                state.stop_string = matched if isinstance(matched, str) else None

    def _delta(
        self, index: int, state: _Choice, delta: Any, logprobs: Any, out: list[Event]
    ) -> None:
        if delta is None:
            return  # a bare finish chunk
        if not isinstance(delta, dict):
            raise _Malformed(f"choices[{index}].delta is a JSON {_kind(delta)}")
        # Prefer reasoning_content: servers that send both (sluice) repeat the same text.
        reasoning = delta.get("reasoning_content")
        if reasoning is None:
            reasoning = delta.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise _Malformed(f"choices[{index}].delta.reasoning is a JSON {_kind(reasoning)}")
            if reasoning:
                out.append(ReasoningDelta(index, reasoning))
        content = delta.get("content")
        if content is not None and not isinstance(content, str):
            raise _Malformed(f"choices[{index}].delta.content is a JSON {_kind(content)}")
        if content:
            lps = _logprobs(logprobs, chat=True)
            out.append(TextDelta(index, content, token_count=len(lps) or 1, logprobs=lps or None))
        calls = delta.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise _Malformed(f"choices[{index}].delta.tool_calls is a JSON {_kind(calls)}")
            for call in calls:
                self._call(index, state, call, out)

    def _call(self, choice: int, state: _Choice, call: Any, out: list[Event]) -> None:
        if not isinstance(call, dict):
            raise _Malformed(f"a tool call delta is a JSON {_kind(call)}")
        fn = call.get("function") or {}
        if not isinstance(fn, dict):
            raise _Malformed(f"a tool call's function is a JSON {_kind(fn)}")
        call_id = call.get("id")
        name = fn.get("name")
        args = fn.get("arguments")
        if not isinstance(call_id, str | None) or not isinstance(name, str | None):
            raise _Malformed("a tool call's id or name is not a string")
        if args is not None and not isinstance(args, str):
            args = json.dumps(args)  # some servers send the arguments as an object
        index = call.get("index")
        if index is None:
            # No index (some servers, one call per delta): a new id is a new call.
            new = call_id is not None and call_id not in state.calls.values()
            index = len(state.calls) if new or state.last_call is None else state.last_call
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise _Malformed(f"a tool call's index is {index!r}")
        if index not in state.calls:
            state.calls[index] = call_id or "call_" + secrets.token_hex(12)
            out.append(ToolCallStart(choice, index, state.calls[index], name or ""))
        state.last_call = index
        if args:
            out.append(ToolCallDelta(choice, index, args))

    # -- finishing ---------------------------------------------------------------------

    def _release(self) -> list[Event]:
        """The held finishes, in choice order, the usage on the first (see the class)."""
        held, self._held = self._held, {}
        if not held:
            return []
        usage = None if self._usage_spent else self._usage_of()
        owner = min(self._choices)
        out: list[Event] = []
        for index in sorted(held):
            finish_usage = None
            if usage is not None:
                self._usage_spent = True
                finish_usage = usage if index == owner else Usage(index, 0, 0)
            stop = self._choices[index].stop_string
            out.append(Finish(index, held[index], usage=finish_usage, stop_string=stop))
        return out

    def _usage_of(self) -> Usage | None:
        if self._usage is None:
            return None
        prompt = _count(self._usage.get("prompt_tokens"))
        completion = _count(self._usage.get("completion_tokens"))
        if prompt is None or completion is None:
            return None  # not usage we can trust: let the fold count the deltas
        details = self._usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        out = self._usage.get("completion_tokens_details")
        reasoning = _count(out.get("reasoning_tokens")) if isinstance(out, dict) else None
        timings = self._timings or {}
        if cached is None:
            cached = _count(timings.get("cache_n"))
        return Usage(
            min(self._choices),
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached or 0,
            reasoning_tokens=reasoning or 0,
            prompt_ms=_millis(timings.get("prompt_ms")),
            generation_ms=_millis(timings.get("predicted_ms")),
        )

    def _fail(self, out: list[Event], error: SluiceError) -> list[Event]:
        # Choices that did finish keep their finish: the error ends the response after them.
        self._closed = True
        return [*out, *self._release(), ErrorEvent(error)]


def _logprobs(value: Any, *, chat: bool) -> tuple[TokenLogprob, ...]:
    """Chat ``{"content": [...]}`` or legacy ``{"tokens", "token_logprobs", ...}``.

    Either shape is read for either endpoint: llama-server answers text
    completions with the chat shape. Token ids are not on the OpenAI wire: -1.
    Logprobs are optional detail, so a shape not understood is dropped, not an error.
    """
    if not isinstance(value, dict):
        return ()
    content = value.get("content")
    if isinstance(content, list):
        return tuple(lp for lp in map(_chat_logprob, content) if lp is not None)
    tokens = value.get("tokens")
    if not isinstance(tokens, list):
        return ()
    lps = value.get("token_logprobs")
    tops = value.get("top_logprobs")
    out = []
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            continue
        logprob = lps[i] if isinstance(lps, list) and i < len(lps) else None
        top = tops[i] if isinstance(tops, list) and i < len(tops) else None
        alternatives = tuple(
            TopLogprob(t, float(lp), tuple(t.encode()))
            for t, lp in (top.items() if isinstance(top, dict) else ())
            if isinstance(lp, int | float)
        )
        out.append(
            TokenLogprob(
                token,
                -1,
                float(logprob) if isinstance(logprob, int | float) else None,
                tuple(token.encode()),
                alternatives,
            )
        )
    return tuple(out)


def _chat_logprob(entry: Any) -> TokenLogprob | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        return None
    token: str = entry["token"]
    logprob = entry.get("logprob")
    tops = entry.get("top_logprobs")
    alternatives = tuple(
        TopLogprob(t["token"], float(t["logprob"]), _bytes(t.get("bytes"), t["token"]))
        for t in (tops if isinstance(tops, list) else ())
        if isinstance(t, dict)
        and isinstance(t.get("token"), str)
        and isinstance(t.get("logprob"), int | float)
    )
    token_id = entry.get("id")  # llama-server names the token id; OpenAI does not
    return TokenLogprob(
        token,
        token_id if isinstance(token_id, int) and not isinstance(token_id, bool) else -1,
        float(logprob) if isinstance(logprob, int | float) else None,
        _bytes(entry.get("bytes"), token),
        alternatives,
    )


def _bytes(value: Any, token: str) -> tuple[int, ...]:
    if isinstance(value, list) and all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return tuple(value)
    return tuple(token.encode())


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _millis(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, int | float) else "null"
    )


# -- errors before the stream ----------------------------------------------------------


def error_from_response(status: int, body: bytes, headers: Mapping[str, str]) -> SluiceError:
    """The typed error of an upstream's non-2xx answer before any byte of a stream.

    A 4xx is the client's request refused: :class:`UpstreamRejected` with the
    upstream's status, message, type, code (only a string: llama-server's and
    vLLM's numeric code just repeat the status) and param, and its
    ``Retry-After``. Except 401/403/407: those refuse *sluice's* credentials
    for the upstream, which the client can do nothing about, so they are an
    :class:`UpstreamFailed` (502) like a 5xx, instead of telling the client its
    own key is wrong. Any other status is :class:`UpstreamFailed` naming it.

    Bodies understood: OpenAI's ``{"error": {...}}``, llama-server's (the same,
    numeric code), vLLM's older top-level ``{"object": "error", "message": ...}``,
    Ollama's ``{"error": "text"}``, FastAPI's ``{"detail": ...}``, plain text.
    """
    message, type_, code, param = _error_fields(_json_or_text(body))
    if not message:
        message = f"the upstream answered HTTP {status} without a message"
    if 400 <= status < 500 and status not in (401, 403, 407):
        retry_after = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
        default_type = "rate_limit_error" if status == 429 else "invalid_request_error"
        return UpstreamRejected(
            message,
            status=status,
            type=type_ or default_type,
            code=code,
            param=param,
            retry_after=retry_after,
        )
    return UpstreamFailed(f"the upstream answered HTTP {status}: {message}")


def _json_or_text(body: bytes) -> Any:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _error_fields(data: Any) -> tuple[str, str | None, str | None, str | None]:
    """(message, type, code, param) of an error JSON or text, each as the upstream said it."""
    if isinstance(data, str):
        return data[:_MAX_ERROR_TEXT], None, None, None
    if not isinstance(data, dict):
        return "", None, None, None
    inner = data.get("error")
    if isinstance(inner, str):  # Ollama
        return inner[:_MAX_ERROR_TEXT], None, None, None
    if not isinstance(inner, dict):
        detail = data.get("detail")  # FastAPI's HTTPException / validation errors
        if "message" not in data and detail is not None:
            shown = detail if isinstance(detail, str) else json.dumps(detail)
            return shown[:_MAX_ERROR_TEXT], None, None, None
        inner = data  # vLLM's older top-level error, sluice's own error frame
    message = inner.get("message")

    def text(key: str) -> str | None:
        value = inner.get(key)
        return value if isinstance(value, str) else None

    return (
        message[:_MAX_ERROR_TEXT] if isinstance(message, str) else "",
        text("type"),
        text("code"),
        text("param"),
    )
