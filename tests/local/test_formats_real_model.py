"""Required and named calls on a real GGUF (the embedded SmolLM2) given each family's own
chat template, as a new user sends them: the template's default thinking, temperature
0.7, max_tokens 200, the first seed. The grammar writes the call in that family's
syntax, and the family's parser reads it back into the same tool call on the OpenAI
dialect: a name among the tools, arguments valid under the schema, no markup in the
content. Families whose generation prompt opens a reasoning block (Qwen3.5, MiniMax-M2,
Nemotron 3 Nano, GLM-4.7): a 135M model never closes it, so the forced call's default
reasoning budget closes it and the call follows within max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
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
    "Qwen3.5-4B",
    "MiniMax-M2",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "GLM-4.7-Flash",
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


def _valid(call: Any, family: str) -> dict[str, Any]:
    """The call's arguments, checked against its tool's schema."""
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args  # type: ignore[no-any-return]


def _ask(base: str, family: str, choice: Any, parallel: bool | None) -> Any:
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    return client.chat.completions.create(  # type: ignore[call-overload]
        model=family,
        messages=[{"role": "user", "content": "What is the weather and the time in Paris?"}],
        tools=TOOLS,
        tool_choice=choice,
        temperature=0.7,
        seed=1,
        max_tokens=200,
        **extra,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_required_and_named_calls_in_the_family_s_syntax(base: str, family: str) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = _ask(base, family, choice, parallel=False).choices[0]
        assert out.finish_reason == "tool_calls", (family, choice, out.message)
        calls = out.message.tool_calls or []
        assert len(calls) == 1, (family, calls)
        _valid(calls[0], family)
        if isinstance(choice, dict):
            assert calls[0].function.name == "get_time"
        assert not (out.message.content or "").strip(), (family, out.message.content)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tools_required_give_separately_parsed_calls(base: str, family: str) -> None:
    # OpenAI's default parallel calls: at most one per tool offered.
    out = _ask(base, family, "required", parallel=None).choices[0]
    assert out.finish_reason == "tool_calls", (family, out.message)
    calls = out.message.tool_calls or []
    assert 1 <= len(calls) <= 2, (family, calls)
    for call in calls:
        _valid(call, family)
    assert len({c.id for c in calls}) == len(calls)
    assert not (out.message.content or "").strip(), (family, out.message.content)
