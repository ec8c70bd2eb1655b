"""Tools and schemas are user input: bounded grammars, and a 400 naming the field, never a 500.

A request of a few hundred bytes used to take the process to 20+ GB: the
schema converter wrote out every one of a ``maxLength`` of 10**9 copies. Those
cases run in a child process under a memory limit and a timeout, so a
regression fails here instead of taking the machine down.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from sluice.core.errors import InvalidRequest
from sluice.grammar import (
    DEFAULT_MAX_REPEAT,
    CallFraming,
    ToolSpec,
    json_schema_grammar,
    tool_call_grammar,
)
from sluice.local.plan import ToolLimits
from tests.support import plans
from tests.support.gbnf_regex import explicit_repeats, grammar_regex

BIG = 10**9
OUT = 10**6  # a max_output_chars: anything above it can never be written


# -- 10**9 repetitions: small grammar or 400, quickly -----------------------------------

HOSTILE: dict[str, tuple[dict[str, Any], bool]] = {
    # name: (schema of one field, whether only a maximum is huge)
    "maxLength": ({"type": "string", "maxLength": BIG}, True),
    "minLength": ({"type": "string", "minLength": BIG}, False),
    "maxItems": (
        {
            "type": "array",
            "items": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "maxItems": BIG,
        },
        True,
    ),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": BIG}, False),
    "pattern-max": ({"type": "string", "pattern": f"^a{{0,{BIG}}}$"}, True),
    "pattern-exact": ({"type": "string", "pattern": f"^(ab|c){{{BIG}}}$"}, False),
    "pattern-min": ({"type": "string", "pattern": f"^[a-z]{{{BIG},}}$"}, False),
    "minLength-and-maxLength": ({"type": "string", "minLength": BIG, "maxLength": BIG}, False),
}
WHERE = {
    "required-tool": "tools[1].function.parameters",
    "auto-tool": "tools[1].function.parameters",
    "response_format": "response_format.json_schema.schema",
}


def _request(where: str, schema: dict[str, Any]) -> dict[str, Any]:
    if where == "response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return {"response_format": fmt}
    tools = [plans.tool("first", {"type": "object"}), plans.tool("second", schema)]
    return {"tools": tools, "tool_choice": "required" if where == "required-tool" else "auto"}


_CHILD = r"""
import json, resource, sys, time
limit = 1024 * 2**20
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
from sluice.core.errors import InvalidRequest
from sluice.dialects.openai.schema import ChatCompletionRequest
from sluice.local.plan import OutputPlan, ToolLimits
for case in json.loads(sys.stdin.read()):
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], **case["request"]
    ).to_request()
    limits = ToolLimits(max_output_chars=case["max_output_chars"])
    t = time.perf_counter()
    out = {"id": case["id"]}
    try:
        plan = OutputPlan.build(body, fmt="hermes", reasoning=None, limits=limits)
        out["grammar"] = plan.grammar
    except InvalidRequest as exc:
        out["param"], out["message"] = exc.param, exc.message
    except MemoryError:
        out["error"] = "MemoryError"
    out["seconds"] = time.perf_counter() - t
    print(json.dumps(out), flush=True)
