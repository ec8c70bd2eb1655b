"""The incremental tool-call JSON scanner, and split-invariance on random markup soup."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from sluice.parsers.jsonscan import JsonValueScanner, ToolCallScanner
from sluice.parsers.reasoning import ReasoningParser
from sluice.parsers.registry import tool_parser
from tests.support.parser_events import fold, run


def scan(pieces: list[str]) -> tuple[ToolCallScanner, str | None, str, str]:
    """Feed until done/failed; returns (scanner, name, arguments, text left for the framing)."""
    s = ToolCallScanner()
    name: str | None = None
    args, left = "", ""
    for piece in pieces:
        if s.done or s.failed:
            left += piece
            continue
        step = s.feed(piece)
        if step.name is not None:
            assert name is None, "name reported twice"
            name = step.name
        if step.arguments:
            assert name is not None, "arguments before the name"
        args += step.arguments
        left += piece[step.consumed :]
    if not (s.done or s.failed):
        args += s.finish().arguments
    return s, name, args, left


OBJ = '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": [1, 2]}}'


def test_name_is_reported_when_complete_and_arguments_as_they_arrive() -> None:
    s = ToolCallScanner()
    step = s.feed('{"name": "get_wea')
    assert step.name is None and step.arguments == ""
    step = s.feed('ther", "arguments": {"ci')
    assert step.name == "get_weather" and step.arguments == '{"ci'
    step = s.feed('ty": "Tokyo"}}\n</tool_call>')
    assert step.arguments == 'ty": "Tokyo"}' and s.done
    assert step.consumed == len('ty": "Tokyo"}}')


@pytest.mark.parametrize("cut", range(1, len(OBJ)))
def test_any_cut_gives_the_same_name_arguments_and_rest(cut: int) -> None:
    s, name, args, left = scan([OBJ[:cut], OBJ[cut:] + " tail"])
    assert (s.done, name, args, left) == (True, "get_weather", OBJ[37:-1], " tail")
    assert json.loads(args) == {"city": "Tokyo", "days": [1, 2]}


@pytest.mark.parametrize(
    ("text", "name", "args"),
    [
        ('{"name":"f","arguments":{}}', "f", "{}"),
        ('{ "name" : "f" , "parameters" : { "a" : "b" } }', "f", '{ "a" : "b" }'),
        ('{"name": "f\\u00e9\\"x", "arguments": {"k": "\\\\"}}', 'f\u00e9"x', '{"k": "\\\\"}'),
        ('{"id": {"n": [1, "}"]}, "name": "f", "arguments": {"a": 1}}', "f", '{"a": 1}'),
        ('{"arguments": {"a": "\\"}"}, "name": "f"}', "f", '{"a": "\\"}"}'),
        ('{"name": "f", "arguments": "{\\"a\\": [1]}"}', "f", '{"a": [1]}'),
        ('{"name": "f", "arguments": "plain words"}', "f", '"plain words"'),
        ('{"name": "f", "arguments": null}', "f", "{}"),
        ('{"name": "f", "arguments": [1, 2]}', "f", "[1, 2]"),
        ('{"name": "f"}', "f", "{}"),
        ('{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}', "f", '{"a": 1}'),
    ],
)
def test_object_shapes(text: str, name: str, args: str) -> None:
    for pieces in ([text], list(text)):
        s, got_name, got_args, left = scan(pieces)
        assert (s.done, got_name, got_args, left) == (True, name, args, "")


@pytest.mark.parametrize(
    "text",
    ['{"city": "Tokyo"}', "[1, 2]", "hello", '{"name": 3}', '{"name": ""}', '{"a" 1}', "{,}"],
)
def test_not_a_tool_call(text: str) -> None:
    s, name, _, _ = scan([text])
    assert s.failed and name is None
    assert text.startswith(s.raw)


def test_a_scanner_failure_does_not_consume_the_offending_character() -> None:
    s = ToolCallScanner()
    step = s.feed('{"name": "f", "arguments": {"a": 1] rest')
    assert s.failed and step.consumed == len('{"name": "f", "arguments": {"a": 1')
    assert (s.name, step.arguments) == ("f", '{"a": 1')


def test_a_complete_call_followed_by_junk_is_done_without_the_junk() -> None:
    s = ToolCallScanner()
    step = s.feed('{"name": "f", "arguments": {"a": 1}] rest')
    assert s.done and not s.failed
    assert step.consumed == len('{"name": "f", "arguments": {"a": 1}')


@pytest.mark.parametrize(
    ("text", "end", "done"),
    [
        ('{"a": [1, {"b": "]"}]} x', 22, True),
        ('"str \\" still" x', 14, True),
        ("123, x", 3, True),
        ("true}", 4, True),
        ('{"a": [1}', 8, False),  # mismatched closer: failed
        ('{"a": ', 6, False),
    ],
)
def test_value_scanner(text: str, end: int, done: bool) -> None:
    v = JsonValueScanner()
    assert v.feed(text) == end
    assert v.done is done


def test_value_scanner_finishes_a_top_level_scalar_at_the_end() -> None:
    v = JsonValueScanner()
    assert v.feed("-12.5") == 5 and not v.done
    assert v.finish() and v.done


SOUP = [
    "Hello",
    " ",
    "\n",
    "a < b",
    "<",
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "</tool",
    '{"name": "f", "arguments": {"a": [1, "x\\"}"]}}',
    '{"name": "g"',
    ', "arguments": ',
    '{"q": "\\u00e9"}',
    "}",
    "{",
    "]",
    "[",
    '"',
    "\\",
    ";",
    ",",
    "[TOOL_CALLS]",
    "[TOOL_",
    "get_weather",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "<think>",
    "</think>",
    "<thi",
    '{"city": "Tokyo"}',
    "null",
    '"name"',
    ":",
    '[{"name": "h", "arguments": {}}]',
]


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "generic", "reasoning"])
def test_random_soup_folds_the_same_however_it_is_cut(fmt: str) -> None:
    rng = random.Random(fmt)
    for _ in range(300):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(1, 12)))

        def make() -> ReasoningParser:
            return ReasoningParser(0)

        factory = make if fmt == "reasoning" else (lambda: tool_parser(fmt, 0))
        whole = fold(run(factory(), [text])).summary
        for _ in range(4):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text)))))
            bounds = [0, *cuts, len(text)]
            pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
            assert fold(run(factory(), pieces)).summary == whole, (text, pieces)
        assert fold(run(factory(), list(text))).summary == whole, text
