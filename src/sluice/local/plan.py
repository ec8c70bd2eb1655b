"""Tools and structured output for a chat request: prompt, grammar, parsers.

One :class:`OutputPlan` per request says how the prompt carries the tools
(the template's own tool support, or a generic system prompt), which
grammar constrains decoding, and which streaming parsers read the output.

Tools and schemas are user input that becomes a grammar, so
:class:`ToolLimits` bounds them: how many tools, how many bytes of schema.
Each limit is a 400 naming the field and the setting.

Example::

    plan = OutputPlan.build(request, fmt="generic", reasoning=None, limits=ToolLimits())
    messages = plan.prepare_messages(messages)
    sampling = replace(sampling, grammar=plan.grammar, grammar_triggers=plan.triggers,
                       grammar_trigger_words=plan.trigger_words)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from sluice.core.errors import InvalidRequest
from sluice.core.request import GenerationRequest
from sluice.core.syntax import OutputFormat, ReasoningSyntax, ToolSyntax, first_chunk
from sluice.grammar import (
    CallFraming,
    ToolSpec,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from sluice.grammar.native import supports, syntax_grammar
from sluice.parsers import generic
from sluice.parsers.base import StreamParser
from sluice.parsers.formatted import FormatParser, openers
from sluice.parsers.harmony import HarmonyParser
from sluice.parsers.markup import MarkupStripper, Prepend
from sluice.parsers.reasoning import ReasoningParser
from sluice.parsers.registry import tool_parser

# How each family frames its calls; the parsers in sluice.parsers read exactly this.
FRAMINGS: dict[str, CallFraming] = {
    "hermes": CallFraming(call_open="<tool_call>\n", call_close="\n</tool_call>", sep="\n"),
    "generic": CallFraming(call_open="<tool_call>\n", call_close="\n</tool_call>", sep="\n"),
    "mistral": CallFraming(prefix="[TOOL_CALLS][", sep=", ", suffix="]"),
    "llama3": CallFraming(args_key="parameters", sep="; "),
}
# Where a lazily applied grammar engages (None: no lazy grammar for that family).
TRIGGERS: dict[str, str | None] = {
    "hermes": "<tool_call>",
    "generic": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "llama3": None,
}
MAX_PARALLEL_CALLS = 8
_RESPONSE_SCHEMA = "response_format.json_schema.schema"


@dataclass(frozen=True, slots=True)
class ToolLimits:
    """What one request's tools and schemas may cost (Settings ``max_tools``,
    ``max_schema_bytes``). llguidance compiles any schema in bounded time and masks
    a token in tens of microseconds whatever the schema's shape, so its size is the
    only bound on a schema.

    Example::

        ToolLimits(max_tools=s.max_tools, max_schema_bytes=s.max_schema_bytes)
    """

    max_tools: int = 128
    max_schema_bytes: int = 131072


@dataclass(slots=True)
class OutputPlan:
    """How one chat request's output is constrained and parsed."""

    fmt: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # the functions offered
    tool_choice: str = "none"  # none | auto | required | function:<name>
    grammar: str | None = None
    trigger_tag: str | None = None  # the call opening that engages a lazy grammar
    reasoning: ReasoningSyntax | None = None
    reasoning_opened: bool = False
    reasoning_lead: str = ""  # what the prompt wrote of the opened reasoning
    reasoning_budget: int = -1  # tokens the reasoning may take (sluice.local.budget)
    raw_tool_choice: str | dict[str, Any] | None = None
    parallel: bool = True
    syntax: ToolSyntax | None = None  # the family's own call syntax (``fmt`` "auto")
    markup: tuple[str, ...] = ()  # never content: the markup around the answer
    opening: str = ""  # what the prompt wrote of the output (OutputFormat.opening)
    answer_start: str = ""  # the answer's opening markup (OutputFormat.content_start)

    @classmethod
    def build(
        cls,
        body: GenerationRequest,
        *,
        fmt: str | OutputFormat,
        reasoning: ReasoningSyntax | None = None,
        limits: ToolLimits = ToolLimits(),
    ) -> OutputPlan:
        """The plan for ``body``; :class:`InvalidRequest` (400) naming the field if not.

        ``fmt``: a hand-written format's name, or a family's :class:`OutputFormat`
        (its reasoning markers then come from it)."""
        syntax = None
        markup: tuple[str, ...] = ()
        opening = answer_start = ""
        if isinstance(fmt, OutputFormat):
            if fmt.reasoning is not None and reasoning is None:
                reasoning = fmt.reasoning
            syntax = fmt.tools
            markup = (fmt.content_start, fmt.content_end, *fmt.strip)
            opening, answer_start = fmt.opening, fmt.content_start
            fmt = fmt.name
        tools = _validate_tools(body.tools, limits)
        choice = _tool_choice(body.tool_choice, tools)
        response_schema = _response_schema(body.response_format)
        _check_schema_bytes(tools, response_schema, limits)
        plan = cls(
            fmt=fmt,
            tools=tools if choice != "none" else [],
            tool_choice=choice,
            reasoning=reasoning,
            raw_tool_choice=body.tool_choice,
            parallel=body.parallel_tool_calls is not False,
            syntax=syntax,
            markup=tuple(m for m in markup if m),
            opening=opening,
            answer_start=answer_start,
        )
        json_grammar = _response_format_grammar(response_schema, limits)
        trigger = first_chunk(syntax.opener) if syntax is not None else TRIGGERS.get(fmt)
        if opening:  # the first call goes on from the prompt: no opening to trigger on
            trigger = None
        constrainable = syntax is None or supports(syntax)
        if (choice == "required" or choice.startswith("function:")) and constrainable:
            named = choice.split(":", 1)[1] if choice != "required" else None
            plan.grammar = _call_grammar(
                tools, named, fmt, body.parallel_tool_calls, syntax, opening
            )
        elif json_grammar is not None:
            plan.grammar = json_grammar
        elif choice == "auto" and trigger and constrainable:
            plan.grammar = _call_grammar(tools, None, fmt, body.parallel_tool_calls, syntax)
            plan.trigger_tag = trigger
        return plan

    @property
    def triggers(self) -> tuple[str, ...]:
        """Lazy-grammar patterns, for llama.cpp's ``regex_match`` over the whole output.

        The grammar takes over from the first capture group (the call opening),
        and never inside a reasoning block: a call written while thinking is
        not a call, and a grammar engaged there would keep the model from ever
        closing its reasoning.
        """
        if self.trigger_tag is None:
            return ()
        lead = ""
        if self.reasoning is not None:
            start, end = re.escape(self.reasoning.start), re.escape(self.reasoning.end)
            if self.reasoning_opened:
                lead = rf"[\s\S]*?{end}"
            else:
                lead = rf"(?:\s*{start}[\s\S]*?{end}|(?!\s*{start}))"
        return (rf"{lead}[\s\S]*?({re.escape(self.trigger_tag)})[\s\S]*",)

    @property
    def trigger_words(self) -> tuple[str, ...]:
        """The text each trigger's capture starts with (SamplingParams.grammar_trigger_words)."""
        return () if self.trigger_tag is None else (self.trigger_tag,)

    @property
    def forced_call(self) -> bool:
        """The answer must be a call (``tool_choice`` required or a named function)."""
        return bool(self.tools) and (
            self.tool_choice == "required" or self.tool_choice.startswith("function:")
        )

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools)

    @property
    def render_special(self) -> bool:
        """Llama 3, Mistral and most families' own formats write their markers as control
        tokens (the parsers must see them)."""
        if self.fmt == "harmony":  # its channels are control tokens, always
            return True
        if self.syntax is not None:
            return self.uses_tools or self.reasoning is not None
        return self.uses_tools and self.fmt in ("llama3", "mistral")

    @property
    def has_parsers(self) -> bool:
        return self.uses_tools or self.reasoning is not None or bool(self.markup)

    def template_extra(self) -> dict[str, Any]:
        """Variables for a template with its own tool support."""
        if self.uses_tools and self.fmt != "generic":
            return {"tools": self.tools}
        return {}

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the template should see them (tool history included)."""
        if self.fmt == "harmony":  # gpt-oss's template reads earlier reasoning as thinking
            return [_native_message(_harmony_thinking(m)) for m in messages]
        if self.fmt != "generic":
            as_text = self.syntax is not None and self.syntax.arguments_text
            return [_native_message(m, as_text) for m in messages]
        out = [_generic_message(m) for m in messages]
        if self.uses_tools:
            prompt = generic.tool_system_prompt(self.tools, self.raw_tool_choice, self.parallel)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def _call_openers(self) -> tuple[str, ...]:
        if not self.uses_tools:
            return ()
        if self.syntax is not None:
            return openers(self.syntax)
        trigger = TRIGGERS.get(self.fmt)
        return (trigger,) if trigger else ()

    def parsers(self, choice: int) -> list[StreamParser]:
        """The chain of streaming parsers for one choice (reasoning first)."""
        if self.fmt == "harmony":  # gpt-oss: one parser for channels, reasoning and calls
            return [HarmonyParser(choice)]
        chain: list[StreamParser] = [Prepend(choice, self.opening)] if self.opening else []
        if self.reasoning is not None:
            chain.append(
                ReasoningParser(
                    choice,
                    self.reasoning.start,
                    self.reasoning.end,
                    opened=self.reasoning_opened,
                    lead=self.reasoning_lead,
                    answer=self.answer_start,
                    # A forced call's grammar writes calls only after the reasoning:
                    # markup inside it is reasoning text, never a call.
                    interrupt=() if self.forced_call and self.grammar else self._call_openers(),
                )
            )
        if self.uses_tools:
            if self.syntax is not None:
                chain.append(FormatParser(choice, self.syntax, _parameter_types(self.tools)))
            else:
                chain.append(tool_parser(self.fmt, choice))
        if self.markup:  # after the calls: an argument may hold any text
            chain.append(MarkupStripper(choice, self.markup))
        return chain


def _parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schemas by name (how markup-written values are typed)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool["function"]
        props = (fn.get("parameters") or {}).get("properties")
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _call_grammar(
    tools: list[dict[str, Any]],
    only: str | None,
    fmt: str,
    parallel: bool | None,
    syntax: ToolSyntax | None,
    opening: str = "",
) -> str:
    """Calls of ``tools`` (or only the one named), arguments per each tool's schema,
    in the family's own syntax when it has one (``opening``: what the prompt wrote)."""
    specs = [
        ToolSpec(
            t["function"]["name"],
            t["function"].get("parameters") or {},
            param=f"tools[{i}].function.parameters",
        )
        for i, t in enumerate(tools)
        if only is None or t["function"]["name"] == only
    ]
    # gpt-oss ends a call's message with <|call|>, which ends its turn: one call a turn.
    max_calls = 1 if fmt == "harmony" else _max_calls(parallel, len(specs))
    if syntax is not None:
        return syntax_grammar(specs, syntax, max_calls=max_calls, opened=opening)
    return tool_call_grammar(specs, FRAMINGS[fmt], max_calls=max_calls)