"""

CASES = [
    (f"{name}-{where}-{'out' if out else 'noout'}", name, where, out)
    for name in HOSTILE
    for where in WHERE
    for out in (True, False)
]


@pytest.fixture(scope="module")
def hostile_results() -> dict[str, dict[str, Any]]:
    cases = [
        {
            "id": case_id,
            "request": _request(where, plans.field(HOSTILE[name][0])),
            "max_output_chars": OUT if out else None,
        }
        for case_id, name, where, out in CASES
    ]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    return {r["id"]: r for r in results}


@pytest.mark.parametrize(("case_id", "name", "where", "out"), CASES, ids=[c[0] for c in CASES])
def test_huge_repetitions_are_small_grammars_or_400s(
    hostile_results: dict[str, dict[str, Any]], case_id: str, name: str, where: str, out: bool
) -> None:
    result = hostile_results[case_id]
    assert "error" not in result, result
    assert result["seconds"] < 1.0, result["seconds"]
    max_only = HOSTILE[name][1]
    if out and max_only:
        # A maximum beyond any possible output is no bound at all: compiled unbounded.
        grammar = result.get("grammar")
        assert grammar is not None, result.get("message")
        assert len(grammar) < 8000
        assert all(n is not None and n <= 64 for _, n in explicit_repeats(grammar))
    else:
        assert result.get("param") == WHERE[where], result
        message = result["message"]
        assert f"the limit is {DEFAULT_MAX_REPEAT} (--max-grammar-repeat)" in message
        assert WHERE[where] in message


def test_unreachable_maximum_is_the_same_language_unbounded() -> None:
    schema = plans.field({"type": "string", "maxLength": BIG})
    rx = grammar_regex(json_schema_grammar(schema, max_output_chars=OUT))
    assert rx.fullmatch(json.dumps({"x": "a" * 5000}))
    assert rx.fullmatch(json.dumps({"x": ""}))
    # At the output bound itself the maximum is kept (it can be reached).
    g = json_schema_grammar(plans.field({"type": "string", "maxLength": 40}), max_output_chars=40)
    rx = grammar_regex(g)
    assert rx.fullmatch(json.dumps({"x": "a" * 40})) and not rx.fullmatch(
        json.dumps({"x": "a" * 41})
    )


# -- the budget --------------------------------------------------------------------------


def test_budget_is_the_sum_of_expanded_repetitions() -> None:
    def g(schema: dict[str, Any], budget: int) -> None:
        json_schema_grammar(schema, max_repeat=budget)

    g(plans.field({"type": "string", "maxLength": 100}), 100)
    with pytest.raises(InvalidRequest) as info:
        g(plans.field({"type": "string", "maxLength": 101}), 100)
    assert info.value.param == "response_format"
    assert "maxLength 101" in info.value.message and "the limit is 100" in info.value.message
    # minLength and maxLength: min copies plus the optional ones.
    g(plans.field({"type": "string", "minLength": 30, "maxLength": 100}), 100)

    def pair(lo: int, hi: int) -> dict[str, Any]:
        a, b = {"type": "string", "minLength": lo}, {"type": "string", "maxLength": hi}
        return {"type": "object", "properties": {"a": a, "b": b}}

    g(pair(50, 50), 100)  # 50 required characters, 50 optional ones
    with pytest.raises(InvalidRequest):
        g(pair(51, 50), 100)
    # Two arrays of different items: two chains, the sum counts.
    two = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 50},
            "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 51},
        },
    }
    g(two, 100)  # 49 + 50 after the first item of each
    with pytest.raises(InvalidRequest):
        g(two, 98)
    # Strings share one chain of characters: the longest counts, not the sum.
    many = {
        "type": "object",
        "properties": {f"s{i}": {"type": "string", "maxLength": 90 + i} for i in range(10)},
    }
    g(many, 100)


def test_budget_is_per_grammar_across_tools() -> None:
    def tool(i: int) -> ToolSpec:
        items = {"type": "array", "items": {"type": "integer", "minimum": i}, "maxItems": 41}
        return ToolSpec(f"t{i}", plans.field(items), param=f"tools[{i}].function.parameters")

    framing = CallFraming(call_open="<tool_call>\n", call_close="\n</tool_call>")
    tool_call_grammar([tool(0), tool(1)], framing, max_calls=2, max_repeat=80)
    with pytest.raises(InvalidRequest) as info:
        tool_call_grammar([tool(0), tool(1), tool(2)], framing, max_calls=2, max_repeat=80)
    assert info.value.param == "tools[2].function.parameters"


def test_limits_from_tool_limits() -> None:
    schema = plans.field({"type": "string", "maxLength": 300})
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert plans.plan(ToolLimits(max_grammar_repeat=300), response_format=fmt).grammar
    with pytest.raises(InvalidRequest) as info:
        plans.plan(ToolLimits(max_grammar_repeat=299), response_format=fmt)
    assert info.value.param == "response_format.json_schema.schema"
    # Output can never be longer than 200 characters: the 300 costs nothing.
    limits = ToolLimits(max_grammar_repeat=10, max_output_chars=200)
    assert plans.plan(limits, response_format=fmt).grammar


# -- exactly the bounded strings, arrays and patterns ------------------------------------


@pytest.mark.parametrize(
    ("lo", "hi"), [(0, 0), (0, 1), (0, 3), (1, 1), (2, 2), (2, 5), (3, None), (0, None)]
)
def test_string_lengths_are_exact(lo: int, hi: int | None) -> None:
    schema: dict[str, Any] = {"type": "string", "minLength": lo}
    if hi is not None:
        schema["maxLength"] = hi
    rx = grammar_regex(json_schema_grammar(plans.field(schema)))
    for n in range(9):
        for text in ("a" * n, '"' * n, "\n\\" * (n // 2) + "é" * (n % 2)):
            ok = lo <= n and (hi is None or n <= hi)
            assert bool(rx.fullmatch(json.dumps({"x": text}))) == ok, (lo, hi, text)


@pytest.mark.parametrize(
    ("lo", "hi"), [(0, 0), (0, 1), (0, 3), (1, 1), (1, 3), (2, 2), (2, 4), (3, None), (0, None)]
)
def test_array_lengths_are_exact(lo: int, hi: int | None) -> None:
    schema: dict[str, Any] = {"type": "array", "items": {"type": "integer"}, "minItems": lo}
    if hi is not None:
        schema["maxItems"] = hi
    rx = grammar_regex(json_schema_grammar(plans.field(schema)))
    for n in range(8):
        ok = lo <= n and (hi is None or n <= hi)
        assert bool(rx.fullmatch(json.dumps({"x": list(range(n))}))) == ok, (lo, hi, n)


PATTERNS = [
    r"^\d{3}-\d{4}$",
    r"^[a-c\"]{2,3}$",
    r"^(ab|c)*x?$",
    r"^.{2}$",
    r"^[^a]+$",
    r"^a\.b$",
    r"^\w+@\w+$",
    r"^(?:x|y){1,3}$",
    r"^[\d\s]{0,2}$",
    r"^\\\"?$",
    r"^(a|b|)c$",
    r"^[a-]{2}$",
    r"^\D\W\S$",
    r"^x{0}y{1}z{0,1}$",
    r"^(?:ab){2,}$",
    r"^a+?b*?$",
    r"^\x41\u0042[\x61-\x63]$",
    r"^[^\n\\]$",
    r"^$",
]
ALPHABET = ["a", "b", "c", "x", "y", "1", "-", ".", "@", " ", '"', "\\", "\n", "\t", "é", "_"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_match_what_the_regex_matches(pattern: str) -> None:
    rx = grammar_regex(json_schema_grammar(plans.field({"type": "string", "pattern": pattern})))
    py = re.compile(pattern[1:-1], re.ASCII)
    rng = random.Random(pattern)
    samples = {"", "ab", "abab", "123-4567", "AB", "ABa", "a.b", "ab@c", '\\"', "\\", "c", "ac"}
    for _ in range(400):
        samples.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 5))))
    # Plus strings the pattern itself matches, so both sides are exercised.
    positives = {s for s in samples if py.fullmatch(s)}
    assert positives or pattern == "^$"
    for s in samples:
        assert bool(rx.fullmatch(json.dumps({"x": s}, ensure_ascii=False))) == bool(
            py.fullmatch(s)
        ), (pattern, s)


@pytest.mark.parametrize(
    "pattern",
    [
        "abc",  # not anchored
        "^abc",
        "^a\\$",  # the final $ is escaped
        "^(?=a)a$",
        "^a**$",
        "^a{2}{3}$",
        "^\\1$",
        "^\\bx$",
        "^a{2,1}$",
        "^[b-a]$",
        "^(a$",
        "^a)$",
        "^[a$",
        "^{3}$",
        "^a{x}$",
        "^(a?)*$",  # a loop of what can match nothing
        "^(a|){2,5}$",
        "^a^b$",
        "^[\\D]$",
        "^\\x4$",
        "^a{" + "9" * 5000 + "}$",
    ],
)
def test_unsupported_patterns_are_400s_naming_the_field(pattern: str) -> None:
    t = time.perf_counter()
    with pytest.raises(InvalidRequest) as info:
        plans.plan(
            tools=[plans.tool("f", plans.field({"type": "string", "pattern": pattern}))],
            tool_choice="required",
        )
    assert info.value.param == "tools[0].function.parameters"
    assert time.perf_counter() - t < 1.0


# -- no schema text outside literals and classes ----------------------------------------


def test_names_and_values_cannot_write_grammar() -> None:
    evil = ['a\\" | [x]{0,1000000000} | "', "\\", '"', "\n", "}{0,99999}", "\\\\\\"]
    props = {name: {"type": "string", "enum": [name, "\\" + name]} for name in evil}
    schema = {"type": "object", "properties": props, "required": evil}
    g = json_schema_grammar(schema)
    assert all(n is not None and n <= 64 for _, n in explicit_repeats(g))
    rx = grammar_regex(g)
    assert rx.fullmatch(json.dumps({name: name for name in evil}))
    assert rx.fullmatch(json.dumps({name: "\\" + name for name in evil}))
    assert not rx.fullmatch(json.dumps({name: name + "x" for name in evil}))


def test_recursive_ref_names_are_rule_names() -> None:
    name = "space{0,1000000000}"
    schema = {
        "$defs": {name: {"type": "array", "items": {"$ref": f"#/$defs/{name}"}, "maxItems": 2}},
        "$ref": f"#/$defs/{name}",
    }
    g = json_schema_grammar(schema)
    assert all(n is not None and n <= 64 for _, n in explicit_repeats(g))
    # The name survives only as a rule name (no braces): the text is all GBNF tokens.
    assert "{0,1000000000}" not in g
    with pytest.raises(InvalidRequest):
        json_schema_grammar({"$ref": "#/$defs/missing"})
    with pytest.raises(InvalidRequest):
        json_schema_grammar({"$ref": "https://example.com/schema.json"})


# -- malformed schemas and tool_choice ------------------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": [1]},
        {"type": "object", "properties": "x"},
        {"type": "object", "properties": {"a": 5}},
        {"type": "object", "properties": {"a": {}}, "required": "a"},
        {"type": "array", "items": 5},
        {"type": "string", "enum": 3},
        {"type": "string", "enum": []},
        {"$ref": 5, "type": "nonsense"},
        {"anyOf": {}},
        {"anyOf": [5]},
        {"allOf": [{"$ref": "#/nowhere"}]},
        {"allOf": [{"properties": 5}]},
        {"type": "integer", "minimum": "x"},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "integer", "maximum": float("nan")},
        {"type": "string", "maxLength": -1},
        {"type": "string", "maxLength": 1.5},
        {"type": "string", "maxLength": True},
        {"type": "string", "minLength": 3, "maxLength": 2},
        {"type": "array", "items": {}, "minItems": 3, "maxItems": 2},
        {"type": "string", "pattern": 5},
        {"type": 5},
        {"type": []},
        {"type": "nonsense"},
    ],
)
def test_bad_schemas_are_400s_naming_the_field(schema: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        plans.plan(
            tools=[plans.tool("f"), plans.tool("g", plans.field(schema))], tool_choice="required"
        )
    assert info.value.param == "tools[1].function.parameters"
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": plans.field(schema)}}
    with pytest.raises(InvalidRequest) as info:
        plans.plan(response_format=fmt)
    assert info.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"type": "function", "function": "f"}, "tool_choice.function"),
        ({"type": "function", "function": None}, "tool_choice.function"),
        ({"type": "function", "function": ["f"]}, "tool_choice.function"),
        ({"type": "function"}, "tool_choice.function"),
        ({"type": "function", "function": {"name": 5}}, "tool_choice.function.name"),
        ({"type": "function", "function": {}}, "tool_choice.function.name"),
        ({"type": "custom", "function": {"name": "f"}}, "tool_choice.type"),
        ({"type": None, "function": {"name": "f"}}, "tool_choice.type"),
        ({"type": "function", "function": {"name": "g"}}, "tool_choice"),
        ("sometimes", "tool_choice"),
    ],
)
def test_tool_choice_shapes_are_400s(choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        plans.plan(tools=[plans.tool("f")], tool_choice=choice)
    assert info.value.param == param


def test_named_tool_choice_without_tools_is_a_400() -> None:
    with pytest.raises(InvalidRequest) as info:
        plans.plan(tool_choice={"type": "function", "function": {"name": "f"}})
    assert info.value.param == "tool_choice"
    # The shape OpenAI documents, and the one without "type", still work.
    plan = plans.plan(
        tools=[plans.tool("f")], tool_choice={"type": "function", "function": {"name": "f"}}
    )
    assert plan.tool_choice == "function:f" and plan.grammar
    assert plans.plan(tools=[plans.tool("f")], tool_choice={"function": {"name": "f"}}).grammar


# -- request limits ------------------------------------------------------------------------


def test_too_many_tools() -> None:
    tools = [plans.tool(f"t{i}") for i in range(3)]
    assert plans.plan(ToolLimits(max_tools=3), tools=tools).tools
    with pytest.raises(InvalidRequest) as info:
        plans.plan(ToolLimits(max_tools=2), tools=tools)
    assert info.value.param == "tools"
    assert "3 tools" in info.value.message and "the limit is 2 (--max-tools)" in info.value.message


def test_schema_bytes_name_the_field_that_passes_the_limit() -> None:
    big = plans.field({"type": "string", "description": "d" * 1000})
    size = len(json.dumps(big))
    tools = [plans.tool("a", big), plans.tool("b", big)]
    assert plans.plan(ToolLimits(max_schema_bytes=2 * size), tools=tools).tools
    with pytest.raises(InvalidRequest) as info:
        plans.plan(ToolLimits(max_schema_bytes=2 * size - 1), tools=tools)
    assert info.value.param == "tools[1].function.parameters"
    assert f"the limit is {2 * size - 1} (--max-schema-bytes)" in info.value.message
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}
    with pytest.raises(InvalidRequest) as info:
        plans.plan(ToolLimits(max_schema_bytes=2 * size), tools=tools, response_format=fmt)
    assert info.value.param == "response_format.json_schema.schema"
    # Checked before any grammar is built (tool_choice none builds none).
    with pytest.raises(InvalidRequest):
        plans.plan(ToolLimits(max_schema_bytes=10), tools=tools, tool_choice="none")


# -- objects with many optional properties ------------------------------------------------


def test_optional_properties_are_exact_and_linear() -> None:
    schema = {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in "abcd"},
        "required": ["b"],
        "additionalProperties": {"type": "boolean"},
    }
    rx = grammar_regex(json_schema_grammar(schema))
    # Required properties first, then the optional ones in order, then any others.
    assert rx.fullmatch('{"b": 1}')
    assert rx.fullmatch('{"b": 2, "a": 1, "d": 3}')
    assert rx.fullmatch('{"b": 2, "a": 1, "c": 1, "d": 3, "x": true}')
    assert rx.fullmatch('{"b": 2, "c": 1, "x": true, "y": false}')
    assert rx.fullmatch('{"b": 2, "x": true}')
    assert not rx.fullmatch('{"b": 2 "x": true}')  # the port dropped this comma
    assert not rx.fullmatch('{"a": 1}') and not rx.fullmatch('{"b": 2, "d": 1, "a": 1}')
    assert not rx.fullmatch('{"b": 2, "x": 1}')
    # Thousands of optional properties: linear time (the port is quadratic, then recurses
    # past Python's limit).
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}
    t = time.perf_counter()
    json_schema_grammar(many)
    assert time.perf_counter() - t < 2.0
