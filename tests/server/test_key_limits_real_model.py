"""Limits per key on the real SmolLM2 through the official SDKs: a key limited to 5
requests a minute gets a 429 with Retry-After in each dialect's shape on its 6th, and the
``openai`` SDK's own retry then succeeds after the wait; one stream at once; a spent
token budget that stays spent across a restart; a model outside a key's list refused as
an unknown model; and the rate-limit headers on every answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

ADMIN = "sk-admin-key-0001"
FIVE = "sk-five-key-00001"
ONE = "sk-one-key-000001"
BUDGET = "sk-budget-key-001"
PICKY = "sk-picky-key-0001"
FREE = "sk-free-key-00001"
HI = [{"role": "user", "content": "Hi"}]


def config(tmp: Path) -> Path:
    path = tmp / "sluice.toml"
    path.write_text(
        "[keys]\n"
        f'admin = "{ADMIN}"\n'
        f'five = {{ key = "{FIVE}", rpm = 5, tpm = 1000000 }}\n'
        f'one = {{ key = "{ONE}", max_streams = 1 }}\n'
        f'budget = {{ key = "{BUDGET}", token_budget = 20, budget_period = "day" }}\n'
        f'picky = {{ key = "{PICKY}", models = ["some-other-model"] }}\n'
        f'free = "{FREE}"\n'
    )
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("limits")
    return config(tmp), tmp / "store.db"


@pytest.fixture(scope="module")
def base(files: tuple[Path, Path]) -> Iterator[str]:
    conf, store = files
    with serve_process("--config", str(conf), "--store", str(store), *QUIET) as url:
        yield url


def oai(base: str, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=retries, timeout=120)


def test_rpm_in_every_dialect_then_the_sdk_retry_waits_it_out(base: str) -> None:
    client = oai(base, FIVE)
    remaining = []
    for _ in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=HI,
            max_tokens=1,  # type: ignore[arg-type]
        )
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        assert raw.headers["x-ratelimit-limit-requests"] == "5"
        assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert remaining == ["4", "3", "2", "1", "0"]
    started = time.monotonic()

    # The 6th, in each dialect's own shape (a refusal counts as no request).
    with pytest.raises(openai.RateLimitError) as oai_refusal:
        client.chat.completions.create(model="smollm2", messages=HI, max_tokens=1)  # type: ignore[arg-type]
    wait = int(oai_refusal.value.response.headers["retry-after"])
    assert 50 <= wait <= 60
    assert oai_refusal.value.code == "rate_limit_exceeded"
    assert oai_refusal.value.type == "requests"

    claude = anthropic.Anthropic(base_url=base, api_key=FIVE, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as ant_refusal:
        claude.messages.create(model="smollm2", max_tokens=1, messages=HI)  # type: ignore[arg-type]
    body = ant_refusal.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "rate_limit_error"
    headers = ant_refusal.value.response.headers
    assert headers["retry-after"] and headers["anthropic-ratelimit-requests-remaining"] == "0"

    gemini = genai.Client(
        api_key=FIVE, http_options=types.HttpOptions(base_url=base, api_version="v1beta")
    )
    with pytest.raises(genai_errors.ClientError) as g_refusal:
        gemini.models.generate_content(
            model="smollm2",
            contents="Hi",
            config=types.GenerateContentConfig(max_output_tokens=1),
        )
    assert g_refusal.value.code == 429 and g_refusal.value.status == "RESOURCE_EXHAUSTED"

    llama = ollama.Client(host=base, headers={"Authorization": f"Bearer {FIVE}"})
    with pytest.raises(ollama.ResponseError) as o_refusal:
        llama.chat(model="smollm2", messages=HI, options={"num_predict": 1})
    assert o_refusal.value.status_code == 429 and "rpm" in o_refusal.value.error

    lms = httpx.post(
        f"{base}/api/v1/chat",
        json={"model": "smollm2", "input": "Hi", "max_output_tokens": 1},
        headers={"Authorization": f"Bearer {FIVE}"},
        timeout=30,
    )
    assert lms.status_code == 429 and lms.headers["retry-after"]
    assert lms.json()["error"]["type"] == "rate_limit_exceeded"

    # The openai SDK's own retry (2 by default) honours Retry-After and then succeeds.
    answer = oai(base, FIVE, retries=2).chat.completions.create(
        model="smollm2",
        messages=HI,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert answer.choices[0].finish_reason is not None
    assert time.monotonic() - started >= wait - 2


def test_one_stream_at_once(base: str) -> None:
    client = oai(base, ONE)
    first = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        max_tokens=300,
        stream=True,
    )
    chunks = iter(first)
    next(chunks)  # streaming: the key's one stream is in flight
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="smollm2", messages=HI, max_tokens=1)  # type: ignore[arg-type]
    assert "max_streams" in refused.value.message
    assert refused.value.response.headers["retry-after"] == "1"
    first.close()
    # Released once its answer has ended: the next one goes through.
    deadline = time.monotonic() + 10
    while True:
        try:
            client.chat.completions.create(model="smollm2", messages=HI, max_tokens=1)  # type: ignore[arg-type]
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the closed stream still holds its place"
            time.sleep(0.2)


def test_other_keys_are_not_limited_meanwhile(base: str) -> None:
    raw = oai(base, FREE).chat.completions.with_raw_response.create(
        model="smollm2",
        messages=HI,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert raw.http_response.status_code == 200
    assert "x-ratelimit-limit-requests" not in raw.headers


def test_a_model_outside_the_list_is_an_unknown_model(base: str) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        oai(base, PICKY).chat.completions.create(model="smollm2", messages=HI, max_tokens=1)  # type: ignore[arg-type]
    assert refused.value.code == "model_not_found"
    claude = anthropic.Anthropic(base_url=base, api_key=PICKY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="smollm2", max_tokens=1, messages=HI)  # type: ignore[arg-type]
    llama = ollama.Client(host=base, headers={"Authorization": f"Bearer {PICKY}"})
    with pytest.raises(ollama.ResponseError) as o_refusal:
        llama.chat(model="smollm2", messages=HI)
    assert o_refusal.value.status_code == 404
    # The same model for a key without a list.
    oai(base, FREE).chat.completions.create(model="smollm2", messages=HI, max_tokens=1)  # type: ignore[arg-type]


def _seconds_to_midnight() -> float:
    now = datetime.now(UTC)
    midnight = datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)
    return (midnight - now).total_seconds()


def _spent_until_refused(base: str) -> openai.RateLimitError:
    client = oai(base, BUDGET)
    for _ in range(3):  # the first spends the 20 tokens of the day (~30 prompt tokens)
        try:
            client.chat.completions.create(model="smollm2", messages=HI, max_tokens=2)  # type: ignore[arg-type]
        except openai.RateLimitError as refused:
            return refused
    raise AssertionError("the budget never ran out")


def test_a_spent_budget_blocks_until_the_day_ends_and_across_a_restart(
    files: tuple[Path, Path], base: str
) -> None:
    refused = _spent_until_refused(base)
    assert refused.code == "insufficient_quota"
    wait = int(refused.response.headers["retry-after"])
    assert abs(wait - _seconds_to_midnight()) < 30
    # A second server on the same store: the budget stays spent.
    conf, store = files
    with serve_process("--config", str(conf), "--store", str(store), *QUIET) as again:
        with pytest.raises(openai.RateLimitError) as still:
            oai(again, BUDGET).chat.completions.create(model="smollm2", messages=HI, max_tokens=1)  # type: ignore[arg-type]
        assert still.value.code == "insufficient_quota"


def test_usage_is_per_key_and_a_user_key_sees_its_own(base: str) -> None:
    def usage(key: str, query: str = "") -> Any:
        answer = httpx.get(
            f"{base}/v1/usage{query}", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        return answer

    mine = usage(FREE)
    assert mine.status_code == 200
    assert {row["key"] for row in mine.json()["data"]} == {"free"}
    assert mine.json()["totals"]["requests"] >= 1
    assert usage(FREE, "?key=five").status_code == 403
    every = usage(ADMIN).json()["data"]
    assert {"free", "five"} <= {row["key"] for row in every}
    assert usage(ADMIN, "?since=yesterday").status_code == 400


@pytest.mark.parametrize(
    ("path", "names"),
    [
        ("/v1/models", lambda j: [m["id"] for m in j["data"]]),
        ("/v1/info", lambda j: [m["id"] for m in j["models"]]),
        ("/api/tags", lambda j: [m["name"] for m in j["models"]]),
        ("/api/v1/models", lambda j: [m["key"] for m in j["models"]]),
        ("/v1beta/models", lambda j: [m["name"] for m in j.get("models", [])]),
    ],
)
def test_the_model_lists_show_a_key_only_its_models(base: str, path: str, names: Any) -> None:
    def listed(key: str) -> list[str]:
        answer = httpx.get(f"{base}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert answer.status_code == 200, answer.text
        return [str(n) for n in names(answer.json())]

    assert any("smollm2" in n for n in listed(FREE))
    assert listed(PICKY) == []