def _max_calls(parallel: bool | None, n_tools: int) -> int:
    if parallel is False:
        return 1
    if parallel is None:
        # OpenAI's default allows parallel calls; bound them by the tools offered so a
        # small model cannot loop on one call until max_tokens cuts it.
        return max(1, min(n_tools, MAX_PARALLEL_CALLS))
    return MAX_PARALLEL_CALLS


def _validate_tools(tools: list[dict[str, Any]] | None, limits: ToolLimits) -> list[dict[str, Any]]:
    if tools is not None and len(tools) > limits.max_tools:
        raise InvalidRequest(
            f"This request offers {len(tools)} tools; the limit is {limits.max_tools} "
            "(--max-tools).",
            param="tools",
        )
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise InvalidRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                param=f"tools[{i}]",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidRequest(
                f"tools[{i}].function.name must be 1-64 of [A-Za-z0-9_.-]",
                param=f"tools[{i}].function.name",
            )
        if name in names:
            raise InvalidRequest(f"Duplicate tool name '{name}'", param=f"tools[{i}].function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(
                f"tools[{i}].function.parameters must be a JSON schema object",
                param=f"tools[{i}].function.parameters",
            )
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> str:
    if raw is None:
        return "auto" if tools else "none"
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidRequest(
                "tool_choice must be none, auto, required or a function", param="tool_choice"
            )
        if raw != "none" and not tools:
            raise InvalidRequest(f"tool_choice '{raw}' needs 'tools'", param="tool_choice")
        return raw
    shape = "{'type': 'function', 'function': {'name': ...}}"
    if not isinstance(raw, dict):
        raise InvalidRequest(
            f"tool_choice must be none, auto, required or {shape}", param="tool_choice"
        )
    kind = raw.get("type", "function")
    if kind != "function":
        raise InvalidRequest(
            f"tool_choice type {_short(kind)} is not supported: use {shape}",
            param="tool_choice.type",
        )
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(
            f"tool_choice.function must be an object: {shape}", param="tool_choice.function"
        )
    name = fn.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(
            f"tool_choice.function.name must be a string: {shape}",
            param="tool_choice.function.name",
        )
    if not tools:
        raise InvalidRequest(
            f"tool_choice names '{_short(name)}' but there are no 'tools'", param="tool_choice"
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequest(
            f"tool_choice names '{_short(name)}', which is not in 'tools'", param="tool_choice"
        )
    return f"function:{name}"


def _short(value: Any, n: int = 64) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _response_schema(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema output must follow: None for text, ``{}`` marks ``json_object``."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest(
                "response_format.json_schema must be {'name': ..., 'schema': {...}}",
                param="response_format.json_schema",
            )
        schema: dict[str, Any] = spec.get("schema") or {"type": "object"}
        return schema
    raise InvalidRequest(
        f"response_format type {_short(kind)} is not one of text, json_object, json_schema",
        param="response_format.type",
    )


def _check_schema_bytes(
    tools: list[dict[str, Any]], response_schema: dict[str, Any] | None, limits: ToolLimits
) -> None:
    """The JSON size of all the schemas; a 400 names the field where it passes the limit."""
    fields = [
        (f"tools[{i}].function.parameters", t["function"].get("parameters"))
        for i, t in enumerate(tools)
    ]
    fields.append((_RESPONSE_SCHEMA, response_schema))
    total = 0
    for param, schema in fields:
        if schema is None:
            continue
        total += len(json.dumps(schema))
        if total > limits.max_schema_bytes:
            raise InvalidRequest(
                f"The JSON schemas of this request (tools' parameters and response_format) "
                f"reach {total} bytes at '{param}'; the limit is {limits.max_schema_bytes} "
                "(--max-schema-bytes).",
                param=param,
            )


def _response_format_grammar(schema: dict[str, Any] | None, limits: ToolLimits) -> str | None:
    if schema is None:
        return None
    if not schema:
        return json_object_grammar()
    return json_schema_grammar(schema, param=_RESPONSE_SCHEMA)


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _harmony_thinking(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's reasoning as gpt-oss's template takes it (``thinking``); with
    both an answer and calls, its template takes one or the other: the answer."""
    reasoning = message.get("reasoning_content")
    if message.get("role") != "assistant" or not reasoning or "thinking" in message:
        return message
    rest = {k: v for k, v in message.items() if k != "reasoning_content"}
    if message.get("content") and message.get("tool_calls"):
        return rest
    return {**rest, "thinking": reasoning}


def _native_message(message: dict[str, Any], as_text: bool = False) -> dict[str, Any]:
    """HF-convention templates expect tool-call arguments as objects (a few as the
    JSON text, ``as_text``)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments", {})
        fn["arguments"] = _arguments_text(args) if as_text else _arguments_object(args)
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


def _generic_message(message: dict[str, Any]) -> dict[str, Any]:
    """Tool history written as plain text for templates that know no tools."""
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>",
        }
    if message["role"] == "assistant" and message.get("tool_calls"):
        blocks = [
            generic.tool_call_text(
                (c.get("function") or {}).get("name", ""),
                _arguments_text((c.get("function") or {}).get("arguments", {})),
            )
            for c in message["tool_calls"]
        ]
        text = "\n".join([message.get("content") or "", *blocks]).strip()
        rest = {k: v for k, v in message.items() if k != "tool_calls"}
        return {**rest, "content": text}
    return message
