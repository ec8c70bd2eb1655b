"""Wide grammars are bounded: a 400 naming the field, never a server that crawls.

llama.cpp samples a constrained token by checking the whole vocabulary against
every parse stack the grammar holds open at that point of the output, on the
engine thread every stream waits for. An enum of 5,000 values took about 1 s
per token, 1,000 anyOf objects about 290 ms: one request slowed every stream on
the server. Enum values and tool names are now tries (a stack per distinct next
character), and the width of a grammar (an upper bound on its open stacks) is
limited by ``--max-grammar-alternatives`` (``ToolLimits.max_grammar_alternatives``).

The last tests run the widest accepted grammars in the real llama.cpp.
"""

from __future__ import annotations

import ctypes
import json
import random
import string
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluice import cli
from sluice.config import Settings
from sluice.core.errors import InvalidRequest
from sluice.engine.llama_runner import LlamaRunner
from sluice.grammar import (
    ALTERNATIVES_SETTING,
    DEFAULT_MAX_ALTERNATIVES,
    CallFraming,
    ToolSpec,
    json_schema_grammar,
    tool_call_grammar,
)
from sluice.local.plan import OutputPlan, ToolLimits
from tests.support import plans
from tests.support.fakes import CHATML, ScriptedRunner
from tests.support.gbnf_regex import grammar_regex
from tests.support.helpers import CHAT, scripted_server
from tests.support.llama import real_runner

LIMIT = DEFAULT_MAX_ALTERNATIVES
RESPONSE = "response_format.json_schema.schema"
HERMES = CallFraming(call_open="<tool_call>\n", call_close="\n</tool_call>", sep="\n")
ALNUM = string.ascii_letters + string.digits  # 62 distinct first characters


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


WHERE = {
    "required-tool": "tools[1].function.parameters",
    "auto-tool": "tools[1].function.parameters",
    "response_format": RESPONSE,
}


def _request(where: str, schema: dict[str, Any]) -> dict[str, Any]:
    if where == "response_format":
        return {"response_format": _response_format(schema)}
    tools = [plans.tool("first", {"type": "object"}), plans.tool("second", schema)]
    return {"tools": tools, "tool_choice": "required" if where == "required-tool" else "auto"}


def _kind(i: int) -> dict[str, Any]:
    """One branch of a discriminated union: two stacks open per branch at its start."""
    return {
        "type": "object",
        "properties": {"kind": {"const": f"k{i}"}, "v": {"type": "integer"}},
        "required": ["kind", "v"],
    }


def _alternatives(n: int) -> str:
    return "^(" + "|".join(ALNUM[:n]) + ")$"


# Each wider than the default limit; "costly" marks the measured ones: the time per
# token in llama.cpp (SmolLM2, one thread) of the schema before the bound.
WIDE: dict[str, dict[str, Any]] = {
    # 5,000 values starting with 70 distinct characters (~1 s per token as a flat list)
    "enum of 5,000 values": plans.field(
        {
            "enum": sorted(
                {
                    "".join(random.Random(i).choices(ALNUM + "!#$%&*+-", k=2 + i % 3))
                    for i in range(6000)
                }
            )[:5000]
        }
    ),
    # One value per first character, each going on differently: 62 stacks at the start.
    "enum of 62 values": plans.field({"enum": [c * (1 + i % 5) for i, c in enumerate(ALNUM)]}),
    # 64 objects: ~100 ms per token, 1,000: ~290 ms
    "anyOf of 40 objects": plans.field({"anyOf": [_kind(i) for i in range(40)]}),
    "oneOf of 40 objects": plans.field({"oneOf": [_kind(i) for i in range(40)]}),
    # 128 optional properties: ~50-70 ms per token
    "40 optional properties": {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(40)},
    },
    "pattern of 40 alternatives": plans.field({"type": "string", "pattern": _alternatives(40)}),
    # (ab)? 64 times: ~50 ms per token from a 400-byte pattern
    "pattern of 40 optional groups": plans.field(
        {"type": "string", "pattern": "^" + "(ab)?" * 40 + "a$"}
    ),
    "ambiguous repetition": plans.field({"type": "string", "pattern": "^(a|aa){0,40}$"}),
    "array of anyOf of 40 enums": plans.field(
        {
            "type": "array",
            "items": {"anyOf": [{"enum": [f"{c}{i}" for i in range(5)]} for c in ALNUM[:40]]},
        }
    ),
    "anyOf of 8 objects of 8 optional properties": plans.field(
        {
            "type": "array",
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {f"q{j}_{i}": {"type": "integer"} for i in range(8)},
                    }
                    for j in range(8)
                ]
            },
        }
    ),
    # Two branches that stay open together at every level: twice the stacks per level.
    "recursion that doubles": {
        "$defs": {
            "t": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"a": {"$ref": "#/$defs/t"}, "b": {"type": "integer"}},
                        "required": ["a", "b"],
                    },
                    {
                        "type": "object",
                        "properties": {"a": {"$ref": "#/$defs/t"}, "c": {"type": "integer"}},
                        "required": ["a", "c"],
                    },
                    {"type": "null"},
                ]
            }
        },
        "$ref": "#/$defs/t",
    },
}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", WIDE)
def test_wide_schemas_are_400s_naming_the_field_and_the_flag(name: str, where: str) -> None:
    t = time.perf_counter()
    with pytest.raises(InvalidRequest) as info:
        plans.plan(**_request(where, WIDE[name]))
    assert time.perf_counter() - t < 2.0
    assert info.value.param == WHERE[where]
    message = info.value.message
    assert WHERE[where] in message and "too wide" in message
    assert f"the limit is {LIMIT} ({ALTERNATIVES_SETTING})" in message


