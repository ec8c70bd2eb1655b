"""Wire schemas of the OpenAI endpoints (requests), validated with pydantic.

Unknown fields are accepted and reported (``unknown_fields``) so the route
can log them; known fields sluice does not implement are rejected with a 400
naming the field when the body becomes the neutral request (``to_request``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.core.errors import InvalidRequest, UnsupportedParameter
from sluice.core.request import GenerationRequest, SamplingParams

_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")
_INT32_MAX = 2**31 - 1
_RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: "pick one at random"


def _seed(seed: int | None) -> int | None:
    """llama.cpp seeds are 32-bit; -1 (and 2**32-1) mean random, as None does, so that
    with n > 1 no choice gets a fixed seed by adding its index to -1."""
    if seed is None or seed & 0xFFFFFFFF == _RANDOM_SEED:
        return None
    return seed & 0xFFFFFFFF


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(_Wire):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Speculative(_Wire):
    """sluice's extension: fewer decode steps for this request (a local model)."""

    max_draft: int | None = Field(default=None, ge=0, le=256)
    jump_forward: bool | None = None


class FunctionCall(_Wire):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Wire):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Wire):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": ..., "detail": ...}
    input_audio: dict[str, Any] | None = None  # {"data": <base64>, "format": "wav"}


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _SamplingFields(_Wire):
    """Fields shared by chat and text completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    user: str | None = None
    ignore_eos: bool = False
    speculative: Speculative | None = None  # sluice's extension (docs/openai.md)
    # LM Studio's extension: seconds the model stays loaded once idle (just-in-time loads)
    ttl: float | None = Field(default=None, gt=0)

    # The count and length of stop strings are limits (server/jsonbody.py), not schema.

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            # ASCII digits only: str.isdigit() also admits "²", which int() rejects.
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys are token ids, got {key[:32]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self) -> SamplingParams:
        """This request's sampler settings as engine parameters."""
        last_n = None if self.repeat_last_n is None else min(self.repeat_last_n, _INT32_MAX)
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            # llama.cpp takes int32: a top_k past the vocabulary is the same as none.
            top_k=None if self.top_k is None else min(self.top_k, _INT32_MAX),
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            penalty_last_n=last_n,
            seed=_seed(self.seed),
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            ignore_eos=self.ignore_eos,
            max_draft=self.speculative.max_draft if self.speculative else None,
            jump_forward=self.speculative.jump_forward if self.speculative else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # llama-server's per-request reasoning budget (0: none, -1: no limit)
    thinking_budget_tokens: int | None = Field(default=None, ge=-1)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's, SGLang's and llama-server's: the final assistant message is continued
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_request(self) -> GenerationRequest:
        """The neutral request; :class:`UnsupportedParameter` for fields sluice lacks."""
        if self.functions or self.function_call:
            raise UnsupportedParameter(
                "functions", "(the deprecated function-calling API) is not supported; use 'tools'"
            )
        if self.audio is not None or (self.modalities and set(self.modalities) - {"text"}):
            raise UnsupportedParameter("modalities", "other than text are not supported")
        if self.prediction is not None:
            raise UnsupportedParameter("prediction", "(predicted outputs) is not supported")
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                raise InvalidRequest(
                    "continue_final_message needs an assistant message last in 'messages' "
                    "(the answer's beginning, to continue)",
                    param="continue_final_message",
                )
            if self.add_generation_prompt:
                raise InvalidRequest(
                    "add_generation_prompt and continue_final_message cannot both be true",
                    param="add_generation_prompt",
                )
        return GenerationRequest(
            model=self.model,
            messages=[_template_message(i, m) for i, m in enumerate(self.messages)],
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format,
            reasoning_effort=self.reasoning_effort,
            reasoning_budget=self.thinking_budget_tokens,
            template_kwargs=self.chat_template_kwargs,
            sampling=self.sampling_params(),
            max_tokens=self.token_limit(),
            stop=self.stop_strings(),
            n=self.n,
            logprobs=self.top_logprobs_n(),
            continue_final=self.continue_final_message,
        )

    def top_logprobs_n(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequest(
                    "'top_logprobs' requires 'logprobs': true", param="top_logprobs"
                )
            return None
        return self.top_logprobs or 0


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def to_request(self) -> GenerationRequest:
        """The neutral request; :class:`UnsupportedParameter` for fields sluice lacks."""
        if self.suffix:
            raise UnsupportedParameter("suffix", "(fill-in-the-middle) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of", "other than n is not supported")
        return GenerationRequest(
            model=self.model,
            prompts=self.prompts(),
            sampling=self.sampling_params(),
            max_tokens=self.max_tokens,
            stop=self.stop_strings(),
            n=self.n,
            logprobs=self.logprobs,
            echo=self.echo,
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("'prompt' is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in p if isinstance(x, list)]
        raise InvalidRequest(
            "'prompt' must be a string, a list of strings, a list of token ids, or a list of lists",
            param="prompt",
        )


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A wire message as the plain dict chat templates expect."""
    content: str | list[dict[str, Any]] | None
    if isinstance(message.content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(message.content):
            if part.type == "image_url" and part.image_url is not None:
                image = part.image_url
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str) or not url:
                    raise InvalidRequest(
                        f"messages[{index}].content[{j}].image_url.url must be a string",
                        param=f"messages[{index}].content[{j}].image_url",
                    )
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif part.type == "input_audio" and part.input_audio is not None:
                data = part.input_audio.get("data")
                if not isinstance(data, str) or not data:
                    raise InvalidRequest(
                        f"messages[{index}].content[{j}].input_audio.data must be base64 text",
                        param=f"messages[{index}].content[{j}].input_audio",
                    )
                audio = {"data": data, "format": part.input_audio.get("format")}
                parts.append({"type": "input_audio", "input_audio": audio})
            elif part.type == "text" and part.text is not None:
                parts.append({"type": "text", "text": part.text})
            else:
                raise UnsupportedParameter(
                    f"messages[{index}].content", f"parts of type '{part.type}' are not supported"
                )
        # Text alone is one string, as templates expect; with an image or a clip, the parts.
        if any(p["type"] != "text" for p in parts):
            content = parts
        else:
            content = "".join(p["text"] for p in parts)
    else:
        content = message.content
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content or message.reasoning
    if reasoning:
        out["reasoning_content"] = reasoning
    return out
