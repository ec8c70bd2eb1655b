"""Whole grammars: a JSON schema's or tool calls', checked for size and width."""

from __future__ import annotations

import json
import re
from typing import Any

from sluice.core.errors import InvalidRequest
from sluice.grammar.converter import _converter
from sluice.grammar.spec import (
    ALTERNATIVES_SETTING,
    DEFAULT_MAX_REPEAT,
    CallFraming,
    ToolSpec,
    _clip,
    _OverBudget,
    _SchemaProblem,
)
from sluice.grammar.width import _WidthAnalysis


def _visit(conv: Any, schema: Any, name: str, param: str) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"The JSON schema in '{param}' must be an object.", param=param)
    try:
        resolved = conv.resolve_refs(json.loads(json.dumps(schema)), name)
        return str(conv.visit(resolved, name))
    except InvalidRequest as exc:
        if exc.param is not None:
            raise
        # e.g. an empty integer range: name the field the schema came from.
        message = f"Invalid JSON schema in '{param}': {exc.message}"
        raise InvalidRequest(message, param=param) from exc
    except _OverBudget as exc:
        message = f"The JSON schema in '{param}' is too large to constrain decoding: {exc}."
        raise InvalidRequest(message, param=param) from exc
    except _SchemaProblem as exc:
        raise InvalidRequest(f"Invalid JSON schema in '{param}': {exc}.", param=param) from exc
    except MemoryError:
        raise
    except Exception as exc:  # the port's own failures on odd input: schema input is user input
        reason = _clip(f"{type(exc).__name__}: {exc}", 200)
        raise InvalidRequest(f"Invalid JSON schema in '{param}': {reason}", param=param) from exc


_EXPLICIT_REPEAT = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{([0-9]+)(?:,([0-9]*))?\}')
_MAX_EXPLICIT_REPEAT = 64  # llama.cpp expands x{m,n} into n rules; ours are all tiny


def _set_root(conv: Any, rule: str) -> None:
    if conv._add_rule("root", rule) != "root":  # no schema names a rule "root"
        raise AssertionError("the grammar's root rule was taken")


def _finish(conv: Any, param: str) -> str:
    """The grammar text, checked to hold no ``{m,n}`` that llama.cpp would expand widely."""
    text = str(conv.format_grammar())
    for m in _EXPLICIT_REPEAT.finditer(text):
        if m[1] is not None and max(int(m[1]), int(m[2] or 0)) > _MAX_EXPLICIT_REPEAT:
            raise InvalidRequest(f"The constraint grammar for '{param}' is too large.", param=param)
    return text


def _check_widths(conv: Any, checks: list[tuple[str, str, str | None]]) -> None:
    """A 400 naming the field when a rule may hold more parse stacks than allowed.

    ``checks``: (rule, request field, the schema path its rules were named under).
    """
    limit = conv.max_alternatives
    if limit is None:
        return
    named = set(conv.paths) | {rule for rule, _, _ in checks}
    try:
        analysis = _WidthAnalysis(conv._rules, limit, named=named, values=conv.values)
    except (RecursionError, AssertionError) as exc:  # nested past Python's stack: unchecked
        param = checks[-1][1]
        message = f"The constraint grammar for '{param}' is too deeply nested to check its width."
        raise InvalidRequest(message, param=param) from exc
    widest = analysis.widest
    if widest is None:
        return
    # The field: the first check whose rule reaches it (the last one reaches everything).
    param, top = checks[-1][1], checks[-1][2]
    for rule, field, rule_top in checks:
        if analysis.reaches(rule, widest):
            param, top = field, rule_top
            break
    path = conv.paths.get(widest)
    where = ""
    if path is not None and top is not None and path != top:
        where = f" at '{_clip(path[len(top) + 1 :] if path.startswith(f'{top}-') else path)}'"
    what = (
        "The tools of this request are" if param == "tools" else f"The JSON schema in '{param}' is"
    )
    raise InvalidRequest(
        f"{what} too wide to constrain decoding{where}: more than {limit} grammar "
        "alternatives (enum values, anyOf/oneOf branches, optional properties, pattern "
        "alternatives, tools) may be open at one point of the output, and each costs every "
        f"token a pass over the vocabulary; the limit is {limit} ({ALTERNATIVES_SETTING})",
        param=param,
    )


def json_schema_grammar(
    schema: dict[str, Any],
    *,
    param: str = "response_format",
    max_repeat: int = DEFAULT_MAX_REPEAT,
    max_output_chars: int | None = None,
    max_alternatives: int | None = None,
) -> str:
    """A grammar whose sentences are exactly the JSON documents valid for ``schema``.

    ``max_repeat`` bounds the repetition rules the grammar may hold;
    ``max_output_chars`` (when known) is the longest output the request can
    produce, beyond which a maximum is not worth spelling out;
    ``max_alternatives`` (None: unchecked) bounds the parse stacks the grammar
    may hold at one point (its width, what sampling a token costs).
    """
    conv = _converter(max_repeat, max_output_chars, max_alternatives)
    _set_root(conv, _visit(conv, schema, "schema", param))
    text = _finish(conv, param)
    _check_widths(conv, [("root", param, "schema")])
    return text


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(
    tools: list[ToolSpec],
    framing: CallFraming,
    *,
    max_calls: int,
    max_repeat: int = DEFAULT_MAX_REPEAT,
    max_output_chars: int | None = None,
    max_alternatives: int | None = None,
) -> str:
    """Output that is one to ``max_calls`` calls of the given tools, arguments per schema.

    The tools share one repetition budget (``max_repeat``): it bounds the grammar.
    ``max_alternatives`` bounds the width of each tool's arguments (a 400 naming
    its field) and of the whole grammar (naming ``tools``).
    """
    if not tools:
        raise InvalidRequest("No tools to call.", param="tools")
    conv = _converter(max_repeat, max_output_chars, max_alternatives)
    lit = conv._format_literal
    # Every call starts alike up to the tool's name, so the calls share that start
    # and branch on the name (a trie): the tools are not each a parse stack.
    names: list[tuple[str, str]] = []
    checks: list[tuple[str, str, str | None]] = []  # widths to check: see _check_widths
    for i, tool in enumerate(tools):
        args = _visit(conv, tool.parameters or {"type": "object"}, f"tool-{i}-args", tool.param)
        parts = ["space", lit(","), "space", lit(json.dumps(framing.args_key)), "space"]
        parts += [lit(":"), "space", args, lit("}")]
        if framing.call_close:
            parts.append(lit(framing.call_close))
        rest = conv._add_rule(f"tool-{i}-call", " ".join(parts))
        checks.append((rest, tool.param, f"tool-{i}-args"))
        names.append((json.dumps(tool.name), rest))
    head = [lit(framing.call_open)] if framing.call_open else []
    head += [lit("{"), "space", lit(json.dumps(framing.name_key)), "space", lit(":"), "space"]
    trie = conv._literal_trie("call-name", names, split_start=False)
    call = conv._add_rule("call", f"{' '.join(head)} ( {trie} )")
    more = f"({lit(framing.sep)} {call}){{0,{max_calls - 1}}}" if max_calls > 1 else ""
    root = " ".join(
        p
        for p in (
            lit(framing.prefix) if framing.prefix else "",
            call,
            more,
            lit(framing.suffix) if framing.suffix else "",
        )
        if p
    )
    _set_root(conv, root)
    text = _finish(conv, "tools")
    _check_widths(conv, [*checks, ("root", "tools", None)])
    return text
