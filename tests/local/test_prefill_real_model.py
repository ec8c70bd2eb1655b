"""A final assistant message continued on real weights: Anthropic's prefill, Ollama's,
and OpenAI-compatible servers' ``continue_final_message`` (what sluice's own failover
asks of a replica that is another sluice).

The property every dialect must have: greedy, the continuation of an answer's first
tokens is the rest of that answer, and the answer holds only what follows them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import pytest
from openai import OpenAI

from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

QUESTION: list[Any] = [{"role": "user", "content": "Tell me a story about a dragon."}]


def agrees(rest: str, text: str, head: str) -> None:
    """The continuation is the answer's rest (each may run on past the other's end)."""
    short, long = sorted((rest, text), key=len)
    assert long.startswith(short) and len(short) >= 20, (head, rest, text)


@pytest.fixture(scope="module")
def openai_client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def split(openai_client: OpenAI, model_id: str) -> tuple[str, str, int]:
    """A greedy answer cut after its 8th token (where no space ends it): the part before
    the cut, the rest, and the plain prompt's token count."""
    stream = openai_client.chat.completions.create(
        model=model_id,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    prompt = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            prompt = chunk.usage.prompt_tokens
    cut = next(i for i in range(8, len(pieces)) if not pieces[i - 1][-1:].isspace())
    head, rest = "".join(pieces[:cut]), "".join(pieces[cut:])
    assert head.strip() and rest.strip() and not head[-1].isspace()
    return head, rest, prompt


def after(client: OpenAI, model: str, head: str, tokens: int, extra: dict[str, Any] | None) -> Any:
    """The question, ``head`` as the assistant's message, greedy."""
    return client.chat.completions.create(
        model=model,
        messages=[*QUESTION, {"role": "assistant", "content": head}],
        max_tokens=tokens,
        temperature=0,
        extra_body=extra,
    )


def test_openai_continue_final_message(
    openai_client: OpenAI, model_id: str, split: tuple[str, str, int]
) -> None:
    head, rest, prompt = split
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    done = after(openai_client, model_id, head, 24, flags)
    text = done.choices[0].message.content or ""
    agrees(rest, text, head)
    # The prompt is the question's and the beginning, with no end of turn between them.
    assert done.usage is not None
    assert prompt + 4 <= done.usage.prompt_tokens <= prompt + 12, (prompt, done.usage)


def test_openai_without_the_flag_starts_a_new_turn(
    openai_client: OpenAI, model_id: str, split: tuple[str, str, int]
) -> None:
    head, rest, _ = split
    done = after(openai_client, model_id, head, 12, None)
    assert not rest.startswith(done.choices[0].message.content or "")


def test_openai_continuation_errors(base: str, model_id: str) -> None:
    def post(**extra: Any) -> httpx.Response:
        body = {"model": model_id, "messages": QUESTION, "max_tokens": 4} | extra
        return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)

    nothing = post(continue_final_message=True)
    assert nothing.status_code == 400
    assert nothing.json()["error"]["param"] == "continue_final_message"
    both = post(
        messages=[*QUESTION, {"role": "assistant", "content": "Once"}],
        continue_final_message=True,
        add_generation_prompt=True,
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "add_generation_prompt"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = post(
        messages=[*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}],
        continue_final_message=True,
    )
    assert called.status_code == 400 and "tool calls" in called.json()["error"]["message"]
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    shaped = post(
        messages=[*QUESTION, {"role": "assistant", "content": "{"}],
        continue_final_message=True,
        response_format=schema,
    )
    assert shaped.status_code == 400 and "response format" in shaped.json()["error"]["message"]


def test_anthropic_prefill(base: str, model_id: str, split: tuple[str, str, int]) -> None:
    head, rest, _ = split
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    messages: Any = [*QUESTION, {"role": "assistant", "content": head}]
    message = client.messages.create(
        model=model_id, max_tokens=24, messages=messages, extra_body={"temperature": 0}
    )
    text = "".join(b.text for b in message.content if b.type == "text")
    agrees(rest, text, head)
    # count_tokens counts the prompt the prefill ends.
    counted = client.messages.count_tokens(model=model_id, messages=messages).input_tokens
    plain = client.messages.count_tokens(model=model_id, messages=QUESTION).input_tokens
    assert plain < counted
    # Content blocks as the prefill work the same.
    blocks: Any = [*QUESTION, {"role": "assistant", "content": [{"type": "text", "text": head}]}]
    again = client.messages.create(
        model=model_id, max_tokens=24, messages=blocks, extra_body={"temperature": 0}
    )
    assert "".join(b.text for b in again.content if b.type == "text") == text


def test_ollama_prefill(base: str, model_id: str, split: tuple[str, str, int]) -> None:
    head, rest, _ = split
    client = ollama.Client(host=base)
    answer = client.chat(
        model=model_id,
        messages=[*QUESTION, {"role": "assistant", "content": head}],
        options={"temperature": 0, "num_predict": 24},
    )
    text = answer.message.content or ""
    agrees(rest, text, head)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SmolLM2 with Qwen3.5's template, whose generation prompt opens a reasoning block."""
    folder: Path = tmp_path_factory.mktemp("prefill")
    (folder / "models.toml").write_text(
        '[[models]]\nname = "thinker"\nsource = "smollm2"\nchat_template = "Qwen3.5-4B"\n'
        "parallel = 1\nctx = 2048\n"
    )
    with serve_process("--config", str(folder / "models.toml"), *QUIET) as url:
        yield url


def test_a_continuation_inside_the_reasoning_or_after_it(thinker: str) -> None:
    client = OpenAI(base_url=f"{thinker}/v1", api_key="x", max_retries=0)

    def go(final: dict[str, Any]) -> Any:
        messages: list[Any] = [*QUESTION, {"role": "assistant", **final}]
        return client.chat.completions.create(
            model="thinker",
            messages=messages,
            max_tokens=40,
            temperature=0,
            extra_body={"continue_final_message": True, "thinking_budget_tokens": 16},
        )

    # Reasoning begun, no text yet: the model goes on reasoning (closed by the budget),
    # then answers.
    thinking = go({"content": "", "reasoning_content": "The user wants a dragon story. I"})
    message: Any = thinking.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content")
    assert thinking.usage and thinking.usage.completion_tokens_details
    assert 16 <= (thinking.usage.completion_tokens_details.reasoning_tokens or 0) <= 22
    # Text begun: the reasoning is closed in the prompt, and the answer is text only.
    answering = go({"content": "Once upon a time", "reasoning_content": "A story, then."})
    message = answering.choices[0].message
    assert not (message.model_extra or {}).get("reasoning_content")
    assert message.content and "</think>" not in message.content
    assert answering.usage and answering.usage.completion_tokens_details
    assert not answering.usage.completion_tokens_details.reasoning_tokens
