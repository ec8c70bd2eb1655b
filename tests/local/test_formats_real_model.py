"""Required and named calls on a real GGUF (the embedded SmolLM2) given each family's own
chat template: the grammar writes the call in that family's syntax, and the family's
parser reads it back into the same tool call on the OpenAI dialect.

Families whose generation prompt always opens a reasoning block (MiniMax-M2, GLM-4.7)
are left to the replay tests: a 135M model never closes a block it did not learn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

FAMILIES = [
    "Qwen3-Coder",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "deepseek-ai-DeepSeek-V3.1",
    "deepseek-ai-DeepSeek-V3.2",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "GLM-4.6",
    "MiniMax-M1",
    "ibm-granite-granite-4.0",
    "moonshotai-Kimi-K2",
    "ByteDance-Seed-OSS",
    "openai-gpt-oss-120b",
    "Apertus-8B-Instruct",
    "meetkai-functionary-medium-v3.2",
    "muse-glimmer",
    "LFM2.5-8B-A1B",
    "google-gemma-4-31B-it",
]
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 3},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("formats")
    (folder / "models.toml").write_text(
        "".join(
            f'[[models]]\nname = "{f}"\nsource = "smollm2"\nchat_template = "{f}"\n'
            "parallel = 1\nctx = 2048\n"
            for f in FAMILIES
        )
    )
    with serve_process(
        "--config", str(folder / "models.toml"), "--max-loaded-models", "2", *QUIET
    ) as url:
        yield url


@pytest.mark.parametrize("family", FAMILIES)
def test_required_and_named_calls_in_the_family_s_syntax(base: str, family: str) -> None:
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        done = client.chat.completions.create(
            model=family,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=256,
            # A 135M model never closes a reasoning block the prompt opens: no thinking.
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        out = done.choices[0]
        assert out.finish_reason == "tool_calls", (family, choice, out.message)
        calls = out.message.tool_calls or []
        assert len(calls) == 1, (family, calls)
        call: Any = calls[0]
        args = json.loads(call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        assert args["city"] in ("Paris", "Tokyo"), (family, args)
        if call.function.name == "get_weather":
            assert args["days"] in (1, 2, 3)
        assert not (out.message.content or "").strip(), (family, out.message.content)
