"""The RAM prompt cache on the real model: a long prompt re-sent after other requests
have used every slot is restored from RAM, and answers exactly as before."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration

LONG = " ".join(f"Fact {i}: the number {i} comes right after {i - 1}." for i in range(1, 86))


def ask(client: OpenAI, content: str, max_tokens: int) -> tuple[str, int, int]:
    """(text, prompt tokens, cached tokens) of a greedy answer."""
    r = client.chat.completions.create(
        model="local-model",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens or 0
    return r.choices[0].message.content or "", r.usage.prompt_tokens, cached


def test_long_prompt_restored_after_every_slot_was_reused(client: OpenAI, base: str) -> None:
    _, n_prompt, _ = ask(client, LONG + "\nWhich number comes after 41?", 24)
    assert 1300 <= n_prompt <= 1900, n_prompt  # ~1500 tokens, inside --ctx 2048
    # The reference answer: the same prompt from its slot's cache, so its last prompt
    # token is decoded alone, as after a restore. (The cold answer above decoded it in
    # a chunk of hundreds: llama.cpp's kernels round differently by batch size, which
    # can flip a near-tie at temperature 0 with or without any cache.)
    first, _, from_slot = ask(client, LONG + "\nWhich number comes after 41?", 24)
    assert from_slot == n_prompt - 1
    # 8 other prompts, 4 at a time: each wave takes all 4 slots (--parallel 4), so no
    # slot keeps the long prompt's KV cache.
    others = [f"Write one short sentence about the colour number {i}." for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: ask(client, p, 8), others))
    before = httpx.get(f"{base}/health", timeout=5).json()
    model = before["model"]
    restores = before["models"][model]["prompt_cache"]["restores"]
    again, n_again, cached = ask(client, LONG + "\nWhich number comes after 41?", 24)
    assert n_again == n_prompt
    assert cached >= 0.9 * n_prompt, (cached, n_prompt)
    # The restored KV state is the one the prefill computed: the same greedy text.
    assert again == first
    after = httpx.get(f"{base}/health", timeout=5).json()
    assert after["models"][model]["prompt_cache"]["restores"] == restores + 1
