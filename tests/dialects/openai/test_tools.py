"""Tools, reasoning and structured output on /v1/chat/completions, end to end.

Scripted runner (the model's output, token piece by token piece), real engine,
real parsers, real formatters, real HTTP. The fake ignores grammars, so the
scripts play what the model writes; the grammar a request asked for is read
back from the sampler parameters the fake received.

Streaming with tools as llama.cpp's server and the OpenAI SDKs expect it: the
tool-call delta shape, parallel calls, markup never in content, tool_choice,
unique ids, agent histories, reasoning split, response_format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from openai import OpenAI

from sluice.core.request import SamplingParams
from tests.support.fakes import CHATML, EOS, ScriptedRunner
from tests.support.helpers import CHAT, chat_text, finishes, post_stream, scripted_server

# -- fake chat templates ------------------------------------------------------------------

_HISTORY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['reasoning_content'] %}[reasoning: {{ m['reasoning_content'] }}]{% endif %}"
    "{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}"
    "{% if m['role'] == 'tool' %} [for {{ m['tool_call_id'] }}]{% endif %}"
    "<|im_end|>\n{% endfor %}"
)
_TOOLS = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}.\nCall one as <tool_call>\n{...}\n</tool_call><|im_end|>\n{% endif %}"
)
# Hermes/Qwen-like: knows tools (format "hermes"), no reasoning.
HERMES = _TOOLS + _HISTORY + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
# Qwen3-like: tools and <think>; enable_thinking=false writes an empty think block.
QWEN3 = (
    _TOOLS + _HISTORY + "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# DeepSeek-R1-like: the generation prompt opens the think block; no tool support.
R1 = _HISTORY + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"

WEATHER = {
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
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, TIME]

# One call, split at awkward token boundaries (inside the tags, keys and values).
ONE_CALL = [
    b"<tool",
    b'_call>\n{"na',
    b'me": "get_weather", "argu',
    b'ments": {"ci',
    b'ty": "Tok',
    b'yo"}}\n</tool_',
    b"call>",
    EOS,
]
TWO_CALLS = [
    b"<tool_call>",
    b'\n{"name": "get_we',
    b'ather", "arguments": {"city": "Pa',
    b'ris"}}\n</tool_call>\n<to',
    b'ol_call>\n{"name"',
    b': "get_time", "arguments": {"tz": "Europe/Paris"}}',
    b"\n</tool_call>",
    EOS,
]


# -- servers ------------------------------------------------------------------------------


@dataclass
class Server:
    base: str
    runner: ScriptedRunner

    def prompt(self, body: dict[str, Any]) -> str:
        """The rendered prompt the fake receives for ``body`` (found with a probe request)."""
        probe = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n")}
        before = len(self.runner.samplers)
        r = httpx.post(self.base + CHAT, json={**probe, "max_tokens": 1}, timeout=20)
        assert r.status_code == 200, r.text
        return "".join(chr(t) for t in self.runner.samplers[before].prompt)

    def script(self, body: dict[str, Any], items: list[Any]) -> str:
        """Make ``items`` the model's output for ``body``; returns the rendered prompt."""
        text = self.prompt(body)
        self.runner.scripts[text] = items
        return text

    def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        res = post_stream(self.base, CHAT, {**body, "stream": True})
        assert res.status == 200, res.body
        return res.chunks

    def once(self, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(self.base + CHAT, json=body, timeout=20)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def last_params(self) -> SamplingParams:
        return self.runner.samplers[-1].params


def _serve(template: str) -> Iterator[Server]:
    # A long context: the generic format's system prompt describes every tool.
    runner = ScriptedRunner(chat_template=template, n_ctx_seq=4096)
    with scripted_server(runner, parallel=4, queue=16) as base:
        yield Server(base, runner)


@pytest.fixture(scope="module")
def hermes() -> Iterator[Server]:
    """A template with tool support: format "hermes", tools passed to the template."""
    yield from _serve(HERMES)


@pytest.fixture(scope="module")
def generic() -> Iterator[Server]:
    """The plain ChatML template: format "generic", tools in a system prompt."""
    yield from _serve(CHATML)


@pytest.fixture(scope="module")
def qwen3() -> Iterator[Server]:
    """Tools and <think> reasoning."""
    yield from _serve(QWEN3)


@pytest.fixture(scope="module")
def r1() -> Iterator[Server]:
    """The template opens the think block itself."""
    yield from _serve(R1)


@pytest.fixture(params=["hermes", "generic"])
def tool_server(request: pytest.FixtureRequest) -> Server:
    server: Server = request.getfixturevalue(request.param)
    return server


def ask(content: str, **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **kw}


# -- stream reading ---------------------------------------------------------------------


def choice_frames(chunks: list[dict[str, Any]], index: int = 0) -> list[dict[str, Any]]:
    return [c for ch in chunks for c in ch["choices"] if c["index"] == index]


def streamed_calls(chunks: list[dict[str, Any]], index: int = 0) -> list[dict[str, Any]]:
    """Check one choice's stream against the streamed tool-call shape; return its calls.

    Role frame first, then deltas, then one terminal ``delta: {}`` with the
    finish reason. The first delta of each call carries index, id, type, name
    and ``arguments: ""``; later ones only index and a non-empty fragment.
    """
    assert len({ch["id"] for ch in chunks}) == 1
    assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"}
    mine = choice_frames(chunks, index)
    assert mine[0]["delta"] == {"role": "assistant"} and mine[0]["finish_reason"] is None
    assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] is not None
    assert all(c["finish_reason"] is None for c in mine[:-1])
    calls: dict[int, dict[str, Any]] = {}
    for c in mine[1:-1]:
        delta = c["delta"]
        assert delta, "empty delta before the terminal chunk"
        assert "role" not in delta
        if "tool_calls" not in delta:
            assert set(delta) in ({"content"}, {"reasoning_content", "reasoning"}), delta
            assert all(isinstance(v, str) and v for v in delta.values())
            continue
        assert set(delta) == {"tool_calls"}, delta
        [tc] = delta["tool_calls"]
        i = tc["index"]
        assert type(i) is int
        if i not in calls:
            assert i == len(calls), "tool-call indexes must be dense and in order"
            assert set(tc) == {"index", "id", "type", "function"}, tc
            assert tc["type"] == "function"
            assert isinstance(tc["id"], str) and tc["id"]
            name = tc["function"]["name"]
            assert isinstance(name, str) and name
            assert tc["function"] == {"name": name, "arguments": ""}
            calls[i] = {"id": tc["id"], "name": name, "arguments": ""}
        else:
            args = tc["function"]["arguments"]
            assert tc == {"index": i, "function": {"arguments": args}}, tc
            assert isinstance(args, str) and args
            assert i == len(calls) - 1, "fragments belong to the latest call"
            calls[i]["arguments"] += args
    return [calls[i] for i in sorted(calls)]


