"""Tool calls constrained in the model's own syntax (a :class:`ToolSyntax`).

The grammar writes each call exactly as the family's template shows it: the
markup as literals, the function's name as one of the offered names, the
arguments as the tool's JSON schema (``%json``) or, for markup-written
arguments, each declared parameter in declaration order (required ones always,
optional ones maybe), a string parameter's value as any text without the
closing markup, any other as JSON per its schema.

Example::

    g = syntax_grammar([ToolSpec("get_weather", schema)], qwen3_coder.tools, max_calls=1)
"""

from __future__ import annotations

import json
from typing import Any

from sluice.core.errors import InvalidRequest
from sluice.core.syntax import (
    KEY_NAME,
    STRING_FLAG,
    TYPE_NAME,
    CallId,
    CallObject,
    Element,
    GemmaArgs,
    IdName,
    Index,
    JsonArgs,
    Lit,
    Name,
    PythonArgs,
    Recipient,
    TaggedArgs,
    ToolSyntax,
)
from sluice.grammar.build import _literal, _schema, check
from sluice.grammar.spec import ToolSpec

_ID = r"/[A-Za-z0-9]{9}/"


def supports(syntax: ToolSyntax) -> bool:
    """Whether calls of ``syntax`` can be constrained (Python-style and Gemma 4's
    arguments cannot, yet)."""
    return not any(isinstance(e, (PythonArgs, GemmaArgs)) for e in syntax.call)


def syntax_grammar(
    tools: list[ToolSpec], syntax: ToolSyntax, *, max_calls: int, opened: str = ""
) -> str:
    """Output that is one to ``max_calls`` calls of ``tools`` written in ``syntax``
    (from its opening markup on; ``opened``: what the prompt already wrote of it)."""
    if not tools:
        raise InvalidRequest("No tools to call.", param="tools")
    rules: list[str] = []
    names = []
    firsts = []  # the first call, its opening cut by what the prompt wrote
    section_start = syntax.section_start
    head = syntax.call[0] if syntax.call else None
    if opened and section_start.startswith(opened):
        section_start, opened = section_start[len(opened) :], ""
    elif not (isinstance(head, Lit) and head.text.startswith(opened)):
        opened = ""
    for i, tool in enumerate(tools):
        check(
            f"start: {_schema(tool.parameters or {'type': 'object'}, tool.param)}\n",
            tool.param,
            "JSON schema",
        )
        parts = [_element(e, i, tool, rules) for e in syntax.call]
        rules.append(f"tool_{i}: " + " ".join(p for p in parts if p))
        names.append(f"tool_{i}")
        if opened and isinstance(head, Lit):
            first = [_lit(head.text[len(opened) :]), *parts[1:]]
            rules.append(f"first_{i}: " + " ".join(p for p in first if p))
            firsts.append(f"first_{i}")
    sep = _literal(syntax.separator) if syntax.separator else ""
    more = ""
    if max_calls > 1:
        more = f" ({sep + ' ' if sep else ''}call){{0,{max_calls - 1}}}"
    body = f"{'first' if firsts else 'call'}{more}"
    start = " ".join(p for p in (_lit(section_start), body, _lit(syntax.section_end)) if p)
    lines = [f"start: {start}", f"call: {' | '.join(names)}"]
    if firsts:
        lines.append(f"first: {' | '.join(firsts)}")
    grammar = "\n".join([*lines, *rules]) + "\n"
    return check(grammar, "tools", "tool grammar")


def _lit(text: str) -> str:
    return _literal(text) if text else ""


def _element(element: Element, i: int, tool: ToolSpec, rules: list[str]) -> str:
    params = tool.parameters or {"type": "object"}
    if isinstance(element, Lit):
        return _lit(element.text)
    if isinstance(element, (Name, Recipient)):
        return _literal(tool.name)
    if isinstance(element, CallId):
        return _ID
    if isinstance(element, Index):
        return "/[1-9][0-9]{0,2}/"
    if isinstance(element, IdName):
        return f"{_literal(element.prefix + tool.name + element.sep)} /[0-9]{{1,3}}/"
    if isinstance(element, JsonArgs):
        rules.append(f"args_{i}: {_schema(params, tool.param)}")
        return f"args_{i}"
    if isinstance(element, CallObject):
        rules.append(f"args_{i}: {_schema(params, tool.param)}")
        if element.name_is_key:
            return f"{_literal('{' + json.dumps(tool.name) + ': ')} args_{i} {_literal('}')}"
        head = f'{{"{element.name_key}": {json.dumps(tool.name)}, "{element.args_keys[0]}": '
        tail = _literal("}")
        if element.id_key:
            tail = f'{_literal(f", {json.dumps(element.id_key)}: ")} "\\"" {_ID} "\\"" {tail}'
        return f"{_literal(head)} args_{i} {tail}"
    if isinstance(element, TaggedArgs):
        return _tagged(element, i, params, tool, rules)
    raise InvalidRequest(f"Calls of this model's format cannot be constrained ({element!r}).")


