"""Wire schema of Anthropic's ``POST /v1/messages`` (and ``count_tokens``), with pydantic.

The top-level fields are validated by pydantic; content blocks are read by hand,
so that every error names the block the way a client wrote it
(``messages[2].content[0]``) and an unknown block type is a 400 naming it, never a
500. Fields sluice has no use for (``metadata``, ``cache_control``,
``service_tier``, ...) are accepted: Claude Code and the SDKs send them on every
request.

The body becomes the neutral :class:`~sluice.core.request.GenerationRequest`:

* ``system`` (a string or text blocks) -> the first message, role ``system``;
* ``tool_result`` blocks -> ``tool`` messages (before the user's text of the same
  turn, the order Anthropic requires of them), ``is_error`` marked in the text;
* ``tool_use`` blocks -> the assistant message's ``tool_calls`` (arguments as JSON
  text), ``thinking`` blocks -> its ``reasoning_content`` (signatures are not
  checked: they are opaque, and a local server has nothing to verify them with);
* ``image`` blocks -> OpenAI ``image_url`` parts, which only an upstream model can
  take (the route answers 400 for a local one, :meth:`MessagesRequest.has_images`);
* ``tools`` -> OpenAI function tools, ``tool_choice`` ``any`` -> ``required`` and a
  named tool -> that function (grammar-constrained on a local model);
* ``output_config.format`` (``json_schema``) -> a ``response_format``.

Example::

    body = parse({"model": "smollm2", "max_tokens": 64,
                  "messages": [{"role": "user", "content": "Hi"}]}, MessagesRequest)
    request = body.to_request()
    request.messages    # [{"role": "user", "content": "Hi"}]
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from sluice.core.errors import InvalidRequest
from sluice.core.request import GenerationRequest, SamplingParams
from sluice.server.jsonbody import validate_body

_INT32_MAX = 2**31 - 1

# Blocks a client may send back that carry nothing for the model: Anthropic's own
# server-side tool traffic and encrypted thinking. Dropped from the prompt.
_DROPPED_BLOCKS = frozenset(
    {
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "container_upload",
        "tool_search_tool_result",
    }
)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class Message(_Wire):
    # "system": Claude Code puts system text between turns (its agent list, reminders)
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class _Fields(_Wire):
    """What ``messages`` and ``count_tokens`` share: the prompt."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: dict[str, Any] | None = None

    def has_images(self) -> bool:
        return any(
            isinstance(m.content, list) and any(_is_image(b) for b in _flat_blocks(m.content))
            for m in self.messages
        )

    def neutral_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages, the system prompt first.

        System text between the turns joins the system prompt: many chat templates
        refuse a system message anywhere but first.
        """
        system = [_system_text("system", self.system)]
        out: list[dict[str, Any]] = []
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            if message.role == "system":
                system.append(_system_text(f"{where}.content", message.content))
            elif isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                out.extend(_user_messages(where, message.content))
            else:
                out.append(_assistant_message(where, message.content))
        text = "\n\n".join(t for t in system if t)
        return [{"role": "system", "content": text}, *out] if text else out

    def neutral_tools(self) -> list[dict[str, Any]] | None:
        """The client's tools as OpenAI function tools; tools only Anthropic's own
        servers can run (``web_search_...``, ``bash_...``) are left out."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            function = _function_tool(f"tools[{i}]", tool)
            if function is not None:
                out.append(function)
        return out or None

    def neutral_tool_choice(self, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            return "auto" if tools else "none"
        if choice.type == "none":
            return "none"
        if not tools:
            raise InvalidRequest(
                f"tool_choice '{choice.type}' needs 'tools'", param="tool_choice.type"
            )
        if choice.type == "any":
            return "required"
        if not choice.name:
            raise InvalidRequest("tool_choice 'tool' needs a 'name'", param="tool_choice.name")
        names = {t["function"]["name"] for t in tools}
        if choice.name not in names:
            raise InvalidRequest(
                f"tool_choice names '{choice.name[:64]}', which is not in 'tools'",
                param="tool_choice.name",
            )
        return {"type": "function", "function": {"name": choice.name}}

    def template_kwargs(self) -> dict[str, Any] | None:
        """``thinking`` as the chat template's switch (templates without one ignore it)."""
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.type != "disabled"}

    def reasoning_budget(self) -> int | None:
        """``thinking.budget_tokens`` when enabled; None: not set. (``disabled`` is the
        template's switch, :meth:`template_kwargs`: reasoning a model writes anyway is
        still read as reasoning, as llama.cpp reads it.)"""
        if self.thinking is None or self.thinking.type != "enabled":
            return None
        return self.thinking.budget_tokens

    def response_format(self) -> dict[str, Any] | None:
        """``output_config.format`` (structured outputs) as an OpenAI ``response_format``."""
        config = self.output_config or {}
        fmt = config.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise InvalidRequest(
                "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                param="output_config.format",
            )
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "output_config.format.schema must be a JSON schema object",
                param="output_config.format.schema",
            )
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}

    def prompt_request(self, **fields: Any) -> GenerationRequest:
        """The neutral request of this prompt (``fields``: the generation's own)."""
        tools = self.neutral_tools()
        choice = self.neutral_tool_choice(tools)
        parallel = None
        if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use:
            parallel = False
        return GenerationRequest(
            model=self.model,
            messages=self.neutral_messages(),
            tools=tools,
            tool_choice=choice if tools else None,
            parallel_tool_calls=parallel,
            response_format=self.response_format(),
            template_kwargs=self.template_kwargs(),
            reasoning_budget=self.reasoning_budget(),
            # A final assistant message is the answer's beginning (Anthropic's prefill).
            continue_final=bool(self.messages) and self.messages[-1].role == "assistant",
            **fields,
        )


