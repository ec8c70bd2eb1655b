"""``GET /v1/usage`` on the real SmolLM2: 200 mixed requests through the official SDKs of
four dialects (OpenAI, Anthropic, Ollama, Gemini; streamed and not), each dialect with a
key of its own. The ledger's totals per key equal the sum of the ``usage`` each client
was sent (requests, prompt, cached and completion tokens), and so they stay after a
restart on the same store."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from google import genai
from google.genai import types

from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

KEYS = {
    "admin": "sk-admin-usage-01",
    "oai": "sk-openai-usage-1",
    "claude": "sk-claude-usage-1",
    "llama": "sk-ollama-usage-1",
    "gemini": "sk-gemini-usage-1",
}
PROMPTS = ["Hi", "Name a colour.", "Say one word.", "Count to three.", "Hi"]
EACH = 50  # requests per dialect: 200 in all


def _openai(base: str, i: int) -> Counter[str]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS["oai"], max_retries=0)
    messages: Any = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    if i % 2:
        usage = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=3
        ).usage
    else:
        stream = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [c for c in stream if c.usage is not None][-1].usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return Counter(
        requests=1,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=cached or 0,
        completion_tokens=usage.completion_tokens,
    )


def _anthropic(base: str, i: int) -> Counter[str]:
    client = anthropic.Anthropic(base_url=base, api_key=KEYS["claude"], max_retries=0)
    messages: Any = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    if i % 2:
        usage = client.messages.create(model="smollm2", max_tokens=3, messages=messages).usage
    else:
        with client.messages.stream(model="smollm2", max_tokens=3, messages=messages) as s:
            usage = s.get_final_message().usage
    read = usage.cache_read_input_tokens or 0
    written = usage.cache_creation_input_tokens or 0
    return Counter(
        requests=1,
        prompt_tokens=usage.input_tokens + read + written,  # Anthropic's split, summed
        cached_tokens=read,
        completion_tokens=usage.output_tokens,
    )


def _ollama(base: str, i: int) -> Counter[str]:
    client = ollama.Client(host=base, headers={"Authorization": f"Bearer {KEYS['llama']}"})
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    options = {"num_predict": 3}
    if i % 2:
        last = client.chat(model="smollm2", messages=messages, options=options)
    else:
        last = list(client.chat(model="smollm2", messages=messages, options=options, stream=True))[
            -1
        ]
    # Ollama says no cached count: the prompt's tokens and the answer's.
    return Counter(
        requests=1,
        prompt_tokens=last.prompt_eval_count or 0,
        completion_tokens=last.eval_count or 0,
    )


def _gemini(base: str, i: int) -> Counter[str]:
    client = genai.Client(
        api_key=KEYS["gemini"], http_options=types.HttpOptions(base_url=base, api_version="v1beta")
    )
    config = types.GenerateContentConfig(max_output_tokens=3)
    text = PROMPTS[i % len(PROMPTS)]
    if i % 2:
        usage = client.models.generate_content(
            model="smollm2", contents=text, config=config
        ).usage_metadata
    else:
        chunks = list(
            client.models.generate_content_stream(model="smollm2", contents=text, config=config)
        )
        usage = chunks[-1].usage_metadata
    assert usage is not None
    return Counter(
        requests=1,
        prompt_tokens=usage.prompt_token_count or 0,
        cached_tokens=usage.cached_content_token_count or 0,
        completion_tokens=(usage.candidates_token_count or 0) + (usage.thoughts_token_count or 0),
    )


DIALECTS: dict[str, Callable[[str, int], Counter[str]]] = {
    "oai": _openai,
    "claude": _anthropic,
    "llama": _ollama,
    "gemini": _gemini,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("usage")
    conf = tmp / "sluice.toml"
    conf.write_text("[keys]\n" + "".join(f'{n} = "{k}"\n' for n, k in KEYS.items()))
    return conf, tmp / "store.db"


def _ledger(base: str) -> dict[str, dict[str, int]]:
    answer = httpx.get(
        f"{base}/v1/usage", headers={"Authorization": f"Bearer {KEYS['admin']}"}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    per_key: dict[str, Counter[str]] = {}
    for row in answer.json()["data"]:
        assert row["errors"] == 0, row
        counts = per_key.setdefault(row["key"], Counter())
        for field in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens"):
            counts[field] += row[field]
    return {key: dict(counts) for key, counts in per_key.items()}


@pytest.fixture(scope="module")
def served(files: tuple[Path, Path]) -> Iterator[tuple[str, dict[str, dict[str, int]]]]:
    conf, store = files
    with serve_process("--config", str(conf), "--store", str(store), *QUIET) as base:
        jobs = [(name, i) for name in DIALECTS for i in range(EACH)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda job: (job[0], DIALECTS[job[0]](base, job[1])), jobs))
        sent: dict[str, Counter[str]] = {}
        for name, counts in results:
            sent.setdefault(name, Counter()).update(counts)
        yield base, {name: dict(counts) for name, counts in sent.items()}


def test_the_ledger_equals_what_the_clients_were_sent(
    served: tuple[str, dict[str, dict[str, int]]],
) -> None:
    base, sent = served
    ledger = _ledger(base)
    for name in DIALECTS:
        counted = ledger[name]
        assert counted["requests"] == EACH
        assert counted["prompt_tokens"] == sent[name]["prompt_tokens"], name
        assert counted["completion_tokens"] == sent[name]["completion_tokens"], name
        if name != "llama":  # Ollama's answers carry no cached count
            assert counted["cached_tokens"] == sent[name].get("cached_tokens", 0), name
    # The prompts repeat: the prompt cache answered some of them, and the ledger says so.
    assert sum(ledger[name]["cached_tokens"] for name in DIALECTS) > 0
    assert "admin" not in ledger  # reading usage is not a request


def test_the_ledger_survives_a_restart(
    files: tuple[Path, Path], served: tuple[str, dict[str, dict[str, int]]]
) -> None:
    base, _ = served
    before = _ledger(base)
    conf, store = files
    with serve_process("--config", str(conf), "--store", str(store), *QUIET) as again:
        assert _ledger(again) == before