def reasoning_text(chunks: list[dict[str, Any]], index: int = 0) -> str:
    out = []
    for c in choice_frames(chunks, index):
        delta = c["delta"]
        if "reasoning_content" in delta or "reasoning" in delta:
            assert delta["reasoning_content"] == delta["reasoning"]
            out.append(delta["reasoning_content"])
    return "".join(out)


def message_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = message["tool_calls"]
    for call in calls:
        assert call["type"] == "function" and isinstance(call["id"], str) and call["id"]
        assert isinstance(call["function"]["arguments"], str)
    return [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in calls
    ]


def names_args(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


def no_markup(text: str) -> None:
    for piece in ("<tool", "tool_call", "</", '"name"', "arguments"):
        assert piece not in text, (piece, text)


# -- the shape of a streamed tool call, markup never in content --------------------------

SPLITS: dict[str, list[Any]] = {
    "awkward": ONE_CALL,
    "one token": [b"".join(p for p in ONE_CALL if p is not EOS), EOS],
    "per byte": [bytes([b]) for p in ONE_CALL if p is not EOS for b in p] + [EOS],
}


@pytest.mark.parametrize("split", SPLITS)
def test_streamed_tool_call_shape(tool_server: Server, split: str) -> None:
    body = ask(f"weather in Tokyo ({split})", tools=TOOLS)
    tool_server.script(body, SPLITS[split])
    chunks = tool_server.stream(body)
    calls = streamed_calls(chunks)
    assert names_args(calls) == [("get_weather", {"city": "Tokyo"})]
    assert calls[0]["id"].startswith("call_")
    assert finishes(chunks) == {0: ["tool_calls"]}
    assert chat_text(chunks) == ""  # a reply that only calls a tool has no content
    for c in choice_frames(chunks):
        no_markup(c["delta"].get("content") or "")
    full = tool_server.once(body)
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert names_args(message_calls(choice["message"])) == names_args(calls)


def test_parallel_calls_stream_and_nonstream_agree(tool_server: Server) -> None:
    body = ask("weather and time in Paris", tools=TOOLS)
    tool_server.script(body, TWO_CALLS)
    chunks = tool_server.stream(body)
    calls = streamed_calls(chunks)
    assert names_args(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert len({c["id"] for c in calls}) == 2
    assert finishes(chunks) == {0: ["tool_calls"]}
    assert chat_text(chunks) == ""

    full = tool_server.once(body)
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] is None
    got = message_calls(choice["message"])
    assert names_args(got) == names_args(calls)
    assert [c["arguments"] for c in got] == [c["arguments"] for c in calls]
    assert len({c["id"] for c in got}) == 2


def test_call_cut_by_max_tokens_finishes_with_length(hermes: Server) -> None:
    body = ask("cut the call", tools=TOOLS, max_tokens=4)
    hermes.script(body, ONE_CALL)
    chunks = hermes.stream(body)
    calls = streamed_calls(chunks)
    assert [c["name"] for c in calls] == ["get_weather"]
    assert finishes(chunks) == {0: ["length"]}
    assert chat_text(chunks) == ""
    choice = hermes.once(body)["choices"][0]
    assert choice["finish_reason"] == "length"
    got = message_calls(choice["message"])
    assert [(c["name"], c["arguments"]) for c in got] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_content_before_a_call_is_content(tool_server: Server) -> None:
    body = ask("check first", tools=TOOLS)
    tool_server.script(body, [b"Let me", b" check.", b"\n<", b"tool", *ONE_CALL[1:]])
    chunks = tool_server.stream(body)
    calls = streamed_calls(chunks)
    assert names_args(calls) == [("get_weather", {"city": "Tokyo"})]
    assert chat_text(chunks) == "Let me check."
    for c in choice_frames(chunks):
        no_markup(c["delta"].get("content") or "")
    # The content comes before the call, and no chunk mixes the two.
    kinds = [next(iter(c["delta"])) for c in choice_frames(chunks)[1:-1]]
    assert kinds == sorted(kinds, key=lambda k: k != "content") and "content" in kinds
    assert finishes(chunks) == {0: ["tool_calls"]}
    message = tool_server.once(body)["choices"][0]["message"]
    assert message["content"] == "Let me check."
    assert names_args(message_calls(message)) == names_args(calls)


def test_almost_markup_stays_content(tool_server: Server) -> None:
    # A held-back "<tool" that never becomes the tag is released, not lost.
    body = ask("not a call", tools=TOOLS)
    tool_server.script(body, [b"a <to", b"ol> b <tool_", b"x", EOS])
    chunks = tool_server.stream(body)
    assert streamed_calls(chunks) == []
    assert chat_text(chunks) == "a <tool> b <tool_x"
    assert finishes(chunks) == {0: ["stop"]}


def test_n2_each_choice_has_its_own_calls(hermes: Server) -> None:
    body = ask("two choices", tools=TOOLS, n=2)
    hermes.script(body, TWO_CALLS)
    chunks = hermes.stream(body)
    assert all(len(ch["choices"]) == 1 for ch in chunks)
    assert {c["index"] for ch in chunks for c in ch["choices"]} == {0, 1}
    per_choice = [streamed_calls(chunks, i) for i in (0, 1)]
    for calls in per_choice:
        assert names_args(calls) == [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {"tz": "Europe/Paris"}),
        ]
    ids = [c["id"] for calls in per_choice for c in calls]
    assert len(set(ids)) == 4
    assert finishes(chunks) == {0: ["tool_calls"], 1: ["tool_calls"]}

    full = hermes.once(body)
    assert [c["index"] for c in full["choices"]] == [0, 1]
    ids = []
    for choice in full["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        got = message_calls(choice["message"])
        assert [c["name"] for c in got] == ["get_weather", "get_time"]
        ids += [c["id"] for c in got]
    assert len(set(ids)) == 4


# -- tool_choice ---------------------------------------------------------------------------


def test_tool_choice_auto_is_a_lazy_grammar(tool_server: Server) -> None:
    body = ask("auto choice", tools=TOOLS, tool_choice="auto")
    prompt = tool_server.prompt(body)
    params = tool_server.last_params()
    assert params.grammar and re.search(r"^start: ", params.grammar, re.MULTILINE)
    # One pattern, for llama.cpp's full-buffer regex_match: engages at the call tag
    # wherever it appears, and the grammar starts at the tag (the capture group).
    (trigger,) = params.grammar_triggers
    rx = re.compile(trigger)
    for text in ("<tool_call>", 'Sure, let me check. <tool_call>\n{"na'):
        m = rx.fullmatch(text)
        assert m is not None and text[m.start(1) :].startswith("<tool_call>")
    assert rx.fullmatch("Sure, let me check. <tool_") is None
    assert "get_weather" in params.grammar and "get_time" in params.grammar
    assert "get_weather" in prompt and "get_time" in prompt
    # No tool_choice with tools is "auto" too.
    tool_server.prompt(ask("auto choice", tools=TOOLS))
    assert tool_server.last_params().grammar_triggers == params.grammar_triggers


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_forcing_is_a_grammar_from_the_start(tool_server: Server, choice: str) -> None:
    tool_choice: Any = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    body = ask(f"forced {choice}", tools=TOOLS, tool_choice=tool_choice)
    tool_server.script(
        body, [b'<tool_call>\n{"name": "get_time", "arguments": {}}', b"\n</tool_call>", EOS]
    )
    chunks = tool_server.stream(body)
    params = tool_server.last_params()
    assert params.grammar and re.search(r"^start: ", params.grammar, re.MULTILINE)
    assert params.grammar_triggers == ()  # constrained from the first token
    assert "get_time" in params.grammar
    assert ("get_weather" in params.grammar) is (choice == "required")
    assert names_args(streamed_calls(chunks)) == [("get_time", {})]
    assert finishes(chunks) == {0: ["tool_calls"]}


def test_tool_choice_none(tool_server: Server) -> None:
    body = ask("no tools now", tools=TOOLS, tool_choice="none")
    markup = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    prompt = tool_server.script(body, [markup[:7].encode(), markup[7:].encode(), EOS])
    params = tool_server.last_params()
    assert params.grammar is None and params.grammar_triggers == ()
    assert "get_weather" not in prompt and "get_time" not in prompt
    chunks = tool_server.stream(body)
    assert streamed_calls(chunks) == []
    assert chat_text(chunks) == markup
    assert finishes(chunks) == {0: ["stop"]}
    message = tool_server.once(body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": markup}


def test_no_tools_no_grammar(tool_server: Server) -> None:
    tool_server.prompt(ask("plain"))
    params = tool_server.last_params()
    assert params.grammar is None and params.grammar_triggers == ()


def test_generic_prompt_describes_the_tools(generic: Server) -> None:
    body = ask("describe", tools=TOOLS, tool_choice="required")
    prompt = generic.prompt(body)
    assert prompt.startswith("<|im_start|>system\n")
    system = prompt.split("<|im_end|>", 1)[0]
    for tool in TOOLS:
        assert tool["function"]["name"] in system
        assert tool["function"]["description"] in system
    assert "get_weather(city: string) - Get weather for a city" in system  # a signature
    assert "<tool_call>" in system and "at least one" in system
    # An existing system message is kept, with the tool prompt after it.
    prompt = generic.prompt(
        {**body, "messages": [{"role": "system", "content": "Be brief."}, *body["messages"]]}
    )
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call")
    assert prompt.count("<|im_start|>system") == 1


def test_hermes_template_gets_the_tools(hermes: Server) -> None:
    prompt = hermes.prompt(ask("native", tools=TOOLS))
    assert prompt.startswith("<|im_start|>system\nTools: get_weather get_time.\n")
    assert "You can call" not in prompt  # no generic system prompt on top


# -- response_format -----------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
}


def test_response_format_json_schema(tool_server: Server) -> None:
    body = ask(
        "structured",
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    tool_server.script(body, [b'{"ans', b'wer": 4', b"2}", EOS])
    chunks = tool_server.stream(body)
    params = tool_server.last_params()
    assert params.grammar and re.search(r"^start: ", params.grammar, re.MULTILINE)
    assert "answer" in params.grammar
    assert params.grammar_triggers == ()
    assert json.loads(chat_text(chunks)) == {"answer": 42}
    assert finishes(chunks) == {0: ["stop"]}
    tool_server.once(body)
    assert tool_server.last_params().grammar == params.grammar


def test_response_format_json_object(hermes: Server) -> None:
    hermes.prompt(ask("any object", response_format={"type": "json_object"}))
    params = hermes.last_params()
    assert params.grammar and re.search(r"^start: ", params.grammar, re.MULTILINE)
    assert params.grammar_triggers == ()
    hermes.prompt(ask("any object", response_format={"type": "text"}))
    assert hermes.last_params().grammar is None


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {
                        "type": "object",
                        "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                        "required": ["n"],
                    },
                },
            },
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
            "response_format.json_schema",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ],
    ids=["unknown type", "empty range", "not an object", "unknown format"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_response_format_is_400(
    hermes: Server, response_format: dict[str, Any], param: str, stream: bool
) -> None:
    before = len(hermes.runner.samplers)
    r = httpx.post(
        hermes.base + CHAT,
        json=ask("bad schema", response_format=response_format, stream=stream),
        timeout=20,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert "response_format" in err["message"]
    assert len(hermes.runner.samplers) == before  # nothing reached the model


# -- reasoning: split from content, never a call, before a call -------------------------


def test_reasoning_split_across_tokens(qwen3: Server) -> None:
    body = ask("think first")
    qwen3.script(
        body, [b"<th", b"ink>Let me", b" think</th", b"ink>\n\nThe answer", b" is 4.", EOS]
    )
    chunks = qwen3.stream(body)
    assert streamed_calls(chunks) == []
    assert reasoning_text(chunks) == "Let me think"
    assert chat_text(chunks) == "The answer is 4."
    for c in choice_frames(chunks):
        assert "think>" not in json.dumps(c["delta"])
    assert finishes(chunks) == {0: ["stop"]}
    message = qwen3.once(body)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "The answer is 4.",
        "reasoning_content": "Let me think",
        "reasoning": "Let me think",
    }


def test_tool_call_inside_reasoning_is_not_a_call(qwen3: Server) -> None:
    body = ask("think about calling", tools=TOOLS)
    inner = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    qwen3.script(
        body,
        [
            b"<think>maybe ",
            inner[:6].encode(),
            inner[6:].encode(),
            b"</think>",
            b"No call needed.",
            EOS,
        ],
    )
    chunks = qwen3.stream(body)
    assert streamed_calls(chunks) == []
    assert reasoning_text(chunks) == "maybe " + inner
    assert chat_text(chunks) == "No call needed."
    assert finishes(chunks) == {0: ["stop"]}
    choice = qwen3.once(body)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "No call needed."


def test_reasoning_then_a_call(qwen3: Server) -> None:
    body = ask("think then call", tools=TOOLS)
    qwen3.script(body, [b"<think>\nI need the weather.\n</think>\n\n", *ONE_CALL])
    chunks = qwen3.stream(body)
    calls = streamed_calls(chunks)
    assert names_args(calls) == [("get_weather", {"city": "Tokyo"})]
    assert reasoning_text(chunks) == "\nI need the weather.\n"
    assert chat_text(chunks) == ""
    assert finishes(chunks) == {0: ["tool_calls"]}
    message = qwen3.once(body)["choices"][0]["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == message["reasoning"] == "\nI need the weather.\n"
    assert names_args(message_calls(message)) == names_args(calls)


@pytest.mark.parametrize("redundant", [False, True])
def test_template_opened_think_block(r1: Server, redundant: bool) -> None:
    body = ask(f"opened {redundant}")
    start = [b"<thi", b"nk>\n"] if redundant else []
    prompt = r1.script(body, [*start, b"I should", b" add.</th", b"ink>\n\n", b"4", EOS])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    chunks = r1.stream(body)
    # A start tag written again is reasoning text, as llama.cpp reads it.
    again = "<think>\n" if redundant else ""
    assert reasoning_text(chunks).strip() == f"{again}I should add."
    assert chat_text(chunks) == "4"
    assert finishes(chunks) == {0: ["stop"]}
    message = r1.once(body)["choices"][0]["message"]
    assert message["content"] == "4"
    assert message["reasoning_content"].strip() == f"{again}I should add."


def test_opened_think_cut_by_max_tokens(r1: Server) -> None:
    body = ask("long thought", max_tokens=2)
    r1.script(body, [b"hmm", b" still", b" thinking", b"</think>", b"late", EOS])
    chunks = r1.stream(body)
    assert reasoning_text(chunks) == "hmm still"
    assert chat_text(chunks) == ""
    assert finishes(chunks) == {0: ["length"]}


@pytest.mark.parametrize("how", ["json_schema", "required"])
def test_a_grammar_from_the_start_comes_after_an_opened_think_block(r1: Server, how: str) -> None:
    # The prompt opened <think>: the grammar lets the model reason and close the block,
    # then constrains the answer (or the call); without a think block llama.cpp's way.
    if how == "json_schema":
        body = ask(
            "opened json",
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        )
        items: list[Any] = [b"Four.</think>\n", b'{"answer"', b": 4}", EOS]
    else:
        body = ask("opened call", tools=TOOLS, tool_choice="required")
        items = [b"Weather.</think>\n", *ONE_CALL]
    prompt = r1.script(body, items)
    assert prompt.endswith("<think>\n")
    chunks = r1.stream(body)
    grammar = r1.last_params().grammar
    assert grammar and r1.last_params().grammar_triggers == ()
    assert grammar.startswith("start: thinking WS answer")
    assert 'thinking[stop="</think>"]' in grammar
    calls = streamed_calls(chunks)
    message = r1.once(body)["choices"][0]["message"]
    assert reasoning_text(chunks) == message["reasoning_content"]
    assert reasoning_text(chunks).strip() in ("Four.", "Weather.")
    if how == "json_schema":
        assert json.loads(chat_text(chunks)) == json.loads(message["content"]) == {"answer": 4}
        assert finishes(chunks) == {0: ["stop"]}
    else:
        assert names_args(calls) == [("get_weather", {"city": "Tokyo"})]
        assert names_args(message_calls(message)) == names_args(calls)
        assert finishes(chunks) == {0: ["tool_calls"]}


def test_chat_template_kwargs_reach_the_template(qwen3: Server) -> None:
    on = qwen3.prompt(ask("thinking switch"))
    assert on.endswith("<|im_start|>assistant\n")
    body = ask("thinking switch", chat_template_kwargs={"enable_thinking": False})
    off = qwen3.script(body, [b"Plain", b" answer.", EOS])
    assert off == on + "<think>\n\n</think>\n\n"
    chunks = qwen3.stream(body)
    assert reasoning_text(chunks) == ""
    assert chat_text(chunks) == "Plain answer."
    message = qwen3.once(body)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Plain answer."}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_fields_sent_back_are_accepted(qwen3: Server, field: str) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", field: "simple sum"},
            {"role": "user", "content": "and 3+3?"},
        ]
    }
    prompt = qwen3.prompt(body)
    assert "<|im_start|>assistant\n[reasoning: simple sum]4<|im_end|>" in prompt


