"""The replay model: recorded answers through the real engine, template, parsers and
dialects, with the official OpenAI SDK as the client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sluice.config import Settings
from sluice.server.app import create_app
from tests.support.servers import serve_app

CALL = (
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("replay")
    answers = [
        {"when": "weather in Paris", "output": CALL},
        {"when": "think first", "output": "<think>\nHmm.\n</think>\n\nFine."},
        {"when": "count", "output": "one two three four five six seven eight nine ten"},
    ]
    (folder / "answers.jsonl").write_text("\n".join(json.dumps(a) for a in answers) + "\n")
    (folder / "models.toml").write_text(
        '[[models]]\nname = "agent-ci"\nsource = "replay:answers.jsonl"\n'
        'chat_template = "Qwen3-Coder.jinja"\n'
        '[[models]]\nname = "thinker"\nsource = "replay:answers.jsonl"\n'
        'chat_template = "Qwen-Qwen3-0.6B"\n'
    )
    settings = Settings(
        model="agent-ci", config=str(folder / "models.toml"), store=str(folder / "s.db")
    )
    with serve_app(create_app(settings)) as url:
        yield url


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


def test_a_recorded_tool_call_comes_back_as_a_call(base: str) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    done = client(base).chat.completions.create(model="agent-ci", messages=messages, tools=TOOLS)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "").strip() == "Let me check."
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.completion_tokens > 5

    stream = client(base).chat.completions.create(
        model="agent-ci", messages=messages, tools=TOOLS, stream=True
    )
    text, args, names = "", "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                args += (tc.function.arguments or "") if tc.function else ""
            assert "<" not in (c.delta.content or "")
    assert text.strip() == "Let me check." and names == ["get_weather"]
    assert json.loads(args) == {"city": "Paris", "days": 3}


def test_reasoning_max_tokens_and_stop_strings(base: str) -> None:
    c = client(base)
    done = c.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "think first"}]
    )
    message: Any = done.choices[0].message
    assert message.content.strip() == "Fine."
    assert message.model_extra["reasoning_content"].strip() == "Hmm."
    cut = c.chat.completions.create(
        model="agent-ci", messages=[{"role": "user", "content": "count"}], max_tokens=4
    )
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage is not None and cut.usage.completion_tokens == 4
    stopped = c.chat.completions.create(
        model="agent-ci", messages=[{"role": "user", "content": "count"}], stop=[" four"]
    )
    assert stopped.choices[0].message.content == "one two three"


def test_a_prompt_nothing_recorded_answers_is_a_400(base: str) -> None:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "agent-ci", "messages": [{"role": "user", "content": "unheard of"}]},
    )
    assert r.status_code == 400
    assert "no recorded answer" in r.json()["error"]["message"]
    listed = httpx.get(f"{base}/v1/models").json()["data"]
    assert {"agent-ci", "thinker"} <= {m["id"] for m in listed}
