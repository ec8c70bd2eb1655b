"""Reasoning budgets on real weights through the official SDKs: SmolLM2 with Qwen3.5's
template, whose generation prompt opens a reasoning block that a 135M model never
closes by itself. Each dialect's budget closes it (the family's end marker, forced),
an answer follows, and usage counts the reasoning tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from google import genai
from google.genai import types
from openai import OpenAI

from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

MODEL = "thinker"
LOW = 48  # the effort table's "low", set for this server
# "</think>" in SmolLM2's vocabulary, and a token of slack for a marker split by the
# token before it.
CLOSER_MAX = 6
QUESTION = "Tell me a long story about a dragon and a knight."


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("budgets")
    (folder / "models.toml").write_text(
        f'[[models]]\nname = "{MODEL}"\nsource = "smollm2"\nchat_template = "Qwen3.5-4B"\n'
        "parallel = 1\nctx = 2048\n"
    )
    with serve_process(
        "--config",
        str(folder / "models.toml"),
        "--reasoning-efforts",
        f"none=0,low={LOW},high=4096",
        *QUIET,
    ) as url:
        yield url


def within(tokens: int, budget: int) -> None:
    assert budget <= tokens <= budget + CLOSER_MAX, (tokens, budget)


def test_anthropic_budget_tokens(base: str) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    message = client.messages.create(
        model=MODEL,
        max_tokens=160,
        thinking={"type": "enabled", "budget_tokens": 64},
        messages=[{"role": "user", "content": QUESTION}],
        # Greedy: at the default temperature of 1 the 135M model ends its turn right after
        # the forced closer in about 1 request of 70 (3 of 200 measured), an empty answer.
        extra_body={"temperature": 0},
    )
    kinds = [b.type for b in message.content]
    assert kinds[0] == "thinking" and "text" in kinds, kinds
    thinking: Any = message.content[0]
    assert "</think>" not in thinking.thinking and thinking.thinking.strip()
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text.strip() and "<think>" not in text and "</think>" not in text
    # The thinking is at most the budget: counted back with the server's own tokenizer.
    counted = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": thinking.thinking}]
    ).input_tokens
    empty = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": ""}]
    ).input_tokens
    assert counted - empty <= 64 + 1, (counted, empty)


def test_gemini_thinking_budget(base: str) -> None:
    client = genai.Client(
        api_key="x", http_options=types.HttpOptions(base_url=base, api_version="v1beta")
    )
    config = types.GenerateContentConfig(
        max_output_tokens=120,
        temperature=0,
        thinking_config=types.ThinkingConfig(thinking_budget=32, include_thoughts=True),
    )
    out = client.models.generate_content(model=MODEL, contents=QUESTION, config=config)
    assert out.candidates and out.candidates[0].content and out.candidates[0].content.parts
    parts = out.candidates[0].content.parts
    assert parts[0].thought and any(p.text and not p.thought for p in parts)
    usage = out.usage_metadata
    assert usage is not None and usage.thoughts_token_count is not None
    within(usage.thoughts_token_count, 32)
    assert usage.candidates_token_count and usage.total_token_count == (
        (usage.prompt_token_count or 0) + usage.candidates_token_count + usage.thoughts_token_count
    )
    # thinkingBudget 0: no thinking at all.
    off = types.GenerateContentConfig(
        max_output_tokens=24,
        temperature=0,
        thinking_config=types.ThinkingConfig(thinking_budget=0, include_thoughts=True),
    )
    out = client.models.generate_content(model=MODEL, contents=QUESTION, config=off)
    assert out.candidates and out.candidates[0].content and out.candidates[0].content.parts
    assert not any(p.thought for p in out.candidates[0].content.parts)
    assert out.usage_metadata is not None and not out.usage_metadata.thoughts_token_count
    assert out.text and out.text.strip()


def test_openai_reasoning_effort_through_the_table(base: str) -> None:
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        reasoning_effort="low",
        max_tokens=120,
        temperature=0,
    )
    message: Any = done.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content")
    assert message.content and message.content.strip()
    assert done.usage and done.usage.completion_tokens_details
    reasoning = done.usage.completion_tokens_details.reasoning_tokens or 0
    within(reasoning, LOW)
    # The same through the Responses API (the story runs on to max_output_tokens).
    response = client.responses.create(
        model=MODEL, input=QUESTION, reasoning={"effort": "low"}, max_output_tokens=120
    )
    assert response.usage and response.usage.output_tokens_details
    within(response.usage.output_tokens_details.reasoning_tokens, LOW)
    assert response.output_text.strip()
    # An effort the table does not have is a 400 that names the field.
    with pytest.raises(Exception) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            reasoning_effort="medium",
            max_tokens=8,
        )
    assert "reasoning_effort" in str(err.value) and "400" in str(err.value)


def test_a_budget_closes_the_block_before_a_json_answer(base: str) -> None:
    """The grammar takes the forced closer as the end of its reasoning part: the answer
    is the schema's, and the budget is llama-server's per-request field."""
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    }
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        max_tokens=80,
        temperature=0.7,
        seed=3,
        extra_body={"thinking_budget_tokens": 16},
    )
    out: Any = done.choices[0]
    assert out.finish_reason == "stop", out.message
    assert json.loads(out.message.content)["city"] in ("Paris", "Rome")
    assert done.usage and done.usage.completion_tokens_details
    within(done.usage.completion_tokens_details.reasoning_tokens or 0, 16)
