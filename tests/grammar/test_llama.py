"""The grammars sluice writes, compiled and run by the gate the runner samples with
(llguidance's matcher on SmolLM2's vocabulary).

Each grammar here must compile (a grammar the gate rejects is a failed request),
quickly, and accept exactly the JSON text it should, fed one single-byte token
at a time.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sluice.core.request import SamplingParams
from sluice.engine.llama_runner import LlamaRunner
from sluice.grammar import CallFraming, ToolSpec, json_schema_grammar, tool_call_grammar
from sluice.local.plan import FRAMINGS
from tests.support.llama import real_runner


class Judge:
    """Compiles a grammar in llama.cpp and asks it whether a text is a complete sentence."""

    def __init__(self, runner: LlamaRunner) -> None:
        import llama_cpp

        self.L: Any = llama_cpp
        self.runner = runner
        self.byte_token: dict[int, int] = {}
        for t in range(runner.n_vocab):
            piece = runner.token_bytes(t)
            if len(piece) == 1:
                self.byte_token.setdefault(piece[0], t)
        self.eos = next(t for t in range(runner.n_vocab) if runner.is_eog(t))

    def compile_seconds(self, grammar: str) -> float:
        t = time.perf_counter()
        chain = self.runner.new_sampler(SamplingParams(grammar=grammar, temperature=0), [])
        seconds = time.perf_counter() - t
        self.runner.free_sampler(chain)
        return seconds

    def accepts(self, grammar: str, text: str) -> bool:
        """Byte by byte through the gate the runner samples with (llguidance's)."""
        chain = self.runner.new_sampler(SamplingParams(grammar=grammar, temperature=0), [])
        gate = chain.gate
        assert gate is not None
        try:
            for byte in text.encode():
                token = self.byte_token[byte]
                if not gate.allows(token):
                    return False
                gate.accept(token)
            return gate.allows(self.eos)
        finally:
            self.runner.free_sampler(chain)


@pytest.fixture(scope="module")
def judge() -> Iterator[Judge]:
    with real_runner() as runner:
        yield Judge(runner)


def _field(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": schema}, "required": ["x"]}


def test_integer_bounds_accept_exactly_the_range(judge: Judge) -> None:
    g = json_schema_grammar(_field({"type": "integer", "minimum": 1, "maximum": 20}))
    accepted = [n for n in range(-3, 40) if judge.accepts(g, json.dumps({"x": n}))]
    assert accepted == list(range(1, 21))


def test_bounded_strings_and_arrays(judge: Judge) -> None:
    g = json_schema_grammar(_field({"type": "string", "minLength": 2, "maxLength": 4}))
    for text in ["", "a", "ab", 'a"\\', "abcd", "abcde"]:
        assert judge.accepts(g, json.dumps({"x": text})) == (2 <= len(text) <= 4), text
    g = json_schema_grammar(
        _field({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3})
    )
    for n in range(5):
        assert judge.accepts(g, json.dumps({"x": list(range(n))})) == (1 <= n <= 3), n


@pytest.mark.parametrize(
    "pattern", [r"^\d{3}-[a-z\"]{2,}(x|y)?.$", r"^[^a]{0,3}\\$", r"^(?:ab|\.){2}$"]
)
def test_patterns_agree_with_python(judge: Judge, pattern: str) -> None:
    g = json_schema_grammar(_field({"type": "string", "pattern": pattern}))
    py = re.compile(pattern[1:-1], re.ASCII)
    samples = ["123-ab.", '123-a"bx!', "12-ab.", "123-abxy", '123-ab"', "b\\", "\\", "\n\t\\"]
    samples += ["abab", "ab.", "..", "a\\"]
    for s in samples:
        assert judge.accepts(g, json.dumps({"x": s})) == bool(py.fullmatch(s)), (pattern, s)


BIG = 10**9
HUGE = {
    "maxLength": _field({"type": "string", "maxLength": BIG}),
    "minLength": _field({"type": "string", "minLength": BIG}),
    "maxItems": {
        "type": "array",
        "items": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "maxItems": BIG,
    },
    "minItems": _field({"type": "array", "items": {"type": "integer"}, "minItems": BIG}),
    "pattern": _field({"type": "string", "pattern": rf"^(ab|c[d-f]|\d){{0,{BIG}}}$"}),
    "enum5000": _field({"type": "string", "enum": [f"v{i}" for i in range(5000)]}),
    "props2000": {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(2000)},
    },
}


@pytest.mark.parametrize("name", HUGE)
def test_huge_schemas_compile_quickly(judge: Judge, name: str) -> None:
    """Bounds of 10**9 and thousands of alternatives cost llguidance nothing up front
    (the old converter wrote 10**9 copies, or refused)."""
    t = time.perf_counter()
    g = json_schema_grammar(HUGE[name])
    assert time.perf_counter() - t < 1.0 and len(g) < 200_000
    assert judge.compile_seconds(g) < 1.0


def test_a_huge_maximum_is_kept_and_a_small_one_exact(judge: Judge) -> None:
    g = json_schema_grammar(HUGE["maxLength"])
    assert judge.accepts(g, json.dumps({"x": "a" * 300}))
    g = json_schema_grammar(_field({"type": "string", "maxLength": 40}))
    assert judge.accepts(g, json.dumps({"x": "a" * 40}))
    assert not judge.accepts(g, json.dumps({"x": "a" * 41}))


def test_listed_properties_close_the_object_unless_the_schema_opens_it(judge: Judge) -> None:
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = json_schema_grammar(closed)
    assert judge.accepts(g, '{"a": 1}') and judge.accepts(g, "{}")
    assert not judge.accepts(g, '{"a": 1, "b": 2}')
    assert closed == {"type": "object", "properties": {"a": {"type": "integer"}}}  # untouched
    g = json_schema_grammar({**closed, "additionalProperties": {"type": "boolean"}})
    assert judge.accepts(g, '{"a": 1, "b": true}') and not judge.accepts(g, '{"a": 1, "b": 2}')
    # Values are data, not schemas: an enum of objects keeps its objects as they are.
    value = {"properties": {"k": 1}}
    g = json_schema_grammar(_field({"enum": [value]}))
    assert judge.accepts(g, json.dumps({"x": value}))


def test_all_of_branches_describe_one_object(judge: Judge) -> None:
    """Closing each branch of an allOf would make it refuse the others' keys."""
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    g = json_schema_grammar(schema)
    assert judge.accepts(g, '{"a": 1, "b": 2}') and not judge.accepts(g, '{"a": 1}')
    # A property named like a keyword is a property: its object is closed as usual.
    g = json_schema_grammar(
        _field({"type": "object", "properties": {"default": {"type": "integer"}}})
    )
    assert judge.accepts(g, '{"x": {"default": 1}}')
    assert not judge.accepts(g, '{"x": {"default": 1, "y": 2}}')


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3"])
def test_tool_grammar_frames_each_call(judge: Judge, fmt: str) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    g = tool_call_grammar(
        [ToolSpec("get_weather", params), ToolSpec("noop", {})], FRAMINGS[fmt], max_calls=2
    )
    f = FRAMINGS[fmt]
    one = (
        f'{f.call_open}{{"name": "get_weather", "{f.args_key}": {{"city": "Oslo"}}}}{f.call_close}'
    )
    two = f'{f.call_open}{{"name": "noop", "{f.args_key}": {{}}}}{f.call_close}'
    assert judge.accepts(g, f"{f.prefix}{one}{f.suffix}")
    assert judge.accepts(g, f"{f.prefix}{one}{f.sep}{two}{f.suffix}")
    assert not judge.accepts(g, f"{f.prefix}{one}{f.sep}{two}{f.sep}{one}{f.suffix}")  # max 2
    extra = one.replace('"Oslo"', '"Oslo", "x": 1')
    assert not judge.accepts(g, f"{f.prefix}{extra}{f.suffix}")
    assert not judge.accepts(g, f"{f.prefix}{one.replace('get_weather', 'get_weathr')}{f.suffix}")


def test_tool_grammar_with_hostile_names_compiles_and_parses(judge: Judge) -> None:
    evil = 'a\\" | [x]{0,1000000000} | "'
    schema = {
        "type": "object",
        "properties": {evil: {"type": "string", "enum": [evil]}, "n": {"type": "integer"}},
        "required": [evil],
        "additionalProperties": {"type": "boolean"},
    }
    framing = CallFraming(call_open="<tool_call>\n", call_close="\n</tool_call>")
    g = tool_call_grammar([ToolSpec("f", schema), ToolSpec("g", {})], framing, max_calls=2)
    call = {"name": "f", "arguments": {evil: evil, "n": 3, "flag": True}}
    text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    assert judge.accepts(g, text)
    assert not judge.accepts(g, text.replace('"n": 3', '"n": 3 "x": 1'))


def test_a_gate_in_error_lets_only_the_end_through(judge: Judge) -> None:
    runner = judge.runner
    sampler = runner.new_sampler(SamplingParams(grammar='start: "ab"', temperature=0), [])
    gate = sampler.gate
    assert gate is not None
    gate.accept(judge.byte_token[ord("z")])  # refused text: llguidance's error state
    assert gate.matcher.is_error()
    allowed = gate.allowed()
    assert set(map(int, allowed.nonzero()[0])) == set(runner._eog_tokens())
    runner.free_sampler(sampler)