def test_the_message_names_the_property() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "color": WIDE["enum of 62 values"]["properties"]["x"],
        },
    }
    with pytest.raises(InvalidRequest) as info:
        plans.plan(response_format=_response_format(schema))
    assert "at 'color'" in info.value.message


def test_many_tools_are_one_name_trie_until_the_names_fan_out() -> None:
    small = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    tools = [plans.tool(f"tool_{i}", small) for i in range(128)]  # the default --max-tools
    assert plans.plan(tools=tools, tool_choice="required").grammar
    assert plans.plan(tools=tools, tool_choice="auto").grammar
    # Names starting with 40 different characters: 40 stacks where the name begins.
    fanned = [plans.tool(f"{c}_tool", small) for c in ALNUM[:40]]
    for choice in ("required", "auto"):
        with pytest.raises(InvalidRequest) as info:
            plans.plan(tools=fanned, tool_choice=choice)
        assert info.value.param == "tools"
        assert f"the limit is {LIMIT} ({ALTERNATIVES_SETTING})" in info.value.message
    # A named tool_choice offers one of them: no fan-out.
    named = {"type": "function", "function": {"name": "a_tool"}}
    assert plans.plan(tools=fanned, tool_choice=named).grammar


@pytest.mark.parametrize("limit", [4, 32, 100])
def test_the_limit_is_exact_on_a_flat_alternation(limit: int) -> None:
    # n one-character alternatives open n stacks where the string starts, and no more.
    def plan(n: int) -> OutputPlan:
        pattern = "^(" + "|".join(chr(0x100 + i) for i in range(n)) + ")$"
        schema = plans.field({"type": "string", "pattern": pattern})
        return plans.plan(
            ToolLimits(max_grammar_alternatives=limit), response_format=_response_format(schema)
        )

    assert plan(limit).grammar
    with pytest.raises(InvalidRequest) as info:
        plan(limit + 1)
    assert info.value.param == RESPONSE
    assert f"the limit is {limit} ({ALTERNATIVES_SETTING})" in info.value.message


WORDS = sorted(
    {
        "".join(random.Random(i).choice(string.ascii_lowercase) for _ in range(3 + i % 8))
        for i in range(6000)
    }
)
REALISTIC: dict[str, Any] = {
    "enum of 300 words": plans.field({"enum": WORDS[:300]}),
    "enum of 5,000 words": plans.field({"enum": WORDS[:5000]}),
    "enum of 5,000 numbered values": plans.field({"enum": [f"value{i}" for i in range(5000)]}),
    "enum of 1,000 integers": plans.field({"enum": list(range(1000))}),
    "ISO country codes": plans.field(
        {"enum": [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase][:250]}
    ),
    "25 optional properties": {
        "type": "object",
        "properties": {f"param_{i}": {"type": ["string", "null"]} for i in range(25)},
        "required": [],
    },
    "10 required and 25 optional": {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": 40} for i in range(35)},
        "required": [f"p{i}" for i in range(10)],
    },
    "discriminated union of 8 objects": plans.field({"anyOf": [_kind(i) for i in range(8)]}),
    "anyOf of types": plans.field(
        {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}
    ),
    "int32 range": plans.field({"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}),
    "date-time, uuid, email-like pattern": {
        "type": "object",
        "properties": {
            "at": {"type": "string", "format": "date-time"},
            "id": {"type": "string", "format": "uuid"},
            "mail": {"type": "string", "pattern": r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$"},
        },
    },
    "tree": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["name"],
    },
    "expression": {
        "$defs": {
            "e": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "op": {"enum": ["+", "-", "*", "/"]},
                            "l": {"$ref": "#/$defs/e"},
                            "r": {"$ref": "#/$defs/e"},
                        },
                        "required": ["op", "l", "r"],
                    },
                    {
                        "type": "object",
                        "properties": {"num": {"type": "number"}},
                        "required": ["num"],
                    },
                ]
            }
        },
        "$ref": "#/$defs/e",
    },
    "any JSON": {"type": "object", "additionalProperties": True},
}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", REALISTIC)
def test_realistic_schemas_stay_accepted(name: str, where: str) -> None:
    assert plans.plan(**_request(where, REALISTIC[name])).grammar


