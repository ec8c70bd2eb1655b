"""Wire schema of OpenAI's ``POST /v1/responses``, with pydantic; input items read by hand.

Top-level fields are validated by pydantic; the ``input`` items are read by hand so
that an error names the item (``input[3].content[0]``). What a local server cannot
serve is accepted and left out, as the issue and Codex need: tools other than
``function`` (``web_search``, ``file_search``, ``custom``, ``local_shell``, ``mcp``,
...), history items of those tools, ``include``, ``reasoning.summary``,
``truncation``, ``metadata``, ``prompt_cache_key``.

The body becomes the neutral :class:`~sluice.core.request.GenerationRequest`:

* ``instructions`` -> the system message (a continued response's instructions are
  not carried over, as in OpenAI's API: the route drops the stored ones);
* message items -> messages (``developer`` -> ``system``; ``input_text`` /
  ``output_text`` parts joined; ``input_image`` -> an OpenAI ``image_url`` part,
  which only an upstream model takes);
* ``function_call`` items -> the assistant message's ``tool_calls``,
  ``function_call_output`` items -> ``tool`` messages, ``reasoning`` items -> the
  next assistant message's ``reasoning_content``;
* ``text.format`` -> ``response_format`` (``json_schema`` grammar-constrained on a
  local model), ``max_output_tokens`` -> ``max_tokens``, ``reasoning.effort`` ->
  ``reasoning_effort``.

Example::

    body = parse({"model": "smollm2", "input": "Hi"}, ResponsesRequest)
    body.neutral_request(history=[]).messages   # [{"role": "user", "content": "Hi"}]
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sluice.core.errors import InvalidRequest
from sluice.core.request import GenerationRequest, SamplingParams
from sluice.server.jsonbody import validate_body

_INT32_MAX = 2**31 - 1

# History items of tools only OpenAI's servers run: nothing a local model can read.
_DROPPED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "compaction",
    }
)
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class Reasoning(_Wire):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Wire):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, Any] | None = None
    # Known, nothing for sluice to do: not logged as unknown on every Codex request.
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's, on every request
    # llama.cpp's extension, as on the OpenAI endpoints (benchmarks compare token counts)
    ignore_eos: bool = False

    def check(self) -> None:
        if self.background and not self.store:
            raise InvalidRequest("'background' needs 'store': true", param="background")

    def has_images(self) -> bool:
        return any(_is_image(part) for item in self.items() for part in _parts_of(item))

    def items(self) -> list[dict[str, Any]]:
        """``input`` as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise InvalidRequest(f"input[{i}] must be an object (an item)", param=f"input[{i}]")
        return list(self.input)

    def neutral_tools(self) -> list[dict[str, Any]] | None:
        """The function tools, as chat's; the other tool types are left out."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise InvalidRequest(f"{where} must be an object", param=where)
            if tool.get("type") != "function":
                continue  # web_search, file_search, custom, local_shell, mcp: not served here
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(
                    f"{where}.name must be a non-empty string", param=f"{where}.name"
                )
            function: dict[str, Any] = {"name": name}
            parameters = tool.get("parameters")
            if parameters is not None:
                if not isinstance(parameters, dict):
                    raise InvalidRequest(
                        f"{where}.parameters must be a JSON schema object",
                        param=f"{where}.parameters",
                    )
                function["parameters"] = parameters
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            if isinstance(tool.get("strict"), bool):
                function["strict"] = tool["strict"]
            out.append({"type": "function", "function": function})
        return out or None

    def neutral_tool_choice(
        self, tools: list[dict[str, Any]] | None
    ) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if not tools:
            return None
        if choice is None or choice in ("auto", "none", "required"):
            return choice or "auto"
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = choice.get("name")
            names = {t["function"]["name"] for t in tools}
            if not isinstance(name, str) or name not in names:
                raise InvalidRequest(
                    f"tool_choice names {str(name)[:64]!r}, which is not a function in 'tools'",
                    param="tool_choice.name",
                )
            return {"type": "function", "function": {"name": name}}
        if isinstance(choice, str):
            raise InvalidRequest(
                "tool_choice must be auto, none, required or a function", param="tool_choice"
            )
        return "auto"  # a hosted tool's choice (web_search, mcp, allowed_tools): the model picks

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise InvalidRequest("text.format must be an object", param="text.format")
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            schema = fmt.get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequest(
                    "text.format.schema must be a JSON schema object", param="text.format.schema"
                )
            spec: dict[str, Any] = {"name": fmt.get("name") or "output", "schema": schema}
            if isinstance(fmt.get("strict"), bool):
                spec["strict"] = fmt["strict"]
            return {"type": "json_schema", "json_schema": spec}
        raise InvalidRequest(
            "text.format.type must be text, json_object or json_schema", param="text.format.type"
        )

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input items as chat-template messages (no instructions)."""
        return items_to_messages(self.items())

    def neutral_request(self, history: list[dict[str, Any]]) -> GenerationRequest:
        """The neutral request: the instructions, ``history`` (a continued response's
        messages, without its instructions), then this request's input."""
        turns = history + self.input_messages()
        # One system message, first: the instructions and every system or developer
        # message (Codex sends its prompt as developer messages); many chat templates
        # refuse a system message anywhere else, or a second one.
        system = [self.instructions] if self.instructions else []
        system += [
            m["content"] for m in turns if m["role"] == "system" and isinstance(m["content"], str)
        ]
        messages = [m for m in turns if m["role"] != "system" or not isinstance(m["content"], str)]
        if system:
            messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
        if not messages:
            raise InvalidRequest("'input' is empty", param="input")
        tools = self.neutral_tools()
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            ignore_eos=self.ignore_eos,
        )
        return GenerationRequest(
            model=self.model,
            messages=messages,
            tools=tools,
            tool_choice=self.neutral_tool_choice(tools),
            parallel_tool_calls=self.parallel_tool_calls if tools else None,
            response_format=self.response_format(),
            reasoning_effort=self.reasoning.effort if self.reasoning else None,
            sampling=sampling,
            max_tokens=self.max_output_tokens,
        )


