"""GBNF grammars for constrained decoding: JSON schemas and tool-call shapes.

The JSON-schema translation is llama.cpp's own converter, as shipped in
llama-cpp-python (``llama_cpp.llama_grammar.SchemaConverter``, pure Python);
this module composes its rules into the shapes sluice needs.

Example::

    g = tool_call_grammar([ToolSpec("get_weather", schema)], HERMES_FRAMING, max_calls=1)
    params = SamplingParams(grammar=g)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sluice.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]
    param: str = "tools"  # the request field named by a schema error


@dataclass(frozen=True, slots=True)
class CallFraming:
    """How a family writes tool calls around the JSON call objects.

    The whole output is ``prefix call (sep call)* suffix`` and each call is
    ``call_open {"<name_key>": "...", "<args_key>": {...}} call_close``.
    """

    prefix: str = ""
    call_open: str = ""
    call_close: str = ""
    sep: str = "\n"
    suffix: str = ""
    name_key: str = "name"
    args_key: str = "arguments"


_MAX_DIGITS = 15  # integers without an upper bound: at most this many digits


def _digit_patterns(lo: str, hi: str) -> list[str]:
    """GBNF sequences matching exactly the same-length decimal strings in [lo, hi]."""
    if lo == hi:
        return [" ".join(f'"{c}"' for c in lo)]
    i = next(k for k in range(len(lo)) if lo[k] != hi[k])
    prefix = [f'"{c}"' for c in lo[:i]]
    rest = len(lo) - i - 1
    if set(lo[i + 1 :]) <= {"0"} and set(hi[i + 1 :]) <= {"9"}:
        return [" ".join([*prefix, f"[{lo[i]}-{hi[i]}]", *["[0-9]"] * rest])]
    out: list[str] = []
    start, end = int(lo[i]), int(hi[i])
    if not set(lo[i + 1 :]) <= {"0"}:
        out += [" ".join([*prefix, p]) for p in _digit_patterns(lo[i:], lo[i] + "9" * rest)]
        start += 1
    tail: list[str] = []
    if not set(hi[i + 1 :]) <= {"9"}:
        tail = [" ".join([*prefix, p]) for p in _digit_patterns(hi[i] + "0" * rest, hi[i:])]
        end -= 1
    if start <= end:
        out.append(" ".join([*prefix, f"[{start}-{end}]", *["[0-9]"] * rest]))
    return out + tail


def _natural_range(lo: int, hi: int | None) -> list[str]:
    """Patterns for the non-negative integers in [lo, hi] (hi None: no bound)."""
    top = hi if hi is not None else 10**_MAX_DIGITS - 1
    out: list[str] = []
    for n_digits in range(len(str(lo)), len(str(top)) + 1):
        a = max(lo, 10 ** (n_digits - 1) if n_digits > 1 else 0)
        b = min(top, 10**n_digits - 1)
        if a <= b:
            out += _digit_patterns(str(a), str(b))
    return out


def integer_range_rule(lo: int | None, hi: int | None) -> str | None:
    """A GBNF alternative for integers within the bounds; None when unbounded below."""
    if lo is None:
        if hi is None or hi < 0:
            return None
        lo = -(10**_MAX_DIGITS - 1)
    if hi is not None and hi < lo:
        raise InvalidRequest(f"Empty integer range: minimum {lo} > maximum {hi}.")
    alts: list[str] = []
    if lo < 0:
        neg_hi = -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        alts += [f'"-" {p}' for p in _natural_range(neg_lo, neg_hi)]
    if hi is None or hi >= 0:
        alts += _natural_range(max(lo, 0), hi)
    return " | ".join(f"({a})" for a in alts)


def _converter() -> Any:
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):  # type: ignore[misc]
        """llama.cpp's converter, plus integer bounds (which this port leaves out)."""

        def visit(self, schema: Any, name: str) -> Any:
            if isinstance(schema, dict) and schema.get("type") == "integer":
                lo, hi = schema.get("minimum"), schema.get("maximum")
                if isinstance(schema.get("exclusiveMinimum"), (int, float)):
                    lo = int(schema["exclusiveMinimum"]) + 1
                if isinstance(schema.get("exclusiveMaximum"), (int, float)):
                    hi = int(schema["exclusiveMaximum"]) - 1
                lo = None if lo is None else int(-(-lo // 1))  # ceil
                hi = None if hi is None else int(hi // 1)
                rule = integer_range_rule(lo, hi)
                if rule is not None:
                    rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
                    return self._add_rule(rule_name, f"({rule}) space")
            return super().visit(schema, name)

        def format_grammar(self) -> str:
            # This port lets raw control characters into strings, which is not JSON
            # (json.loads rejects them); llama.cpp's current converter excludes them.
            if "char" in self._rules:
                self._rules["char"] = (
                    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
                )
            return str(super().format_grammar())

    return Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


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
    except (AssertionError, KeyError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidRequest(f"Invalid JSON schema in '{param}': {exc}", param=param) from exc


def json_schema_grammar(schema: dict[str, Any], *, param: str = "response_format") -> str:
    """A grammar whose sentences are exactly the JSON documents valid for ``schema``."""
    conv = _converter()
    rule = _visit(conv, schema, "schema", param)
    conv._add_rule("root", rule)
    return str(conv.format_grammar())


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(tools: list[ToolSpec], framing: CallFraming, *, max_calls: int) -> str:
    """Output that is one to ``max_calls`` calls of the given tools, arguments per schema."""
    if not tools:
        raise InvalidRequest("No tools to call.", param="tools")
    conv = _converter()
    lit = conv._format_literal
    calls = []
    for i, tool in enumerate(tools):
        args = _visit(conv, tool.parameters or {"type": "object"}, f"tool-{i}-args", tool.param)
        body = " ".join(
            [
                lit("{"),
                "space",
                lit(json.dumps(framing.name_key)),
                "space",
                lit(":"),
                "space",
                lit(json.dumps(tool.name)),
                "space",
                lit(","),
                "space",
                lit(json.dumps(framing.args_key)),
                "space",
                lit(":"),
                "space",
                args,
                lit("}"),
            ]
        )
        parts = [
            p
            for p in (
                lit(framing.call_open) if framing.call_open else "",
                body,
                lit(framing.call_close) if framing.call_close else "",
            )
            if p
        ]
        calls.append(conv._add_rule(f"tool-{i}-call", " ".join(parts)))
    call = conv._add_rule("call", " | ".join(calls))
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
    conv._add_rule("root", root)
    return str(conv.format_grammar())