def test_forty_tools_of_ten_properties_stay_accepted() -> None:
    def params(i: int) -> dict[str, Any]:
        props: dict[str, Any] = {f"arg{j}": {"type": "string"} for j in range(8)}
        props["unit"] = {"enum": ["metric", "imperial", "kelvin"]}
        props["count"] = {"type": "integer", "minimum": 1, "maximum": 100}
        return {"type": "object", "properties": props, "required": ["arg0"]}

    tools = [
        plans.tool(f"{verb}_{noun}", params(i))
        for i, (verb, noun) in enumerate(
            (v, n) for v in ("get", "set", "list", "delete") for n in "abcdefghij"
        )
    ]
    for choice in ("required", "auto"):
        assert plans.plan(tools=tools, tool_choice=choice).grammar


# -- the tries accept exactly what the flat alternatives did -------------------------------


def test_enum_trie_accepts_exactly_the_values() -> None:
    rng = random.Random(7)
    values: list[Any] = [None, True, False, 0, 1, 10, 100, -1, 1.5, "", "a", "ab", "abc", "b"]
    values += ['q"uote', "back\\slash", "tab\there", "é", "😀", "\u2028", [1, 2], {"a": 1}]
    values += ["".join(rng.choice('ab"\\é') for _ in range(rng.randint(0, 4))) for _ in range(40)]
    rx = grammar_regex(json_schema_grammar(plans.field({"enum": values})))
    for v in values:
        assert rx.fullmatch(json.dumps({"x": v})), v
    texts = {json.dumps(v) for v in values}
    near = {t[:-1] for t in texts} | {t + "a" for t in texts} | {t + '"' for t in texts}
    near |= {json.dumps("abd"), json.dumps(2), json.dumps("ba"), "1e0", "null "}
    for text in near - texts:
        assert not rx.fullmatch('{"x": ' + text + "}"), text


def test_enum_trie_merges_characters_that_go_on_alike() -> None:
    g = json_schema_grammar({"enum": list(range(1000))})
    assert len(g) < 200  # "0" | [1-9] ("" | [0-9] ("" | [0-9]))
    rx = grammar_regex(g)
    assert all(rx.fullmatch(str(n)) for n in range(1000))
    assert not any(rx.fullmatch(s) for s in ["00", "01", "1000", "-1", ""])


def test_tool_name_trie_accepts_exactly_the_names() -> None:
    names = ["g", "get", "get_time", "get_weather", "got", "other", "get.x", "get-y"]
    g = tool_call_grammar(
        [ToolSpec(n, {"type": "object", "properties": {}}) for n in names], HERMES, max_calls=1
    )
    rx = grammar_regex(g)

    def call(name: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'

    assert all(rx.fullmatch(call(n)) for n in names)
    assert not any(
        rx.fullmatch(call(n)) for n in ["", "ge", "get_", "gets", "get_wea", "o", "others"]
    )


# -- the setting reaches the server ---------------------------------------------------------


def test_setting_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().max_grammar_alternatives == LIMIT
    assert ToolLimits().max_grammar_alternatives == LIMIT
    env = {"SLUICE_MAX_GRAMMAR_ALTERNATIVES": "7"}
    assert Settings.from_env(env).max_grammar_alternatives == 7
    seen: list[Any] = []
    monkeypatch.setattr(cli, "_serve", lambda args: seen.append(args) or 0)
    assert cli.main(["serve", "--max-grammar-alternatives", "5"]) == 0
    assert seen[0].max_grammar_alternatives == 5


@pytest.fixture(scope="module")
def narrow_server() -> Iterator[str]:
    runner = ScriptedRunner(chat_template=CHATML, n_ctx_seq=4096)
    with scripted_server(runner, max_grammar_alternatives=4) as base:
        yield base


@pytest.mark.parametrize("stream", [False, True])
def test_http_400_uses_the_servers_limit(narrow_server: str, stream: bool) -> None:
    # Five alternatives: within the default limit, past this server's 4.
    schema = plans.field({"type": "string", "pattern": _alternatives(5)})
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": _response_format(schema),
        "stream": stream,
    }
    r = httpx.post(narrow_server + CHAT, json=body, timeout=20)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == RESPONSE
    assert f"the limit is 4 ({ALTERNATIVES_SETTING})" in err["message"]
    assert plans.plan(response_format=_response_format(schema)).grammar  # the default accepts it


