"""Whole grammars, in llguidance's Lark dialect: a JSON schema's, or tool calls'.

A schema goes to llguidance's own JSON-schema compiler as it is (``%json {...}``,
Draft 2020-12 with the departures its docs list): bounded lengths, repetitions,
enums and ``anyOf`` cost llguidance nothing per token beyond its mask, so none of
them is limited here. Only the framing of tool calls around the schemas is
written by hand. Every grammar is checked by llguidance when it is built: a
schema it cannot compile is a 400 naming the request field.

Example::

    hermes = CallFraming(call_open="<tool_call>", call_close="</tool_call>")
    g = tool_call_grammar([ToolSpec("get_weather", schema)], hermes, max_calls=1)
    g = json_schema_grammar(schema, param="response_format.json_schema.schema")
"""

from __future__ import annotations

import json
from typing import Any

from sluice.core.deepstack import run_deep
from sluice.core.errors import InvalidRequest
from sluice.core.syntax import regex_text
from sluice.grammar.spec import CallFraming, ToolSpec

# How the JSON is written: one space after a comma and a colon, as json.dumps does
# (fixed: a model that may choose spends tokens choosing). Unknown keywords and
# formats are ignored, as llama.cpp's converter did, rather than refused.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}


_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _closed(node: Any, close: bool = True) -> Any:
    """A copy of a schema whose objects with ``properties`` and no word on others admit
    no others: what llama.cpp's converter (and so llama-server) generates, and what a
    client listing properties expects, where JSON Schema would let the model add any
    key it likes. The branches of an ``allOf`` describe one object together, so they
    stay open (each would refuse the others' keys)."""
    if isinstance(node, list):
        return [_closed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas
            out[key] = {name: _closed(schema) for name, schema in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_closed(branch, close=False) for branch in value]
        else:
            out[key] = _closed(value)
    if close and isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema(schema: Any, param: str) -> str:
    """``%json`` of ``schema`` with the writing options (a copy: the request's stays)."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"The JSON schema in '{param}' must be an object.", param=param)
    body = _closed(schema)
    options = body.get("x-guidance")
    body["x-guidance"] = {**JSON_OPTIONS, **(options if isinstance(options, dict) else {})}
    try:
        return "%json " + json.dumps(body, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise InvalidRequest(
            f"Invalid JSON schema in '{param}': a number is not finite", param=param
        ) from None


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _around(before: str, body: str, after: str) -> str:
    """``body`` between the literals ``before`` and ``after`` (each left out if empty)."""
    return " ".join(p for p in (before and _literal(before), body, after and _literal(after)) if p)


def check(grammar: str, param: str, what: str) -> str:
    """``grammar`` if llguidance compiles it; a 400 naming ``param`` if not."""
    import llguidance

    # A deep stack: llguidance recurses through nested rules and $ref chains.
    failed, messages = run_deep(
        lambda: llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    )
    if failed:
        reason = " ".join(m.strip().splitlines()[0] for m in messages[:1]) or "unknown error"
        reason = reason.split("failed to compile JSON schema: ", 1)[-1]
        raise InvalidRequest(f"Invalid {what} in '{param}': {reason}", param=param)
    return grammar


def json_schema_grammar(schema: dict[str, Any], *, param: str = "response_format") -> str:
    """A grammar whose sentences are the JSON documents valid for ``schema``."""
    return check(f"start: {_schema(schema, param)}\n", param, "JSON schema")


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(tools: list[ToolSpec], framing: CallFraming, *, max_calls: int) -> str:
    """Output that is one to ``max_calls`` calls of the given tools, arguments per schema:
    ``prefix call (sep call)* suffix``, each call ``call_open {"<name_key>": "<name>",
    "<args_key>": {...}} call_close``."""
    if not tools:
        raise InvalidRequest("No tools to call.", param="tools")
    rules = []
    names = []
    for i, tool in enumerate(tools):
        args = _schema(tool.parameters or {"type": "object"}, tool.param)
        check(f"start: {args}\n", tool.param, "JSON schema")  # the field, not just 'tools'
        head = f'{{"{framing.name_key}": {json.dumps(tool.name)}, "{framing.args_key}": '
        rules.append(f"tool_{i}: {_literal(head)} args_{i} {_literal('}')}")
        rules.append(f"args_{i}: {args}")
        names.append(f"tool_{i}")
    call = _around(framing.call_open, f"({' | '.join(names)})", framing.call_close)
    more = f" ({_literal(framing.sep)} call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
    start = _around(framing.prefix, f"call{more}", framing.suffix)
    grammar = "\n".join([f"start: {start}", f"call: {call}", *rules]) + "\n"
    return check(grammar, "tools", "tool grammar")


def after_reasoning(grammar: str, end: str, also: tuple[str, ...] = ()) -> str:
    """``grammar`` after the reasoning block the prompt opened: any text up to and
    including ``end`` (the model must close its reasoning), at most two line breaks
    (as templates write after it: unbounded whitespace is where a small model stays
    forever), then the grammar's own sentences. The reasoning holds none of ``also``
    (markup a reader takes for the reasoning's end: the answer's opening)."""
    assert grammar.startswith("start:")
    body = "answer:" + grammar[len("start:") :]
    head = (
        "start: thinking WS answer\n"
        "WS: /(\\r?\\n){0,2}/\n"
        f"thinking[stop={json.dumps(end)}]: {lazy_text(also)}\n"
    )
    return check(head + body, "tools", "grammar")


def lazy_text(without: tuple[str, ...] = ()) -> str:
    """The regex of text up to a stop string (``name[stop="..."]: <this>``) that holds
    none of ``without``."""
    without = tuple(w for w in without if w)
    if not without:
        return "/(.|\\n)*/"
    held = "|".join(regex_text(w) for w in without)
    return f"/(.|\\n)*/ & ~/(.|\\n)*({held})(.|\\n)*/"