# -- agent histories (calls and tool results sent back) -----------------------------------

AGENT_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "system", "content": "Use metric units."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    {"role": "assistant", "content": "It is 18C and sunny.", "tool_calls": []},
    {"role": "user", "content": "Thanks!"},
]
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_agent_history_is_accepted(tool_server: Server) -> None:
    body = {"messages": AGENT_HISTORY, "tools": TOOLS}
    prompt = tool_server.script(body, [b"You're", b" welcome.", EOS])
    chunks = tool_server.stream(body)
    assert chat_text(chunks) == "You're welcome."
    assert finishes(chunks) == {0: ["stop"]}
    # The JSON-string arguments reached the prompt as the call object, not a quoted string.
    assert PARIS_CALL in prompt
    assert "18C and sunny" in prompt and "Use metric units." in prompt
    assert prompt.index("Weather in Paris?") < prompt.index("Use metric units.")
    # Without tools offered, the same history is still fine.
    assert tool_server.once({"messages": AGENT_HISTORY})["choices"][0]["finish_reason"]


def test_generic_history_is_rendered_as_text(generic: Server) -> None:
    prompt = generic.prompt({"messages": AGENT_HISTORY, "tools": TOOLS})
    assert "<|im_start|>assistant\n" + PARIS_CALL + "<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\n18C and sunny\n</tool_response><|im_end|>" in prompt
    assert "<|im_start|>tool" not in prompt
    assert "get_weather" in prompt.split("<|im_end|>", 1)[0]  # the tool system prompt


