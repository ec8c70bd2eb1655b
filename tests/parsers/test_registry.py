"""Format detection from chat templates, and the generic tool prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.parsers.generic import GenericParser, tool_call_text, tool_system_prompt
from sluice.parsers.registry import (
    detect_reasoning,
    detect_tool_format,
    reasoning_parser,
    template_opens_think,
)
from sluice.parsers.signatures import brief, signature
from tests.support.parser_events import fold, run


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>{% endfor %}", "hermes"),
        ("{{ '<|python_tag|>' }}{{ message.content }}", "llama3"),
        ("{% if message.role == 'ipython' %}<|start_header_id|>ipython", "llama3"),
        ("{{ '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "generic"),
        (None, "generic"),
    ],
)
def test_detect_tool_format(template: str | None, fmt: str) -> None:
    assert detect_tool_format(template) == fmt


def test_detect_reasoning() -> None:
    assert detect_reasoning("{{ '<think>\\n' }}{{ reasoning }}</think>") == ("<think>", "</think>")
    assert detect_reasoning("<|im_start|>assistant") is None
    assert detect_reasoning(None) is None


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<｜Assistant｜><think>", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking switched off
        ("<|im_start|>assistant\n", False),
        ("<think>old</think>answer<|im_start|>user\nhi<|im_start|>assistant\n", False),
        ("<think>unclosed in an old turn, then\n<|im_start|>assistant\n", False),
    ],
)
def test_template_opens_think(prompt: str, opened: bool) -> None:
    assert template_opens_think(prompt) is opened
    parser = reasoning_parser(("<think>", "</think>"), 0, prompt)
    folded = fold(run(parser, ["abc</think>xyz"]))
    assert (folded.reasoning, folded.content) == (
        ("abc", "xyz") if opened else ("", "abc</think>xyz")
    )


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def test_tool_system_prompt_lists_functions_and_the_exact_format() -> None:
    prompt = tool_system_prompt(TOOLS, "auto", parallel=True)
    assert "get_weather(city: string) - Get weather for a city" in prompt
    assert "\nnow()\n" in prompt
    assert (
        '<tool_call>\n{"name": "<function name>", "arguments": {<parameter>: <value>, ...}}\n'
        "</tool_call>"
    ) in prompt
    assert "several functions" in prompt


def test_signatures_say_what_a_schema_says_in_fewer_words() -> None:
    fn = {
        "name": "read",
        "description": "Read a file.\n\n```\nexample\n```\nUse it   often.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Absolute\npath"},
                "limit": {"type": "integer", "minimum": 1, "default": 100},
                "mode": {"enum": ["text", "bytes"]},
                "tags": {"type": "array", "items": {"type": ["string", "null"]}},
                "at": {"$ref": "#/$defs/Pos"},
            },
            "required": ["path"],
            "$defs": {"Pos": {"type": "object", "properties": {"line": {"type": "integer"}}}},
        },
    }
    assert signature(fn) == (
        'read(path: string, limit?: integer 1.. = 100, mode?: "text"|"bytes", '
        "tags?: (string|null)[], at?: {line?: integer}) - Read a file. Use it often.\n"
        "  path: Absolute path"
    )
    long = "One. " * 400
    assert len(brief(long)) <= 604 and brief(long).endswith("One. ...")


@pytest.mark.parametrize(
    ("choice", "parallel", "says", "not_says"),
    [
        ("required", True, "must call at least one", "only when"),
        (
            {"type": "function", "function": {"name": "now"}},
            False,
            "must call the function now",
            "several",
        ),
        ("function:get_weather", True, "must call the function get_weather", "only when"),
        (None, False, "at most one function", "must call"),
        ("none", True, "Do not call any function", "several"),
    ],
)
def test_tool_system_prompt_honours_tool_choice(
    choice: str | dict[str, Any] | None, parallel: bool, says: str, not_says: str
) -> None:
    prompt = tool_system_prompt(TOOLS, choice, parallel)
    assert says in prompt
    assert not_says not in prompt


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [('{"city": "Tokyo"}', {"city": "Tokyo"}), ("", {}), ("not json", "not json")],
)
def test_tool_call_text_round_trips_through_the_parser(arguments: str, parsed: Any) -> None:
    text = tool_call_text("get_weather", arguments)
    assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>")
    folded = fold(run(GenericParser(0), [text]))
    assert folded.content == ""
    [call] = folded.calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == parsed
