"""Google's Gemini API request (``generateContent``), validated, as the neutral request.

* ``systemInstruction`` -> a system message; ``contents`` (roles ``user`` and
  ``model``) -> chat messages: text parts joined, ``thought`` parts of a model turn its
  ``reasoning_content``, ``functionCall`` parts its ``tool_calls`` (arguments as JSON
  text), ``functionResponse`` parts tool messages (matched to their call by ``id``, or
  by name in order where the client sends no ids); ``inlineData`` images become
  ``image_url`` parts (a local model without a projector: a 400 that says so), and
  ``audio/*`` clips ``input_audio`` parts;
  ``thoughtSignature`` is accepted and ignored;
* ``tools[].functionDeclarations`` -> function tools: ``parameters`` (the OpenAPI
  subset, ``type: "OBJECT"``, ``nullable``) as JSON Schema, or ``parametersJsonSchema``
  as it is; tools that cannot run here (``googleSearch``, ``codeExecution``,
  ``urlContext``, ...) are left out of the prompt;
* ``toolConfig.functionCallingConfig.mode``: ``AUTO``/``VALIDATED`` -> auto, ``ANY`` ->
  required (``allowedFunctionNames``: only those; one name: that function), ``NONE``;
* ``generationConfig``: sampling, ``maxOutputTokens``, ``stopSequences``,
  ``candidateCount`` -> ``n``, ``seed``, ``responseMimeType: application/json`` with
  ``responseSchema``/``responseJsonSchema`` -> a JSON (schema) response format,
  ``thinkingConfig`` (``thinkingBudget: 0`` turns thinking off; ``includeThoughts``
  says whether thought parts come back);
* ``safetySettings``, ``cachedContent``, ``labels``: accepted, ignored.

Example::

    body = parse({"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]},
                 GenerateContentRequest)
    request = body.to_request("smollm2")
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from sluice.core.errors import InvalidRequest
from sluice.core.request import GenerationRequest, SamplingParams
from sluice.server.jsonbody import validate_body

_INT32_MAX = 2**31 - 1


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class Content(_Wire):
    role: str | None = None
    parts: list[dict[str, Any]] = Field(default_factory=list)


class ThinkingConfig(_Wire):
    include_thoughts: bool | None = Field(None, alias="includeThoughts")
    # 0: no thinking; -1: the model's own choice (no limit); N: tokens
    thinking_budget: int | None = Field(None, alias="thinkingBudget", ge=-1)
    thinking_level: str | None = Field(None, alias="thinkingLevel")

    def effort(self) -> str | None:
        """``thinkingLevel`` as a reasoning effort (a budget, where given, wins)."""
        level = (self.thinking_level or "").lower()
        if self.thinking_budget is not None or level in ("", "thinking_level_unspecified"):
            return None
        return level


class GenerationConfig(_Wire):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, alias="topP", gt=0, le=1)
    top_k: int | None = Field(None, alias="topK", ge=1)
    max_output_tokens: int | None = Field(None, alias="maxOutputTokens", ge=1)
    stop_sequences: list[str] | None = Field(None, alias="stopSequences", max_length=16)
    candidate_count: int | None = Field(None, alias="candidateCount", ge=1, le=8)
    seed: int | None = None
    presence_penalty: float | None = Field(None, alias="presencePenalty", ge=-2, le=2)
    frequency_penalty: float | None = Field(None, alias="frequencyPenalty", ge=-2, le=2)
    response_mime_type: str | None = Field(None, alias="responseMimeType")
    response_schema: dict[str, Any] | None = Field(None, alias="responseSchema")
    response_json_schema: dict[str, Any] | None = Field(None, alias="responseJsonSchema")
    thinking_config: ThinkingConfig | None = Field(None, alias="thinkingConfig")


class FunctionCallingConfig(_Wire):
    mode: str | None = None
    allowed_function_names: list[str] | None = Field(None, alias="allowedFunctionNames")


class ToolConfig(_Wire):
    function_calling_config: FunctionCallingConfig | None = Field(
        None, alias="functionCallingConfig"
    )


class _Fields(_Wire):
    contents: list[Content] = Field(default_factory=list)
    system_instruction: Content | str | None = Field(None, alias="systemInstruction")
    tools: list[dict[str, Any]] | None = None
    tool_config: ToolConfig | None = Field(None, alias="toolConfig")
    generation_config: GenerationConfig = Field(
        default_factory=lambda: GenerationConfig.model_validate({}), alias="generationConfig"
    )
    safety_settings: list[Any] | None = Field(None, alias="safetySettings")  # ignored
    cached_content: str | None = Field(None, alias="cachedContent")  # ignored
    labels: dict[str, Any] | None = None  # ignored

    # -- what the neutral request is made of ---------------------------------------

    @property
    def include_thoughts(self) -> bool:
        thinking = self.generation_config.thinking_config
        return bool(thinking and thinking.include_thoughts)

    def has_images(self) -> bool:
        return any("inlineData" in p or "fileData" in p for c in self.contents for p in c.parts)

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        system = _system_text(self.system_instruction)
        if system:
            out.append({"role": "system", "content": system})
        calls = _CallIds()
        if not self.contents:
            raise InvalidRequest("'contents' is empty", param="contents")
        for i, content in enumerate(self.contents):
            out.extend(_turn(f"contents[{i}]", content, calls))
        return out

    def tool_list(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, tool in enumerate(self.tools or []):
            if not isinstance(tool, dict):
                raise InvalidRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
            declared = tool.get("functionDeclarations", tool.get("function_declarations"))
            for j, decl in enumerate(declared or []):
                out.append(_function(f"tools[{i}].functionDeclarations[{j}]", decl))
        return out

    def choice(self, tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
        """The tools offered and the neutral tool choice, from ``functionCallingConfig``."""
        config = self.tool_config.function_calling_config if self.tool_config else None
        mode = (config.mode or "AUTO").upper() if config else "AUTO"
        if mode in ("AUTO", "VALIDATED", "MODE_UNSPECIFIED"):
            return tools, "auto" if tools else None
        if mode == "NONE":
            return tools, "none" if tools else None
        if mode != "ANY":
            raise InvalidRequest(
                f"Invalid functionCallingConfig.mode {mode!r}: AUTO, ANY, NONE or VALIDATED",
                param="toolConfig.functionCallingConfig.mode",
            )
        if not tools:
            raise InvalidRequest(
                "functionCallingConfig.mode ANY needs function declarations in 'tools'",
                param="toolConfig.functionCallingConfig.mode",
            )
        allowed = config.allowed_function_names if config else None
        if allowed:
            names = {t["function"]["name"] for t in tools}
            unknown = [n for n in allowed if n not in names]
            if unknown:
                raise InvalidRequest(
                    f"allowedFunctionNames names no declared function: {unknown[0]!r}",
                    param="toolConfig.functionCallingConfig.allowedFunctionNames",
                )
            tools = [t for t in tools if t["function"]["name"] in allowed]
            if len(tools) == 1:
                return tools, {"type": "function", "function": {"name": allowed[0]}}
        return tools, "required"

    def response_format(self) -> dict[str, Any] | None:
        config = self.generation_config
        mime = (config.response_mime_type or "text/plain").lower()
        if mime in ("text/plain", "text/x.enum"):
            return None
        if mime != "application/json":
            raise InvalidRequest(
                f"responseMimeType {config.response_mime_type!r} is not supported: "
                "text/plain or application/json",
                param="generationConfig.responseMimeType",
            )
        schema = config.response_json_schema
        if schema is None and config.response_schema is not None:
            schema = openapi_to_json_schema(config.response_schema)
        if schema is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}

    def template_kwargs(self) -> dict[str, Any] | None:
        thinking = self.generation_config.thinking_config
        if thinking is not None and thinking.thinking_budget == 0:
            return {"enable_thinking": False}
        return None

    def prompt_request(self, model: str, **fields: Any) -> GenerationRequest:
        tools, choice = self.choice(self.tool_list())
        thinking = self.generation_config.thinking_config
        return GenerationRequest(
            model=model,
            messages=self.messages(),
            tools=tools or None,
            tool_choice=choice,
            response_format=self.response_format(),
            template_kwargs=self.template_kwargs(),
            reasoning_budget=thinking.thinking_budget if thinking else None,
            reasoning_effort=thinking.effort() if thinking else None,
            **fields,
        )


class GenerateContentRequest(_Fields):
    """``POST /v1beta/models/{model}:generateContent`` (and ``:streamGenerateContent``)."""

    ignore_eos: bool = False  # sluice's extension (as in the other dialects): for benchmarks

    def to_request(self, model: str) -> GenerationRequest:
        config = self.generation_config
        sampling = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=None if config.top_k is None else min(config.top_k, _INT32_MAX),
            seed=config.seed,
            presence_penalty=config.presence_penalty or 0.0,
            frequency_penalty=config.frequency_penalty or 0.0,
            ignore_eos=self.ignore_eos,
        )
        return self.prompt_request(
            model,
            sampling=sampling,
            max_tokens=config.max_output_tokens,
            stop=tuple(config.stop_sequences or ()),
            n=config.candidate_count or 1,
        )


class CountTokensRequest(_Wire):
    """``POST /v1beta/models/{model}:countTokens``: ``contents``, or a whole
    ``generateContentRequest`` (its tools and system instruction count too)."""

    contents: list[Content] | None = None
    generate_content_request: GenerateContentRequest | None = Field(
        None, alias="generateContentRequest"
    )

    def to_request(self, model: str) -> GenerationRequest:
        if self.generate_content_request is not None:
            return self.generate_content_request.prompt_request(model, max_tokens=1)
        body = GenerateContentRequest.model_validate({"contents": self.contents or []})
        return body.prompt_request(model, max_tokens=1)


M = TypeVar("M", bound=_Wire)


def parse(data: dict[str, Any], model: type[M]) -> M:
    """``data`` as ``model``; :class:`InvalidRequest` naming the first bad field."""
    return validate_body(data, model)


# -- parts -------------------------------------------------------------------------------


class _CallIds:
    """Call ids for calls and their responses: the client's, or made up in order (a
    response without an id answers the oldest unanswered call of its name)."""

    def __init__(self) -> None:
        self._n = 0
        self._open: dict[str, list[str]] = {}

    def call(self, name: str, given: Any) -> str:
        call_id = given if isinstance(given, str) and given else f"call_{self._n}"
        self._n += 1
        self._open.setdefault(name, []).append(call_id)
        return call_id

    def response(self, name: str, given: Any) -> str:
        waiting = self._open.get(name) or []
        if isinstance(given, str) and given:
            if given in waiting:
                waiting.remove(given)
            return given
        return waiting.pop(0) if waiting else f"call_{name}"


def _system_text(system: Content | str | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    texts = []
    for i, part in enumerate(system.parts):
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(
                "systemInstruction parts must be text", param=f"systemInstruction.parts[{i}]"
            )
        texts.append(text)
    return "\n".join(texts)


_IGNORED_PART_KEYS = frozenset({"thoughtSignature", "thought_signature", "videoMetadata"})


def _turn(where: str, content: Content, calls: _CallIds) -> list[dict[str, Any]]:
    role = (content.role or "user").lower()
    if role not in ("user", "model", "function", "tool"):
        raise InvalidRequest(f"{where}.role must be 'user' or 'model'", param=f"{where}.role")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    thoughts: list[str] = []
    ordered: list[dict[str, Any]] = []  # text and image parts, in order
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, part in enumerate(content.parts):
        at = f"{where}.parts[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        kinds = [k for k in part if k not in _IGNORED_PART_KEYS and k != "thought"]
        if "text" in part:
            if not isinstance(part["text"], str):
                raise InvalidRequest(f"{at}.text must be a string", param=f"{at}.text")
            if part.get("thought"):
                thoughts.append(part["text"])
            else:
                texts.append(part["text"])
                ordered.append({"type": "text", "text": part["text"]})
        elif "functionCall" in part:
            call = _object(part["functionCall"], f"{at}.functionCall")
            name = _name(call.get("name"), f"{at}.functionCall.name")
            args = call.get("args") or {}
            if not isinstance(args, dict):
                raise InvalidRequest(
                    f"{at}.functionCall.args must be an object", param=f"{at}.functionCall.args"
                )
            tool_calls.append(
                {
                    "id": calls.call(name, call.get("id")),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        elif "functionResponse" in part:
            response = _object(part["functionResponse"], f"{at}.functionResponse")
            name = _name(response.get("name"), f"{at}.functionResponse.name")
            output = response.get("response", {})
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": calls.response(name, response.get("id")),
                    "name": name,
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif "inlineData" in part:
            data = _object(part["inlineData"], f"{at}.inlineData")
            # (Protobuf's JSON takes both spellings; google-genai sends mime_type.)
            mime, b64 = data.get("mimeType", data.get("mime_type")), data.get("data")
            if not isinstance(mime, str) or not isinstance(b64, str):
                raise InvalidRequest(
                    f"{at}.inlineData needs 'mimeType' and 'data'", param=f"{at}.inlineData"
                )
            images.append(_media_part(mime, b64))
            ordered.append(images[-1])
        elif "fileData" in part:
            raise InvalidRequest(
                f"{at}: fileData parts (files uploaded to Google) cannot be read here; send "
                "the bytes as inlineData",
                param=f"{at}.fileData",
            )
        elif not kinds:
            continue  # only a thoughtSignature: nothing for the model
        else:
            shown = kinds[0] if len(kinds[0]) <= 64 else kinds[0][:61] + "..."
            raise InvalidRequest(f"{at}: unknown part kind '{shown}'", param=at)
    if role in ("function", "tool") or (results and not (texts or images or tool_calls)):
        return results
    if role == "model":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        if tool_calls:
            message["tool_calls"] = tool_calls
        return [message]
    # With images, the parts in the order they came: where an image stands in the text
    # is what the model sees.
    body: Any = ordered if images else "\n".join(texts)
    return [*results, {"role": "user", "content": body}]


# Audio types as OpenAI's input_audio ``format`` names them (the bytes decide in the end).
_AUDIO_FORMATS = {"x-wav": "wav", "wave": "wav", "vnd.wave": "wav", "mpeg": "mp3"}


def _media_part(mime: str, b64: str) -> dict[str, Any]:
    """An ``inlineData`` part as the neutral (OpenAI) one: an ``audio/*`` clip as an
    ``input_audio`` part, anything else as an ``image_url`` of its ``data:`` URI."""
    kind, _, subtype = mime.lower().partition("/")
    if kind == "audio":
        fmt = _AUDIO_FORMATS.get(subtype, subtype)
        return {"type": "input_audio", "input_audio": {"data": b64, "format": fmt}}
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    return value


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where} must be a non-empty string", param=where)
    return value


def _function(where: str, decl: Any) -> dict[str, Any]:
    decl = _object(decl, where)
    name = _name(decl.get("name"), f"{where}.name")
    if "parametersJsonSchema" in decl:
        parameters = _object(decl["parametersJsonSchema"], f"{where}.parametersJsonSchema")
    elif decl.get("parameters") is not None:
        parameters = openapi_to_json_schema(_object(decl["parameters"], f"{where}.parameters"))
    else:
        parameters = {"type": "object", "properties": {}}
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if isinstance(decl.get("description"), str):
        function["description"] = decl["description"]
    return {"type": "function", "function": function}


_KEEP = frozenset(
    {
        "description",
        "enum",
        "format",
        "required",
        "minimum",
        "maximum",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "title",
        "default",
        "example",
    }
)


def openapi_to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Gemini's OpenAPI-subset schema (``type: "OBJECT"``, ``nullable: true``,
    ``propertyOrdering``) as JSON Schema."""
    out: dict[str, Any] = {}
    kind = schema.get("type")
    if isinstance(kind, str) and kind.upper() != "TYPE_UNSPECIFIED":
        out["type"] = kind.lower()
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    for key, value in schema.items():
        if key in _KEEP:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):
            out["properties"] = {
                k: openapi_to_json_schema(v) if isinstance(v, dict) else v for k, v in value.items()
            }
        elif key == "items" and isinstance(value, dict):
            out["items"] = openapi_to_json_schema(value)
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            out["anyOf"] = [openapi_to_json_schema(v) for v in value if isinstance(v, dict)]
    return out
