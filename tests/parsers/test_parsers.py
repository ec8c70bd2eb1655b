"""Streaming parsers: every family fed whole, cut at every position and char by char."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from sluice.core.events import Event, TextDelta, ToolCallDelta, ToolCallStart
from sluice.parsers.base import StreamParser
from sluice.parsers.generic import GenericParser
from sluice.parsers.hermes import HermesParser
from sluice.parsers.llama3 import Llama3Parser
from sluice.parsers.mistral import MistralParser
from sluice.parsers.reasoning import ReasoningParser
from sluice.parsers.registry import TOOL_FORMATS, tool_parser
from tests.support.parser_events import fold, fold_every_split, run, splits

TOKYO = '{"city": "Tokyo"}'
PARIS = '{"city": "Paris", "unit": "celsius"}'
# Nested objects, arrays, escaped quotes and backslashes, \u escapes, raw unicode, numbers.
HARD = (
    '{"query": "say \\"hi\\" \\\\ {not: json}", "filters": {"tags": ["a", "b]", {"x": null}],'
    ' "range": [1, -2.5e3, true]}, "emoji": "\\u00e9\\ud83d\\ude00 \u6771\u4eac", "empty": {}}'
)

Case = tuple[str, str, str, list[tuple[str, str]]]  # family, text, content, calls


def hermes_call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


CASES: list[Case] = [
    # -- hermes ---------------------------------------------------------------------
    ("hermes", hermes_call("get_weather", TOKYO), "", [("get_weather", TOKYO)]),
    ("hermes", "Just text, no calls.\n", "Just text, no calls.\n", []),
    (
        "hermes",
        "Let me check.\n"
        + hermes_call("get_weather", TOKYO)
        + "\n"
        + hermes_call("get_weather", PARIS)
        + "\nDone.",
        "Let me check.\n\n\nDone.",  # markup removed, whitespace between content kept
        [("get_weather", TOKYO), ("get_weather", PARIS)],
    ),
    ("hermes", hermes_call("search", HARD), "", [("search", HARD)]),
    # arguments before the name; a JSON string holding JSON; missing arguments; no newlines
    (
        "hermes",
        '<tool_call>{"arguments": {"a": [1, {"b": 2}]}, "name": "f"}</tool_call>',
        "",
        [("f", '{"a": [1, {"b": 2}]}')],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": \\"x\\"}"}\n</tool_call>',
        "",
        [("f", '{"a": "x"}')],
    ),
    ("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", "{}")]),
    # a < b is not a tag; neither is a tag prefix left at the end
    ("hermes", "if a < b and b <tool then <tool_", "if a < b and b <tool then <tool_", []),
    ("hermes", "<tool_call> not json </tool_call>", "<tool_call> not json </tool_call>", []),
    # -- generic (the Hermes shape) -------------------------------------------------------
    (
        "generic",
        "Sure.\n" + hermes_call("get_weather", TOKYO),
        "Sure.",
        [("get_weather", TOKYO)],
    ),
    # -- llama3 ---------------------------------------------------------------------
    (
        "llama3",
        '{"name": "get_weather", "parameters": ' + TOKYO + "}",
        "",
        [("get_weather", TOKYO)],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": ' + TOKYO + "}; "
        '{"name": "get_weather", "arguments": ' + PARIS + "}",
        "",
        [("get_weather", TOKYO), ("get_weather", PARIS)],
    ),
    (
        "llama3",
        '\n{"type": "function", "name": "search", "parameters": ' + HARD + "}\n"
        '{"name": "now", "parameters": {}}\n',
        "",
        [("search", HARD), ("now", "{}")],
    ),
    ("llama3", "The answer is {x}.", "The answer is {x}.", []),
    ("llama3", '{"city": "Tokyo"} is JSON', '{"city": "Tokyo"} is JSON', []),
    ("llama3", " <|python_tag", " <|python_tag", []),
    (
        "llama3",
        '{"name": "f", "parameters": {"a": 1}}\nThat is all.',
        "That is all.",
        [("f", '{"a": 1}')],
    ),
    # -- mistral --------------------------------------------------------------------
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + TOKYO + "}, "
        '{"name": "get_weather", "arguments": ' + PARIS + ', "id": "abc123xyz"}]',
        "",
        [("get_weather", TOKYO), ("get_weather", PARIS)],
    ),
    (
        "mistral",
        "I will look it up.\n[TOOL_CALLS]get_weather[ARGS]"
        + TOKYO
        + "[TOOL_CALLS]get_weather[ARGS]"
        + PARIS,
        "I will look it up.",
        [("get_weather", TOKYO), ("get_weather", PARIS)],
    ),
    ("mistral", "[TOOL_CALLS]search[ARGS]" + HARD, "", [("search", HARD)]),
    (
        "mistral",
        "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]" + TOKYO,
        "",
        [("get_weather", TOKYO)],
    ),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}\nok', "ok", [("f", "{}")]),
    ("mistral", "Arrays look like [1, 2] and [TOOL", "Arrays look like [1, 2] and [TOOL", []),
    ("mistral", "[TOOL_CALLS]Hello world", "[TOOL_CALLS]Hello world", []),
]


def factory(fmt: str) -> Callable[[], StreamParser]:
    return lambda: tool_parser(fmt, 0)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_every_split_folds_to_the_same_result(
    fmt: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    assert fold_every_split(factory(fmt), text) == (content, "", calls)
    for _, args in calls:  # what a client would json.loads
        assert isinstance(json.loads(args), dict)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [c for c in CASES if c[3]])
def test_markup_never_reaches_content_of_a_call(
    fmt: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    for pieces in [[text], list(text)]:
        got = fold(run(tool_parser(fmt, 0), pieces)).content
        for mark in (
            "<tool_call>",
            "</tool_call>",
            "[TOOL_CALLS]",
            "[ARGS]",
            "<|python_tag|>",
            '"name"',
            "{",
        ):
            assert mark not in got


def test_the_registry_names_the_four_families() -> None:
    assert set(TOOL_FORMATS) == {"hermes", "llama3", "mistral", "generic"}
    assert isinstance(tool_parser("hermes", 0), HermesParser)
    assert isinstance(tool_parser("llama3", 0), Llama3Parser)
    assert isinstance(tool_parser("mistral", 0), MistralParser)
    assert isinstance(tool_parser("generic", 0), GenericParser)
    with pytest.raises(ValueError, match="unknown tool format"):
        tool_parser("nope", 0)


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", "x\n" + hermes_call("a", TOKYO) + hermes_call("b", PARIS)),
        (
            "llama3",
            '{"name": "a", "parameters": ' + TOKYO + '};{"name": "b", "parameters": ' + PARIS + "}",
        ),
        ("mistral", "[TOOL_CALLS]a[ARGS]" + TOKYO + "[TOOL_CALLS]b[ARGS]" + PARIS),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "a", "arguments": ' + TOKYO + '},{"name": "b", '
            '"arguments": ' + PARIS + "}]",
        ),
    ],
)
def test_parallel_calls_have_dense_indexes_and_distinct_ids(fmt: str, text: str) -> None:
    events = run(tool_parser(fmt, 3, id_prefix="call_"), [text])
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.choice, s.index, s.name) for s in starts] == [(3, 0, "a"), (3, 1, "b")]
    assert starts[0].id != starts[1].id
    assert all(s.id.startswith("call_") and len(s.id) == 29 for s in starts)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert "".join(d.arguments for d in deltas if d.index == 0) == TOKYO
    assert "".join(d.arguments for d in deltas if d.index == 1) == PARIS


@pytest.mark.parametrize(
    ("fmt", "prefix"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": '),
        ("llama3", '{"name": "get_weather", "parameters": '),
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]"),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": '),
    ],
)
def test_arguments_stream_as_they_are_written(fmt: str, prefix: str) -> None:
    parser = tool_parser(fmt, 0)
    first = parser.feed(prefix)
    assert [type(e) for e in first] == [ToolCallStart]
    assert parser.called_tools
    assert parser.feed('{"city"') == [ToolCallDelta(0, 0, '{"city"')]
    assert parser.feed(': "To') == [ToolCallDelta(0, 0, ': "To')]
    assert parser.feed("") == []


@pytest.mark.parametrize(
    ("fmt", "text", "args"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "To',
            '{"city": "To',
        ),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "To', '{"city": "To'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "To', '{"city": "To'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', '{"ci'),
        ("hermes", '<tool_call>{"arguments": {"city": "To', ""),  # no name yet
        ("hermes", '<tool_call>\n{"name": "get_weather"', ""),
    ],
)
def test_a_call_cut_by_the_end_of_output_is_ended(fmt: str, text: str, args: str) -> None:
    for pieces in splits(text, random_cuts=5):
        folded = fold(run(tool_parser(fmt, 0), pieces))  # fold asserts every call ended
        if args or '"name"' in text:
            assert folded.summary == ("", "", [("get_weather", args)])
        else:  # the name never came: not a call, the model's text is content
            assert folded.summary == (text, "", [])


def test_a_cut_call_keeps_earlier_complete_calls() -> None:
    text = hermes_call("a", TOKYO) + '\n<tool_call>\n{"name": "b", "arguments": {"x": [1, '
    assert fold_every_split(lambda: HermesParser(0), text) == (
        "",
        "",
        [("a", TOKYO), ("b", '{"x": [1, ')],
    )


def test_called_tools_only_after_a_call_starts() -> None:
    parser = HermesParser(0)
    parser.feed("Hello <tool_call>\n")
    assert not parser.called_tools
    parser.feed('{"name": "f"')
    assert parser.called_tools
    plain = Llama3Parser(0)
    run(plain, ["just ", "text"])
    assert not plain.called_tools


def test_content_is_not_delayed_more_than_a_possible_tag() -> None:
    parser = HermesParser(0)
    assert parser.feed("Hello wor") == [TextDelta(0, "Hello wor")]
    assert parser.feed("ld <tool") == [TextDelta(0, "ld")]  # " <tool" may open a call
    assert parser.feed("box") == [TextDelta(0, " <toolbox")]
    llama = Llama3Parser(0)
    assert llama.feed("Hi") == [TextDelta(0, "Hi")]  # not a call: pass-through at once
    assert llama.feed(" {") == [TextDelta(0, " {")]


def test_junk_after_the_object_stays_out_of_content() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}}\n</tool_call>\nok'
    assert fold_every_split(lambda: HermesParser(0), text) == ("ok", "", [("f", '{"a": 1}')])


def test_a_missing_closing_brace_before_the_tag_still_makes_a_call() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "}"}\n</tool_call>'
    assert fold_every_split(lambda: HermesParser(0), text) == ("", "", [("f", '{"a": "}"}')])


# -- reasoning ---------------------------------------------------------------------------


def reasoning(opened: bool = False) -> Callable[[], StreamParser]:
    return lambda: ReasoningParser(0, opened=opened)


@pytest.mark.parametrize(
    ("text", "opened", "content", "thought"),
    [
        ("<think>Let me see.</think>\n\nHello!", False, "Hello!", "Let me see."),
        ("\n<think>\nhmm</think>Hi", False, "Hi", "\nhmm"),
        ("Let me see.</think>\nHello", True, "Hello", "Let me see."),
        ("<think>x</think>y", True, "y", "<think>x"),  # as llama.cpp: reasoning text
        ("No thinking here. <think> is a tag.", False, "No thinking here. <think> is a tag.", ""),
        ("a < b", False, "a < b", ""),
        ("<thin", False, "<thin", ""),
        ("<think>cut short at max_to", False, "", "cut short at max_to"),
        ("<think>cut in the end tag </thi", False, "", "cut in the end tag </thi"),
        ("still thinking", True, "", "still thinking"),
        ("<think>a</think> b </think>", False, "b </think>", "a"),
        ("<think></think>\n\n", False, "", ""),
    ],
)
def test_reasoning_split(text: str, opened: bool, content: str, thought: str) -> None:
    assert fold_every_split(reasoning(opened), text) == (content, thought, [])


def test_reasoning_markers_are_configurable() -> None:
    def make() -> StreamParser:
        return ReasoningParser(0, "<|think|>", "<|/think|>")

    assert fold_every_split(make, "<|think|>a<b<|/think|>c") == ("c", "a<b", [])


def test_the_answer_s_opening_ends_reasoning_left_open() -> None:
    # Kimi K3: a model may go from its opened think block straight to the response
    def make() -> StreamParser:
        return ReasoningParser(
            0, "<|open|>think<|sep|>", "<|close|>think<|sep|>", opened=True, answer="<|open|>r>"
        )

    assert fold_every_split(make, "hmm<|open|>r>Hi") == ("<|open|>r>Hi", "hmm", [])
    assert fold_every_split(make, "a<|close|>think<|sep|><|open|>r>b") == ("<|open|>r>b", "a", [])


def test_the_prompt_s_words_lead_the_reasoning() -> None:
    def make() -> StreamParser:
        return ReasoningParser(0, "", "[END]", opened=True, lead="Steps:\n")

    assert fold_every_split(make, "one[END]Hi") == ("Hi", "Steps:\none", [])


def chain(fmt: str, opened: bool = False) -> Callable[[], StreamParser]:
    """Reasoning first; only its content goes on to the tool parser (as the server chains)."""

    class Chain:
        def __init__(self) -> None:
            self.first = ReasoningParser(0, opened=opened)
            self.second = tool_parser(fmt, 0)

        @property
        def called_tools(self) -> bool:
            return self.second.called_tools

        def _pass(self, events: list[Event]) -> list[Event]:
            out: list[Event] = []
            for ev in events:
                out += self.second.feed(ev.text) if isinstance(ev, TextDelta) else [ev]
            return out

        def feed(self, text: str) -> list[Event]:
            return self._pass(self.first.feed(text))

        def flush(self) -> list[Event]:
            return self._pass(self.first.flush()) + self.second.flush()

    return Chain


def test_a_tool_call_inside_reasoning_stays_reasoning() -> None:
    inner = hermes_call("secret", TOKYO)
    text = f"<think>I could write {inner} here.</think>\nReal answer.\n" + hermes_call("f", PARIS)
    assert fold_every_split(chain("hermes"), text) == (
        "Real answer.",
        f"I could write {inner} here.",
        [("f", PARIS)],
    )
    opened = "Maybe [TOOL_CALLS]x[ARGS]{}</think>[TOOL_CALLS]y[ARGS]{}"
    assert fold_every_split(chain("mistral", opened=True), opened) == (
        "",
        "Maybe [TOOL_CALLS]x[ARGS]{}",
        [("y", "{}")],
    )
    parser = chain("hermes")()
    run(parser, [f"<think>{inner}</think>no call"])
    assert not parser.called_tools