def parse(data: dict[str, Any]) -> ResponsesRequest:
    body = validate_body(data, ResponsesRequest)
    body.check()
    return body


# -- items ---------------------------------------------------------------------------


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _parts_of(item: dict[str, Any]) -> list[Any]:
    content = item.get("content") if "role" in item else item.get("output")
    return content if isinstance(content, list) else []


def _content(where: str, content: Any) -> str | list[dict[str, Any]]:
    """A message's content: a string, or parts (text joined; an image kept as a part)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{at}.text must be a string", param=f"{at}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequest(
                    f"{at}: only images given by 'image_url' are supported", param=f"{at}.image_url"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            shown = str(kind)[:64]
            raise InvalidRequest(
                f"{at}: content parts of type '{shown}' are not supported", param=f"{at}.type"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat-template messages."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items: the next assistant message's

    def assistant() -> dict[str, Any]:
        last = out[-1] if out else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            out.append(last)
        if reasoning:
            last["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return last

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(
                    f"{where}.role must be user, assistant, system or developer",
                    param=f"{where}.role",
                )
            content = _content(f"{where}.content", item.get("content", ""))
            if role == "assistant":
                message = {"role": "assistant", "content": content}
                if reasoning:
                    message["reasoning_content"] = "".join(reasoning)
                    reasoning.clear()
                out.append(message)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise InvalidRequest(
                    f"{where} needs 'call_id' and 'name' strings", param=f"{where}.call_id"
                )
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
            output = item.get("output", "")
            if not isinstance(output, str):
                output = _content(f"{where}.output", output)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts: list[Any] = []
            for field in ("content", "summary"):
                value = item.get(field)
                if value is not None and not isinstance(value, list):
                    raise InvalidRequest(
                        f"{where}.{field} must be a list of text parts",
                        param=f"{where}.{field}",
                    )
                parts += value or []
            for part in parts:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        elif kind in _DROPPED_ITEMS:
            continue
        else:
            shown = str(kind)[:64]
            raise InvalidRequest(
                f"{where}: input items of type '{shown}' are not supported", param=f"{where}.type"
            )
    return out