# -- the widest accepted grammars, sampled by the real llama.cpp ----------------------------


class Sampling:
    """Times llama.cpp's grammar check of the whole vocabulary after a given prefix."""

    def __init__(self, runner: LlamaRunner) -> None:
        import llama_cpp

        self.L: Any = llama_cpp
        self.runner = runner
        n = runner.n_vocab
        self.cells = (llama_cpp.llama_token_data * n)()
        logits = random.Random(0)
        for i in range(n):
            self.cells[i].id, self.cells[i].logit, self.cells[i].p = i, logits.random(), 0.0

    def seconds(self, grammar: str, prefix: str, reps: int = 5) -> float:
        """The fastest of ``reps`` checks at the point after ``prefix``."""
        L, runner = self.L, self.runner
        # llama.cpp's own grammar sampler (the runner samples with llguidance's now):
        # the widths were calibrated on its pass over the vocabulary.
        gate = L.llama_sampler_init_grammar(runner._vocab, grammar.encode(), b"root")
        assert gate, "llama.cpp refused the grammar"
        try:
            for token in runner.tokenize(prefix, add_special=False, parse_special=False):
                L.llama_sampler_accept(gate, token)
            best = float("inf")
            n = runner.n_vocab
            for _ in range(reps):
                cells = (L.llama_token_data * n)()
                ctypes.memmove(cells, self.cells, ctypes.sizeof(cells))
                arr = L.llama_token_data_array(cells, n, -1, False)
                t = time.perf_counter()
                L.llama_sampler_apply(gate, ctypes.byref(arr))
                best = min(best, time.perf_counter() - t)
            assert any(cells[i].logit != float("-inf") for i in range(n)), prefix
            return best
        finally:
            L.llama_sampler_free(gate)


@pytest.fixture(scope="module")
def sampling() -> Iterator[Sampling]:
    with real_runner() as runner:
        yield Sampling(runner)


# The widest of each kind the default accepts, and the points where they hold the most
# stacks. Measured on 2 shared cores: 10-27 ms per token (no grammar: well under 1 ms;
# any grammar: ~3.5 ms to decode the vocabulary's pieces).
WIDEST: dict[str, tuple[dict[str, Any], list[str]]] = {
    "discriminated union of 10 objects": (
        plans.field({"anyOf": [_kind(i) for i in range(10)]}),
        ['{"x": ', '{"x": {', '{"x": {"kind": "k'],
    ),
    "29 optional properties": (
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(29)}},
        ["{", '{"p0": 1,', '{"p0": 1, "p'],
    ),
    "pattern of 32 alternatives": (
        plans.field({"type": "string", "pattern": _alternatives(32)}),
        ['{"x": "'],
    ),
    "enum of 5,000 words": (plans.field({"enum": WORDS[:5000]}), ['{"x": ', '{"x": "', '{"x": "b']),
    "array of anyOf of 29 enums": (
        plans.field(
            {
                "type": "array",
                "items": {"anyOf": [{"enum": [f"{c}{i}" for i in range(30)]} for c in ALNUM[:29]]},
            }
        ),
        ['{"x": [', '{"x": ["', '{"x": ["a1", '],
    ),
    "pattern of 15 optional groups": (
        plans.field({"type": "string", "pattern": "^" + "(ab)?" * 15 + "a$"}),
        ['{"x": "a', '{"x": "aba'],
    ),
}


@pytest.mark.perf  # under 100 ms per token (measured 10-27 ms)
@pytest.mark.parametrize("name", WIDEST)
def test_widest_accepted_grammars_sample_quickly(sampling: Sampling, name: str) -> None:
    schema, prefixes = WIDEST[name]
    grammar = plans.plan(response_format=_response_format(schema)).grammar
    assert grammar is not None
    worst = max(sampling.seconds(grammar, prefix) for prefix in prefixes)
    assert worst < 0.1, f"{name}: {worst * 1e3:.1f} ms per token"


@pytest.mark.perf  # under 50 ms per token
def test_many_tools_sample_quickly(sampling: Sampling) -> None:
    small = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    plan = plans.plan(
        tools=[plans.tool(f"tool_{i}", small) for i in range(128)], tool_choice="required"
    )
    assert plan.grammar is not None
    for prefix in ["", "<tool_call>\n", '<tool_call>\n{"name": "tool_']:
        assert sampling.seconds(plan.grammar, prefix) < 0.05
