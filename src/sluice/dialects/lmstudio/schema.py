"""Wire schemas of LM Studio's REST API v1 requests (chat and model management), with pydantic.

Unknown fields are accepted and reported (``unknown_fields``) so the route can
log them: LM Studio adds options from release to release, and a tool written
for a newer one must still work here. :func:`parse` turns a validation error
into an :class:`~sluice.core.errors.InvalidRequest` naming the field
(``input[0].data_url``).

Example::

    body = parse({"model": "gemma-3-270m", "context_length": 1024}, LoadModelRequest)
    body.context_length   # 1024
    parse({"instance_id": 7}, UnloadModelRequest)
    # -> InvalidRequest("Invalid 'instance_id': Input should be a valid string")

    chat = parse({"model": "qwen3", "input": "Hi", "reasoning": "off"}, ChatRequest)
    kwargs = reasoning_switch(chat.reasoning, reasoning_capability(template))
    request = chat.to_request(history=[], tools=None, template_kwargs=kwargs)
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from sluice.core.errors import ReasoningUnsupported
from sluice.core.request import GenerationRequest, SamplingParams
from sluice.server.jsonbody import validate_body

# Below this a context holds hardly a system prompt; llama.cpp itself pads tiny ones up.
MIN_CONTEXT_LENGTH = 64


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class LoadModelRequest(_Wire):
    """``POST /api/v1/models/load``."""

    model: str = Field(min_length=1)
    context_length: int | None = Field(default=None, ge=MIN_CONTEXT_LENGTH)
    # LM Studio's "max concurrent predictions"; sluice's --parallel for this model.
    parallel: int | None = Field(default=None, ge=1)
    # Options llama.cpp has but sluice sets per server, not per model: validated, then
    # reported as not applied (LM Studio ignores them too where its engine lacks them).
    eval_batch_size: int | None = Field(default=None, ge=1)
    flash_attention: bool | None = None
    num_experts: int | None = Field(default=None, ge=0)
    offload_kv_cache_to_gpu: bool | None = None
    echo_load_config: bool = False
    # Seconds idle before it unloads; omitted: never (an explicit load stays, as in LM Studio).
    ttl: float | None = Field(default=None, gt=0)


class UnloadModelRequest(_Wire):
    """``POST /api/v1/models/unload``."""

    instance_id: str = Field(min_length=1)


class DownloadModelRequest(_Wire):
    """``POST /api/v1/models/download``: sluice takes the URL of one ``.gguf`` file."""

    model: str = Field(min_length=1)
    sha256: str | None = None  # checked by the download manager (64 hex digits)
    filename: str | None = None  # the name in the models folder; default: the URL's
    quantization: str | None = None  # LM Studio picks a file of a repo by it; a URL names one


# -- POST /api/v1/chat -------------------------------------------------------------------

ReasoningSetting = Literal["off", "low", "medium", "high", "on"]
_LEVELS = ("low", "medium", "high")
_INT32_MAX = 2**31 - 1
# Only the prefix is checked: the base64 that follows may be megabytes.
_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,")


class TextInput(_Wire):
    """A text item: ``{"type": "message", "content": ...}`` (``"text"`` too: LM Studio's
    docs write both)."""

    type: Literal["message", "text"]
    content: str


class ImageInput(_Wire):
    """An image item: ``{"type": "image", "data_url": "data:image/png;base64,..."}``."""

    type: Literal["image"]
    data_url: str

    @field_validator("data_url")
    @classmethod
    def _is_data_url(cls, v: str) -> str:
        if not _DATA_URL.match(v):
            raise ValueError("must be a base64 image data URL: data:image/<format>;base64,<data>")
        return v


InputItem = Annotated[TextInput | ImageInput, Field(discriminator="type")]


def _input_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    return "items" if isinstance(value, list) else None


# A string or a non-empty list of items; the discriminator keeps errors to the branch
# the client meant (no "should be a valid string" for a bad item).
ChatInput = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items"), Field(min_length=1)],
    Discriminator(
        _input_kind,
        custom_error_type="input_type",
        custom_error_message="Input should be a string or a list of input items",
    ),
]


class ChatRequest(_Wire):
    """``POST /api/v1/chat``: one user turn; the rest of the conversation lives on the
    server (``previous_response_id``), tools come from ``integrations``.

    ``tool_choice`` is sluice's own (LM Studio has none): ``"required"`` makes a
    model call one of the integrations' tools.

    Example::

        body = parse({"model": "qwen3", "input": "What is 2+2?"}, ChatRequest)
        request = body.to_request(history=[], tools=None)
        request.messages   # [{"role": "user", "content": "What is 2+2?"}]
    """

    model: str = Field(min_length=1)
    input: ChatInput
    system_prompt: str | None = None
    integrations: list[Any] | None = None  # parsed by the MCP layer
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    reasoning: ReasoningSetting | None = None
    context_length: int | None = Field(default=None, ge=MIN_CONTEXT_LENGTH)
    store: bool = True
    previous_response_id: str | None = None
    tool_choice: Literal["auto", "required", "none"] | None = None

    @field_validator("previous_response_id")
    @classmethod
    def _is_response_id(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("resp_"):
            raise ValueError("must be a response id ('resp_...')")
        return v

    def input_messages(self) -> list[dict[str, Any]]:
        """The new user turn as chat-template messages.

        Items become OpenAI content parts; text-only items collapse to one string
        (joined as a template joins text parts: with nothing between them).
        """
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        parts: list[dict[str, Any]] = [
            {"type": "text", "text": item.content}
            if isinstance(item, TextInput)
            else {"type": "image_url", "image_url": {"url": item.data_url}}
            for item in self.input
        ]
        if all(part["type"] == "text" for part in parts):
            return [{"role": "user", "content": "".join(part["text"] for part in parts)}]
        return [{"role": "user", "content": parts}]

    def has_images(self) -> bool:
        return not isinstance(self.input, str) and any(
            isinstance(item, ImageInput) for item in self.input
        )

    def sampling_params(self) -> SamplingParams:
        """This request's sampler settings (omitted: the same defaults as OpenAI's routes)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            # llama.cpp takes int32: a top_k past the vocabulary is the same as none.
            top_k=None if self.top_k is None else min(self.top_k, _INT32_MAX),
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
        )

    def to_request(
        self,
        history: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        template_kwargs: dict[str, Any] | None = None,
    ) -> GenerationRequest:
        """The neutral request: system prompt, ``history`` (earlier turns as template
        messages), this input; ``tools`` as OpenAI function definitions.

        ``template_kwargs`` is what :func:`reasoning_switch` returned. A reasoning
        level (low/medium/high) travels as ``reasoning_effort``.
        """
        messages: list[dict[str, Any]] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.extend(history)
        messages.extend(self.input_messages())
        return GenerationRequest(
            model=self.model,
            messages=messages,
            tools=tools or None,
            tool_choice=self.tool_choice,
            reasoning_effort=self.reasoning if self.reasoning in _LEVELS else None,
            template_kwargs=template_kwargs,
            sampling=self.sampling_params(),
            max_tokens=self.max_output_tokens,
        )