def test_hermes_history_keeps_roles(hermes: Server) -> None:
    prompt = hermes.prompt({"messages": AGENT_HISTORY, "tools": TOOLS})
    assert "<|im_start|>assistant\n" + PARIS_CALL + "<|im_end|>" in prompt
    assert "<|im_start|>tool\n18C and sunny [for call_1]<|im_end|>" in prompt


# -- the official client -------------------------------------------------------------------


def test_openai_sdk_reads_tool_calls(hermes: Server) -> None:
    body = ask("sdk tools", tools=TOOLS)
    hermes.script(body, TWO_CALLS)
    client = OpenAI(base_url=hermes.base + "/v1", api_key="not-needed", max_retries=0)
    stream = client.chat.completions.create(
        model="local-model", messages=body["messages"], tools=TOOLS, stream=True
    )
    acc: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        choice = chunk.choices[0]
        for tc in choice.delta.tool_calls or []:
            call = acc.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"]
    assert sorted(acc) == [0, 1]
    assert [(acc[i]["name"], json.loads(acc[i]["arguments"])) for i in (0, 1)] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert acc[0]["id"] != acc[1]["id"]

    completion = client.chat.completions.create(
        model="local-model", messages=body["messages"], tools=TOOLS
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert message.content is None and message.tool_calls is not None
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert message.tool_calls[1].function.name == "get_time"