class MessagesRequest(_Fields):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    # Known, and nothing for sluice to do (so not logged as unknown on every request):
    # sluice's prompt cache needs no marks; there is one service tier.
    cache_control: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    service_tier: str | None = None
    # llama.cpp's extension, as on the OpenAI endpoints: generate max_tokens, EOS or not
    # (benchmarks use it to compare dialects token for token)
    ignore_eos: bool = False

    def to_request(self) -> GenerationRequest:
        """The neutral request; :class:`InvalidRequest` naming what is wrong."""
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else min(self.top_k, _INT32_MAX),
            ignore_eos=self.ignore_eos,
        )
        return self.prompt_request(
            sampling=sampling,
            max_tokens=self.max_tokens,
            stop=tuple(self.stop_sequences or ()),
        )


class CountTokensRequest(_Fields):
    """``POST /v1/messages/count_tokens``: the prompt of a ``messages`` request."""

    def to_request(self) -> GenerationRequest:
        return self.prompt_request(max_tokens=1)


M = TypeVar("M", bound=_Wire)


def parse(data: dict[str, Any], model: type[M]) -> M:
    """``data`` as ``model``; :class:`InvalidRequest` naming the first bad field."""
    return validate_body(data, model)


# -- blocks ----------------------------------------------------------------------------


def _block_type(where: str, block: Any) -> str:
    if not isinstance(block, dict):
        raise InvalidRequest(f"{where} must be a content block object", param=where)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where} has no 'type'", param=f"{where}.type")
    return kind


def _text(where: str, block: dict[str, Any]) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
    return text


def _unsupported(where: str, kind: str, role: str) -> InvalidRequest:
    shown = kind if len(kind) <= 64 else kind[:61] + "..."
    return InvalidRequest(
        f"{where}: content blocks of type '{shown}' are not supported in {role} messages",
        param=f"{where}.type",
    )


def _is_image(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "image"


def _flat_blocks(blocks: list[Any]) -> list[Any]:
    """The blocks and the blocks inside ``tool_result`` contents."""
    out = list(blocks)
    for block in blocks:
        if isinstance(block, dict) and isinstance(block.get("content"), list):
            out.extend(block["content"])
    return out


def _system_text(field: str, system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for i, block in enumerate(system):
        where = f"{field}[{i}]"
        kind = _block_type(where, block)
        if kind != "text":
            raise _unsupported(where, kind, "system")
        parts.append(_text(where, block))
    return "\n\n".join(parts)


def _image_part(where: str, block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest(f"{where}.source must be an object", param=f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise InvalidRequest(
                f"{where}.source needs 'media_type' and 'data' strings", param=f"{where}.source"
            )
        url = f"data:{media};base64,{data}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise InvalidRequest(
            f"{where}.source must be a base64 or url image source", param=f"{where}.source.type"
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts joined into one string; with an image, the OpenAI parts list."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _user_parts(where: str, blocks: list[Any], role: str) -> list[dict[str, Any]]:
    return [
        part for j, block in enumerate(blocks) for part in _one_part(f"{where}[{j}]", block, role)
    ]


def _tool_message(where: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(
            f"{where}.tool_use_id must be a non-empty string", param=f"{where}.tool_use_id"
        )
    raw = block.get("content", "")
    if isinstance(raw, str):
        content: str | list[dict[str, Any]] = raw
    elif isinstance(raw, list):
        content = _content(_user_parts(f"{where}.content", raw, "tool_result"))
    else:
        raise InvalidRequest(
            f"{where}.content must be a string or content blocks", param=f"{where}.content"
        )
    if block.get("is_error") is True and isinstance(content, str):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _user_messages(where: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, then its own content."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if _block_type(at, block) == "tool_result":
            tools.append(_tool_message(at, block))
        else:
            parts.extend(_one_part(at, block, "user"))
    out = tools
    if parts or not tools:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _one_part(where: str, block: Any, role: str) -> list[dict[str, Any]]:
    """A text or image block as an OpenAI content part (none for a dropped block)."""
    kind = _block_type(where, block)
    if kind == "text":
        return [{"type": "text", "text": _text(where, block)}]
    if kind == "image":
        return [_image_part(where, block)]
    if kind in _DROPPED_BLOCKS:
        return []
    raise _unsupported(where, kind, role)


def _assistant_message(where: str, blocks: list[Any]) -> dict[str, Any]:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(at, block)
        if kind == "text":
            text.append(_text(at, block))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise InvalidRequest(f"{at}.thinking must be a string", param=f"{at}.thinking")
            reasoning.append(thinking)
        elif kind == "tool_use":
            calls.append(_tool_call(at, block))
        elif kind not in _DROPPED_BLOCKS:
            raise _unsupported(at, kind, "assistant")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{where}.id must be a non-empty string", param=f"{where}.id")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.name must be a non-empty string", param=f"{where}.name")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.input must be an object", param=f"{where}.input")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _function_tool(where: str, tool: Any) -> dict[str, Any] | None:
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = tool.get("type")
    name = tool.get("name")
    if kind not in (None, "custom"):
        # One of Anthropic's own tools (web_search_20250305, bash_20250124, ...): only
        # Anthropic's servers run them, and they have no schema to put in a prompt.
        return None
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.name must be a non-empty string", param=f"{where}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise InvalidRequest(
            f"{where}.input_schema must be a JSON schema of type 'object'",
            param=f"{where}.input_schema",
        )
    function: dict[str, Any] = {"name": name, "parameters": schema}
    description = tool.get("description")
    if isinstance(description, str) and description:
        function["description"] = description
    return {"type": "function", "function": function}