def _tagged(
    spec: TaggedArgs, i: int, params: dict[str, Any], tool: ToolSpec, rules: list[str]
) -> str:
    return _members(spec, f"{i}", params, tool, rules)


def _members(
    spec: TaggedArgs, name: str, params: dict[str, Any], tool: ToolSpec, rules: list[str]
) -> str:
    """An object's members, each in the markup: required ones in order, optional ones
    where the schema lists them."""
    found = params.get("properties")
    props: dict[str, Any] = found if isinstance(found, dict) else {}
    required = set(params.get("required") or []) if isinstance(params, dict) else set()
    seq = []
    for j, (key, schema) in enumerate(props.items()):
        rule = f"p_{name}_{j}"
        value = schema if isinstance(schema, dict) else {}
        rules.append(f"{rule}: " + _member(spec, f"{name}_{j}", key, value, tool, rules))
        seq.append(rule if key in required else f"{rule}?")
    return " ".join(seq)


def _member(
    spec: TaggedArgs, name: str, key: str, schema: dict[str, Any], tool: ToolSpec, rules: list[str]
) -> str:
    """One argument: its opening markup, its value, its closing markup."""
    flag = "true" if _is_string(schema) else "false"
    suffix = spec.key_suffix.replace(STRING_FLAG, flag).replace(TYPE_NAME, _json_type(schema))
    head = _lit(spec.key_prefix + key + suffix + spec.value_prefix)
    closing = spec.value_suffix.replace(KEY_NAME, key)
    return f"{head} {_value(spec, name, schema, closing, tool, rules)}"


def _value(
    spec: TaggedArgs,
    name: str,
    schema: dict[str, Any],
    closing: str,
    tool: ToolSpec,
    rules: list[str],
) -> str:
    """A value and the markup that closes it."""
    value = f"v_{name}"
    choices = schema.get("enum")
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    stringy = _is_string(schema) or (spec.nested and _may_be_string(schema))
    if stringy and isinstance(choices, list) and choices:
        # One of the listed strings, written as it is.
        rules.append(f"{value}: " + " | ".join(_literal(str(c)) for c in choices))
    elif stringy:
        # Any text up to the closing markup (a lazy lexeme: it ends at the first one).
        rules.append(f"{value}[stop={json.dumps(closing)}]: /(.|\\n)*/")
        return value
    elif spec.nested and isinstance(alternatives, list) and alternatives:
        options = [
            _value(spec, f"{name}_{k}", a if isinstance(a, dict) else {}, closing, tool, rules)
            for k, a in enumerate(alternatives)
        ]
        rules.append(f"{value}: " + " | ".join(f"({o})" for o in options))
        return value
    elif spec.nested and isinstance(schema.get("properties"), dict) and schema["properties"]:
        rules.append(f"{value}: {_members(spec, name, schema, tool, rules)}")
    elif spec.nested and schema.get("type") == "array":
        items = schema.get("items")
        item = _member(
            spec, f"{name}_i", "item", items if isinstance(items, dict) else {}, tool, rules
        )
        rules.append(f"{value}: ({item})*")
    else:
        rules.append(f"{value}: {_schema(schema, tool.param)}")
    return f"{value} {_lit(closing)}"


def _json_type(schema: dict[str, Any]) -> str:
    """The JSON type a value of ``schema`` has, as Kimi K3's markup names it."""
    kind = schema.get("type")
    if kind == "integer":
        return "number"
    return kind if isinstance(kind, str) else "string"


def _may_be_string(schema: dict[str, Any]) -> bool:
    alternatives = schema.get("anyOf") or schema.get("oneOf") or []
    kind = schema.get("type")
    return (
        kind == "string"
        or (isinstance(kind, list) and "string" in kind)
        or any(isinstance(a, dict) and _may_be_string(a) for a in alternatives)
    )


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"