def reasoning_switch(
    value: str | None, capability: dict[str, Any] | None, *, model: str | None = None
) -> dict[str, Any] | None:
    """The ``template_kwargs`` that set ``reasoning`` to ``value``; None: nothing to set.

    ``capability`` is :func:`reasoning_capability`'s answer for the model. A model
    that does not reason accepts only ``"off"``; otherwise the value must be one of
    its ``allowed_options``, else :class:`ReasoningUnsupported` (``param="reasoning"``).

    Example::

        reasoning_switch("off", {"allowed_options": ["off", "on"], "default": "on"})
        # -> {"enable_thinking": False}
    """
    if value is None:
        return None
    allowed = ["off"] if capability is None else list(capability["allowed_options"])
    if value not in allowed:
        who = f"Model '{model}'" if model else "This model"
        options = ", ".join(f"'{option}'" for option in allowed)
        raise ReasoningUnsupported(
            f"{who} does not support reasoning '{value}'; allowed: {options}",
            param="reasoning",
        )
    # Only a template that reads the switch can be told "off" (reasoning_capability).
    if capability is None or "off" not in allowed:
        return None
    return {"enable_thinking": value != "off"}


M = TypeVar("M", bound=_Wire)


def parse(data: dict[str, Any], model: type[M]) -> M:
    """``data`` as ``model``; :class:`InvalidRequest` naming the first bad field."""
    return validate_body(data, model)
