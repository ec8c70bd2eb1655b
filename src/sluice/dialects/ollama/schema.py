"""Ollama's ``/api/chat`` and ``/api/generate`` bodies, and their neutral request.

Ollama's fields map onto the neutral request as its own server reads them:
``options`` carries the sampler and the context (``num_predict`` -1 is "until the
end", -2 "fill the context"), ``format`` is ``"json"`` or a JSON schema (both
grammar-constrained on a local model), ``think`` switches reasoning, ``keep_alive``
is the model's idle time to live (a duration like ``"5m"``, seconds, 0 to unload
after the answer, negative to keep it loaded). Fields Ollama takes that do not
apply here (``num_gpu``, ``num_thread``, ``mirostat``, ...) are accepted and ignored,
as Ollama ignores the options a runner does not know.

Example::

    body = parse(data, ChatRequest)
    neutral = body.to_request("smollm2")
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.core.errors import InvalidRequest
from sluice.core.media import base64_data_uri
from sluice.core.request import GenerationRequest, SamplingParams
from sluice.server.jsonbody import validate_body

_INT32_MAX = 2**31 - 1
# keep_alive 0: unload once idle, which the TTL reaper does at its next look.
UNLOAD_NOW = 1e-3
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class Options(_Wire):
    """``options``: what sluice's sampler and context take; the rest is ignored."""

    num_ctx: int | None = Field(default=None, ge=1)
    num_predict: int | None = Field(default=None, ge=-2)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: list[str] | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=None if self.top_k is None else min(self.top_k, _INT32_MAX),
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            penalty_last_n=None
            if self.repeat_last_n is None
            else min(self.repeat_last_n, _INT32_MAX),
            # Ollama's seed -1 (and none) is random, as sluice's None is.
            seed=None if self.seed is None or self.seed < 0 else self.seed & 0xFFFFFFFF,
        )

    def max_tokens(self) -> int | None:
        """``num_predict``: a count, or None for -1 (no limit) and -2 (fill the context)."""
        if self.num_predict is None or self.num_predict < 0:
            return None
        return max(self.num_predict, 1)


class FunctionCall(_Wire):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Wire):
    function: FunctionCall
    id: str | None = None


