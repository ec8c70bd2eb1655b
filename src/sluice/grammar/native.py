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
    GEMMA_QUOTE,
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
    first_chunk,
)
from sluice.grammar.build import _literal, _schema, check
from sluice.grammar.spec import ToolSpec

_ID = r"/[A-Za-z0-9]{9}/"
_CONSTRAINABLE = (
    Lit,
    Name,
    CallId,
    IdName,
    Recipient,
    Index,
    JsonArgs,
    TaggedArgs,
    CallObject,
    PythonArgs,
    GemmaArgs,
)


def supports(syntax: ToolSyntax) -> bool:
    """Whether calls of ``syntax`` can be constrained (every element sluice reads can)."""
    return all(isinstance(e, _CONSTRAINABLE) for e in syntax.call)


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
    if isinstance(element, PythonArgs):
        members = [
            (f"{_literal(key + '=')} {_python_value(f'{i}_{j}', value, tool, rules)}", req)
            for j, (key, value, req) in enumerate(_properties(params))
        ]
        return f'"(" {_sequence(members, _literal(", "), f"py_{i}", rules)} ")"'
    if isinstance(element, GemmaArgs):
        return _gemma_value(f"{i}", params, tool, rules, top=True)
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
        # Any text up to the closing markup's tag (a lazy lexeme: it ends at the first
        # one, as the reader does; a closing tag named by the key is matched whole), then
        # the rest of the closing. Whitespace before the tag is the value's own text.
        tag = closing if KEY_NAME in spec.value_suffix else first_chunk(closing)
        rules.append(f"{value}[stop={json.dumps(tag)}]: /(.|\\n)*/")
        return f"{value} {_lit(closing.partition(tag)[2])}"
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


def _properties(params: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """An object schema's members: (key, schema, required), in the schema's order."""
    found = params.get("properties")
    props: dict[str, Any] = found if isinstance(found, dict) else {}
    required = set(params.get("required") or [])
    return [(k, v if isinstance(v, dict) else {}, k in required) for k, v in props.items()]


def _sequence(members: list[tuple[str, bool]], sep: str, name: str, rules: list[str]) -> str:
    """Members in order, optional ones left out, ``sep`` between those written."""
    if not members:
        return ""
    n = len(members)

    def after(k: int) -> str:  # the members from k on, once one was written
        return " ".join(f"({sep} {m})" + ("" if req else "?") for m, req in members[k:])

    for k in range(n - 1, -1, -1):  # s_k: a nonempty run starting at member k or later
        member, req = members[k]
        alts = [f"{member} {after(k + 1)}".strip()]
        if not req and k + 1 < n:
            alts.append(f"{name}_s{k + 1}")
        rules.append(f"{name}_s{k}: " + " | ".join(alts))
    return f"{name}_s0" if any(req for _, req in members) else f"{name}_s0?"


def _first(member: tuple[str, dict[str, Any], bool]) -> str:
    return member[0]


def _python_value(name: str, schema: dict[str, Any], tool: ToolSpec, rules: list[str]) -> str:
    """A keyword argument's value as a Python literal (LFM2's calls)."""
    kind = schema.get("type")
    if kind == "boolean":  # LFM2 writes Python's, and sometimes JSON's
        return '("True" | "False" | "true" | "false")'
    if kind == "null":
        return '("None" | "null")'
    if kind in ("string", "number", "integer") or "enum" in schema or "const" in schema:
        rules.append(f"v_{name}: {_schema(schema, tool.param)}")  # JSON's is Python's too
        return f"v_{name}"
    if kind == "array" and isinstance(schema.get("items"), dict) and schema["items"]:
        item = _python_value(f"{name}_i", schema["items"], tool, rules)
        return f'"[" ({item} (", " {item})*)? "]"'
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        members = [
            (
                f"{_literal(json.dumps(key) + ': ')} {_python_value(f'{name}_{j}', v, tool, rules)}",
                r,
            )
            for j, (key, v, r) in enumerate(_properties(schema))
        ]
        return f'"{{" {_sequence(members, _literal(", "), f"pyo_{name}", rules)} "}}"'
    return _generic("py", rules)


def _gemma_value(
    name: str, schema: dict[str, Any], tool: ToolSpec, rules: list[str], top: bool = False
) -> str:
    """A value in Gemma 4's notation: strings between its quote marks, bare keys."""
    quote = _literal(GEMMA_QUOTE)
    kind = schema.get("type")
    choices = schema.get("enum")
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    props = schema.get("properties")
    if top or (kind == "object" and isinstance(props, dict) and props):
        members = [
            (f"{_literal(key + ':')} {_gemma_value(f'{name}_{j}', value, tool, rules)}", req)
            for j, (key, value, req) in enumerate(sorted(_properties(schema), key=_first))
        ]
        return f'"{{" {_sequence(members, _literal(","), f"g_{name}", rules)} "}}"'
    if kind == "string" and isinstance(choices, list) and choices:
        return f"{quote} ({' | '.join(_literal(str(c)) for c in choices)}) {quote}"
    if kind == "string":
        rules.append(f"v_{name}[stop={json.dumps(GEMMA_QUOTE)}]: /(.|\\n)*/")
        return f"{quote} v_{name}"
    if kind == "array" and isinstance(schema.get("items"), dict) and schema["items"]:
        item = _gemma_value(f"{name}_i", schema["items"], tool, rules)
        return f'"[" ({item} ("," {item})*)? "]"'
    if isinstance(alternatives, list) and alternatives:
        options = [
            _gemma_value(f"{name}_{k}", a if isinstance(a, dict) else {}, tool, rules)
            for k, a in enumerate(alternatives)
        ]
        return "(" + " | ".join(f"({o})" for o in options) + ")"
    if kind in ("number", "integer", "boolean", "null") or "const" in schema:
        rules.append(f"v_{name}: {_schema(schema, tool.param)}")
        return f"v_{name}"
    return _generic("gemma", rules)


_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
_JSON_STRING = r'/"([^"\\]|\\.)*"/'


# Any value in a notation: (string, true, false, null, separator, key, colon).
_NOTATIONS = {
    # LFM2 writes Python's literals, and sometimes JSON's
    "py": (_JSON_STRING, '("True" | "true")', '("False" | "false")', '("None" | "null")')
    + ('", "', _JSON_STRING, '": "'),
    "gemma": (_literal(GEMMA_QUOTE) + " gemma_text", '"true"', '"false"', '"null"')
    + ('","', "/[A-Za-z_][A-Za-z0-9_.-]*/", '":"'),
}


def _generic(kind: str, rules: list[str]) -> str:
    """Any value, where the schema says no more, in Python's or Gemma 4's notation."""
    name = f"{kind}_any"
    if any(r.startswith(name + ":") for r in rules):
        return name
    if kind == "gemma":
        rules.append(f"gemma_text[stop={json.dumps(GEMMA_QUOTE)}]: /(.|\\n)*/")
    string, true, false, null, sep, key, colon = _NOTATIONS[kind]
    rules.append(
        f"{name}: {string} | {_NUMBER} | {true} | {false} | {null}"
        f' | "[" ({name} ({sep} {name})*)? "]"'
        f' | "{{" ({key} {colon} {name} ({sep} {key} {colon} {name})*)? "}}"'
    )
    return name


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
