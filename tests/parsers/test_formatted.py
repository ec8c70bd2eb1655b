"""The one streaming tool-call parser, on the syntaxes analysis finds for real families'
templates: every cut of the text gives the same calls, and no markup reaches content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.core.events import Event, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from sluice.core.syntax import CallId, JsonArgs, Lit, Name, PythonArgs, ToolSyntax
from sluice.local.templates import ChatTemplate
from sluice.parsers.analysis import analyze
from sluice.parsers.formatted import FormatParser
from sluice.templates import bundled

TYPES = {
    "special_function": {"arg1": {"type": "integer"}},
    "python": {"code": {"type": "string"}},
    "get": {"city": {"type": "string"}, "days": {"type": "integer"}},
}


def family(name: str) -> ToolSyntax:
    source = bundled(name)
    assert source is not None
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>", model_id=name)
    syntax = analyze(template.render_probe, source).tools
    assert syntax is not None
    return syntax


def run(syntax: ToolSyntax, text: str, step: int) -> tuple[str, list[dict[str, Any]], list[Event]]:
    parser = FormatParser(0, syntax, TYPES)
    events: list[Event] = []
    for at in range(0, len(text), step):
        events += parser.feed(text[at : at + step])
    events += parser.flush()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            calls.append({"name": e.name, "id": e.id, "args": ""})
        elif isinstance(e, ToolCallDelta):
            calls[e.index]["args"] += e.arguments
    ends = [e.index for e in events if isinstance(e, ToolCallEnd)]
    assert ends == list(range(len(calls)))
    assert parser.called_tools == bool(calls)
    return content, calls, events


CASES = [
    (
        "Qwen3-Coder",
        (
            "Let me run it.\n<tool_call>\n<function=python>\n<parameter=code>\n"
            'def hello():\n    print("hi")\n\nhello()\n</parameter>\n</function>\n</tool_call>\n'
            "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        "Let me run it.",
        [
            ("python", {"code": 'def hello():\n    print("hi")\n\nhello()'}),
            ("special_function", {"arg1": 1}),
        ],
    ),
    (
        "Qwen-Qwen2.5-7B-Instruct",
        '<tool_call>\n{"name": "get", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        "",
        [("get", {"city": "Paris", "days": 2})],
    ),
    (
        "GLM-4.6",
        (
            "<tool_call>get\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        ),
        "",
        [("get", {"city": "Paris", "days": 3})],
    ),
    (
        "MiniMax-M2",
        (
            'Checking.<minimax:tool_call>\n<invoke name="get">\n<parameter name="city">Paris</parameter>\n'
            "</invoke>\n</minimax:tool_call>"
        ),
        "Checking.",
        [("get", {"city": "Paris"})],
    ),
    (
        "deepseek-ai-DeepSeek-V3.1",
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get<｜tool▁sep｜>"
            '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        ),
        "",
        [("get", {"city": "Paris"})],
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS][{"name": "get", "arguments": {"city": "Paris"}, "id": "abc123def"}]',
        "",
        [("get", {"city": "Paris"})],
    ),
    (
        "Apertus-8B-Instruct",  # the name is the object's key
        (
            '<|tools_prefix|>[{"get": {"city": "Paris", "days": 2}}, '
            '{"special_function": {"arg1": 1}}]<|tools_suffix|>'
        ),
        "",
        [("get", {"city": "Paris", "days": 2}), ("special_function", {"arg1": 1})],
    ),
    (
        "openbmb-MiniCPM5-1B",  # a value in CDATA may hold its own closing tag
        (
            'Run:<function name="python"><param name="code"><![CDATA[if a < b:\n'
            '    print("</param>")]]></param></function>'
        ),
        "Run:",
        [("python", {"code": 'if a < b:\n    print("</param>")'})],
    ),
]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_family_s_calls_parse_at_any_cut(
    name: str, text: str, content: str, calls: list[tuple[str, dict[str, Any]]], step: int
) -> None:
    got_content, got, _ = run(family(name), text, step)
    assert got_content.strip() == content
    assert [(c["name"], json.loads(c["args"])) for c in got] == calls


def test_the_model_s_call_ids_are_kept() -> None:
    text = '[TOOL_CALLS]get[CALL_ID]123456789[ARGS]{"city": "Paris"}[TOOL_CALLS]get[CALL_ID]abc[ARGS]{}'
    _, calls, _ = run(family("Mistral-Small-3.2-24B-Instruct-2506"), text, 3)
    assert [c["id"] for c in calls] == ["123456789", "abc"]
    nemo = '[TOOL_CALLS][{"name": "get", "arguments": {}, "id": "abc123def"}]'
    _, calls, _ = run(family("mistralai-Mistral-Nemo-Instruct-2407"), nemo, 1)
    assert calls[0]["id"] == "abc123def"


def test_markup_that_opens_no_call_is_content() -> None:
    syntax = family("Qwen3-Coder")
    text = "Use <tool_call> tags like <tool_call>this</tool_call> to call tools."
    for step in (1, 4, 100):
        content, calls, _ = run(syntax, text, step)
        assert calls == [] and content == text


def test_no_markup_ever_reaches_content() -> None:
    syntax = family("deepseek-ai-DeepSeek-V3.1")
    text = (
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    for step in range(1, 12):
        _, _, events = run(syntax, text, step)
        for e in events:
            if isinstance(e, TextDelta):
                assert "<" not in e.text, (step, e.text)


def test_a_string_value_streams_as_it_is_written() -> None:
    parser = FormatParser(0, family("Qwen3-Coder"), TYPES)
    events = parser.feed("<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n")
    args = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
    assert args == '{"code": "print(1)'  # the newline waits: it may end the value
    events = parser.feed("prin")
    args += "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
    assert args == '{"code": "print(1)\\nprin'
    events = parser.feed("t(2)\n</parameter>\n</function>\n</tool_call>") + parser.flush()
    args += "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
    assert json.loads(args) == {"code": "print(1)\nprint(2)"}


def test_python_style_arguments() -> None:
    syntax = ToolSyntax(
        call=(Lit("<|tool_call_start|>["), Name(), PythonArgs(), Lit("]<|tool_call_end|>"))
    )
    text = '<|tool_call_start|>[get(city="Paris", days=None, ok=True)]<|tool_call_end|>'
    for step in (1, 7):
        _, calls, _ = run(syntax, text, step)
        assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": None, "ok": True}


def test_a_call_cut_short_ends_with_what_there_is() -> None:
    syntax = ToolSyntax(call=(Lit("<call>"), Name(), Lit(":"), CallId(), Lit("<args>"), JsonArgs()))
    content, calls, _ = run(syntax, 'Hi<call>get:7<args>{"city": "Par', 2)
    assert content == "Hi"
    assert calls == [{"name": "get", "id": "7", "args": '{"city": "Par'}]


def test_nested_markup_values_follow_the_schema() -> None:
    from sluice.parsers.families import MINIMAX_M3

    assert MINIMAX_M3.tools is not None
    ns = "]<]minimax[>["
    types = {
        "f": {
            "point": {"type": "object", "properties": {"x": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "string"}},
            "limit": {"oneOf": [{"type": "integer"}, {"type": "object"}]},
            "label": {"anyOf": [{"type": "string"}, {"type": "object"}]},
        }
    }
    text = (
        f'{ns}<tool_call>\n{ns}<invoke name="f">{ns}<point>{ns}<x>1.5{ns}</x>{ns}</point>'
        f"{ns}<tags>{ns}<item>a{ns}</item>{ns}<item>b{ns}</item>{ns}</tags>"
        f"{ns}<limit>3{ns}</limit>{ns}<label>{ns}<b>hi{ns}</b>{ns}</label>"
        f'{ns}</invoke>\n{ns}<invoke name="f">{ns}</invoke>\n{ns}</tool_call>'
    )
    for step in (1, 3, 1000):
        parser = FormatParser(0, MINIMAX_M3.tools, types)
        events = [e for k in range(0, len(text), step) for e in parser.feed(text[k : k + step])]
        events += parser.flush()
        args = ["", ""]
        for e in events:
            if isinstance(e, ToolCallDelta):
                args[e.index] += e.arguments
        assert json.loads(args[0]) == {
            "point": {"x": 1.5},
            "tags": ["a", "b"],
            "limit": 3,
            "label": f"{ns}<b>hi{ns}</b>",  # a union with a string reads as the string
        }
        assert json.loads(args[1]) == {}
        assert not [e for e in events if isinstance(e, TextDelta) and e.text.strip()]