class Message(_Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _KeepAlive(_Wire):
    keep_alive: str | int | float | None = None

    def ttl(self) -> float | None:
        """``keep_alive`` as the model's idle TTL: None (the default), 0 (never unload:
        a negative keep_alive), or seconds (0 itself: unload once the answer is done)."""
        if self.keep_alive is None or self.keep_alive == "":
            return None
        seconds = _seconds(self.keep_alive)
        if seconds < 0:
            return 0.0  # Ollama: a negative keep_alive keeps the model loaded
        return UNLOAD_NOW if seconds == 0 else seconds

    def unloads(self) -> bool:
        """``keep_alive`` 0: the model goes once this answer is done."""
        return self.ttl() == UNLOAD_NOW


class _Common(_KeepAlive):
    model: str = Field(min_length=1)
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def response_format(self) -> dict[str, Any] | None:
        if self.format is None or self.format == "":
            return None
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            schema = self.format
            return {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}
        raise InvalidRequest(
            f"'format' must be \"json\" or a JSON schema object, not {self.format!r}",
            param="format",
        )

    def reasoning(self) -> tuple[str | None, dict[str, Any] | None]:
        """(reasoning_effort, template_kwargs) for ``think``."""
        if self.think is None:
            return None, None
        if self.think is False:
            return None, {"enable_thinking": False}
        effort = self.think if isinstance(self.think, str) else None
        return effort, {"enable_thinking": True}

    def _neutral(self, **fields: Any) -> GenerationRequest:
        effort, kwargs = self.reasoning()
        return GenerationRequest(
            model=self.model,
            sampling=self.options.sampling(),
            max_tokens=self.options.max_tokens(),
            stop=tuple(self.options.stop or ()),
            response_format=self.response_format(),
            reasoning_effort=effort,
            template_kwargs=kwargs,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            **fields,
        )


class ChatRequest(_Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def has_images(self) -> bool:
        return any(m.images for m in self.messages)

    def to_request(self) -> GenerationRequest:
        return self._neutral(
            messages=[_template_message(m, i) for i, m in enumerate(self.messages)],
            tools=self.tools or None,
            tool_choice="auto" if self.tools else None,
            # Ollama continues a final assistant message (its prefill), calls aside.
            continue_final=bool(self.messages)
            and self.messages[-1].role == "assistant"
            and not self.messages[-1].tool_calls,
        )


class GenerateRequest(_Common):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None

    def has_images(self) -> bool:
        return bool(self.images)

    def to_request(self) -> GenerationRequest:
        if self.suffix:
            raise InvalidRequest(
                "'suffix' (fill-in-the-middle) is not supported by this server", param="suffix"
            )
        if self.template:
            raise InvalidRequest(
                "'template' is not supported: the model's own chat template is used "
                "(or send 'raw': true with the whole prompt)",
                param="template",
            )
        if self.raw:
            if self.images:
                raise InvalidRequest(
                    "images go into the model's chat template: send them without 'raw'",
                    param="images",
                )
            return self._neutral(prompts=[self.prompt])
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": _content(self.prompt, self.images, "images")})
        return self._neutral(messages=messages)


class EmbedRequest(_KeepAlive):
    """``/api/embed`` (``input``) and the older ``/api/embeddings`` (``prompt``)."""

    model: str = Field(min_length=1)
    input: str | list[str] | None = None
    prompt: str = ""
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: Options = Field(default_factory=Options)

    def input_list(self) -> list[str]:
        if self.input is None:
            return []
        return [self.input] if isinstance(self.input, str) else list(self.input)


class _Named(_Wire):
    """A request naming one model: ``model``, or ``name`` (the older spelling)."""

    model: str | None = None
    name: str | None = None

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise InvalidRequest("'model' is required", param="model")
        return name


class PullRequest(_Named):
    stream: bool = True
    insecure: bool = False  # accepted; TLS is checked all the same


class ShowRequest(_Named):
    verbose: bool = False


class DeleteRequest(_Named):
    pass


def _content(text: str | None, images: list[str] | None, where: str) -> Any:
    """A message's text, or (with images: base64, as Ollama sends them) OpenAI parts,
    the images first, as Ollama places them."""
    if not images:
        return text or ""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": base64_data_uri(b64, f"{where}[{k}]")}}
        for k, b64 in enumerate(images)
    ]
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def _template_message(m: Message, index: int) -> dict[str, Any]:
    """A message as chat templates take it (OpenAI's shape, arguments as objects)."""
    out: dict[str, Any] = {
        "role": m.role,
        "content": _content(m.content, m.images, f"messages[{index}].images"),
    }
    if m.thinking:
        out["reasoning_content"] = m.thinking
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id or f"call_{index}_{k}",
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for k, call in enumerate(m.tool_calls)
        ]
    if m.role == "tool":
        if m.tool_name:
            out["name"] = m.tool_name
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
    return out


def _seconds(value: str | float) -> float:
    """A Go duration (``"5m"``, ``"1h30m"``, ``"-1s"``), or a number of seconds."""
    if isinstance(value, bool):
        raise InvalidRequest("'keep_alive' must be a duration", param="keep_alive")
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("-+")
    try:
        return sign * float(text)
    except ValueError:
        pass
    parts = _PART.findall(text)
    if not parts or _PART.sub("", text):
        raise InvalidRequest(
            f"'keep_alive' must be a duration like \"5m\" or seconds, not {value!r}",
            param="keep_alive",
        )
    return sign * sum(float(n) * _UNIT[unit] for n, unit in parts)


def parse(data: dict[str, Any], model: type[Any]) -> Any:
    """``data`` as ``model``; :class:`InvalidRequest` naming the first bad field."""
    return validate_body(data, model)
