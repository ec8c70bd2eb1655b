"""/v1/embeddings, /api/embed and /api/embeddings at their boundaries, on the scripted
runner's fake embedder: shapes, base64, dimensions, limits and errors."""

from __future__ import annotations

import base64
import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.fakes import ScriptedRunner
from tests.support.helpers import scripted_server, served, wait_until


def post(base: str, path: str, **body: Any) -> httpx.Response:
    return httpx.post(base + path, json={"model": "scripted", **body}, timeout=30)


def test_openai_embeddings_float_base64_and_usage() -> None:
    with scripted_server(ScriptedRunner()) as base:
        floats = post(base, "/v1/embeddings", input=["hello there", "goodbye"])
        b64 = post(
            base, "/v1/embeddings", input=["hello there", "goodbye"], encoding_format="base64"
        )
        one = post(base, "/v1/embeddings", input="hello there")
        ids = post(base, "/v1/embeddings", input=[5, 6, 7])
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["object"] == "list" and body["model"] == "scripted"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    vectors = [d["embedding"] for d in body["data"]]
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-6) for v in vectors)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
        for d in b64.json()["data"]
    ]
    # The floats are the float32 values base64 carries, each in its shortest form
    # (at most 9 significant digits, not the 17 of a float64 repr).
    assert np.array(vectors, dtype=np.float32).tobytes() == np.array(decoded, "<f4").tobytes()
    numbers = re.findall(rb"-?[0-9.]+(?:e-?[0-9]+)?", floats.content.split(b'"embedding":')[1])
    assert numbers and all(
        len(n.lstrip(b"-0.").replace(b".", b"").split(b"e")[0]) <= 9 for n in numbers
    )
    assert one.json()["data"][0]["embedding"] == vectors[0]
    assert len(ids.json()["data"]) == 1 and ids.json()["usage"]["prompt_tokens"] == 3


def test_dimensions_keep_the_first_values_normalized_again() -> None:
    with scripted_server(ScriptedRunner()) as base:
        full = post(base, "/v1/embeddings", input="hello there").json()["data"][0]["embedding"]
        short = post(base, "/v1/embeddings", input="hello there", dimensions=3).json()
    head = np.array(full[:3])
    assert np.allclose(short["data"][0]["embedding"], head / np.linalg.norm(head))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input[1]"),
        ({"input": ["a", [1, 2]]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": [10**9]}, "input"),
    ],
)
def test_openai_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    with scripted_server(ScriptedRunner()) as base:
        r = post(base, "/v1/embeddings", **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_input_over_the_window_is_a_400_for_openai_and_cut_for_ollama() -> None:
    runner = ScriptedRunner(n_ctx_seq=64)
    long = "word " * 200
    with scripted_server(runner) as base:
        openai = post(base, "/v1/embeddings", input=long)
        ollama = post(base, "/api/embed", input=long)
        strict = post(base, "/api/embed", input=long, truncate=False)
    assert openai.status_code == 400 and "at most 64" in openai.json()["error"]["message"]
    assert ollama.status_code == 200 and ollama.json()["prompt_eval_count"] == 64
    assert strict.status_code == 400 and set(strict.json()) == {"error"}


def test_inputs_per_request_and_tokens_per_input_are_settings() -> None:
    runner = ScriptedRunner()
    with scripted_server(runner, max_embedding_inputs=3, embedding_ctx=16) as base:
        assert post(base, "/v1/embeddings", input=["a", "b", "c"]).status_code == 200
        many = post(base, "/v1/embeddings", input=["a", "b", "c", "d"])
        assert many.status_code == 400
        assert "limit is 3 (--max-embedding-inputs)" in many.json()["error"]["message"]
        ollama = post(base, "/api/embed", input=["a", "b", "c", "d"])
        assert ollama.status_code == 400 and "limit is 3" in ollama.json()["error"]
        long = post(base, "/v1/embeddings", input="word " * 40)
        assert long.status_code == 400 and "at most 16" in long.json()["error"]["message"]
        cut = post(base, "/api/embed", input="word " * 40)
        assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 16
    assert runner.embedders[0].n_ctx == 16


def test_ollama_embed_and_the_legacy_endpoint() -> None:
    runner = ScriptedRunner()
    with scripted_server(runner) as base:
        many = post(base, "/api/embed", input=["hello there", "goodbye"])
        single = post(base, "/api/embed", input="hello there")
        legacy = post(base, "/api/embeddings", prompt="hello there")
        openai = post(base, "/v1/embeddings", input="hello there")
        empty = post(base, "/api/embed", input=[])
    body = many.json()
    assert body["model"] == "scripted" and len(body["embeddings"]) == 2
    for key in ("total_duration", "load_duration", "prompt_eval_count"):
        assert isinstance(body[key], int)
    vector = openai.json()["data"][0]["embedding"]
    assert single.json()["embeddings"] == [vector] == [body["embeddings"][0]]
    assert legacy.json() == {"embedding": vector}
    assert empty.status_code == 400 and set(empty.json()) == {"error"}
    # One pooled context for the model, made on first use, every input of a request
    # in one batch.
    assert len(runner.embedders) == 1


def test_concurrent_requests_share_decodes() -> None:
    runner = ScriptedRunner(embed_delay=0.2)
    with scripted_server(runner) as base:
        post(base, "/v1/embeddings", input="warm up")  # the pooled context exists now
        texts = [[f"text {r} {i}" for i in range(4)] for r in range(6)]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda t: post(base, "/v1/embeddings", input=t), texts))
        alone = [post(base, "/v1/embeddings", input=t).json() for t in texts]
    assert all(a.status_code == 200 for a in answers)
    # The same vectors, in each request's order, as when asked one at a time...
    assert [a.json()["data"] for a in answers] == [a["data"] for a in alone]
    # ...but while the first decode ran the others queued, and went together.
    (embedder,) = runner.embedders
    concurrent = embedder.batches[1 : len(embedder.batches) - len(texts)]
    assert sum(concurrent) == 24 and len(concurrent) < 6 and max(concurrent) > 4


def test_health_shows_the_embedding_context_once_made() -> None:
    runner = ScriptedRunner()
    with scripted_server(runner) as base:
        before = httpx.get(base + "/health", timeout=30).json()["models"]["scripted"]
        post(base, "/v1/embeddings", input="hello")
        after = httpx.get(base + "/health", timeout=30).json()["models"]["scripted"]
    assert before["embedding"] is None
    assert after["embedding"] == {"pooling": "mean", "n_ctx": runner.n_ctx_seq, "bytes": 1 << 20}


def test_embedding_requests_are_metered_per_slot() -> None:
    with scripted_server(ScriptedRunner()) as base:

        def counts() -> tuple[float, float]:
            text = httpx.get(base + "/metrics", timeout=30).text
            ok = re.search(
                r'^sluice_requests_total\{outcome="ok",slot="scripted"\} (\S+)$', text, re.MULTILINE
            )
            tokens = re.search(
                r'^sluice_tokens_total\{direction="in",slot="scripted"\} (\S+)$', text, re.MULTILINE
            )
            return (float(ok.group(1)) if ok else 0.0, float(tokens.group(1)) if tokens else 0.0)

        before = counts()
        used = post(base, "/v1/embeddings", input=["hello there", "goodbye"]).json()["usage"]
        post(base, "/api/embed", input="hello there")
        after = counts()
    assert after[0] - before[0] == 2
    assert after[1] - before[1] >= used["prompt_tokens"] > 0


def test_an_embedding_context_over_the_memory_budget_is_refused() -> None:
    """Saved prompt states make room first; past them, a 503 that says why, in each
    dialect's shape, and the model keeps generating."""
    runner = ScriptedRunner(embed_bytes=3 << 20)
    with scripted_server(runner, memory_budget_mb=2) as base:
        r = post(base, "/v1/embeddings", input="hello")
        assert r.status_code == 503, r.text
        assert "pooled context" in r.json()["error"]["message"]
        assert "--memory-budget-mb" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "5"
        r = post(base, "/api/embed", input="hello")
        assert r.status_code == 503 and "pooled context" in r.json()["error"]
        assert runner.embedders == []
        chat = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
    runner = ScriptedRunner(embed_bytes=1 << 20)
    with scripted_server(runner, memory_budget_mb=2) as base:
        assert post(base, "/v1/embeddings", input="hello").status_code == 200
        health = httpx.get(base + "/health", timeout=30).json()["models"]["scripted"]
        assert health["embedding"]["bytes"] == 1 << 20


def test_saved_prompt_states_give_way_to_the_embedding_context() -> None:
    runner = ScriptedRunner(embed_bytes=3 << 19, state_bytes_per_token=6144)  # 1.5 MiB
    with served(runner, parallel=1, memory_budget_mb=2) as (base, engine):
        for name in "ab":  # ~135 tokens each: ~0.8 MiB a saved state
            chat = {"model": "scripted", "messages": [{"role": "user", "content": name * 90}]}
            assert httpx.post(base + "/v1/chat/completions", json=chat, timeout=30).is_success
        wait_until(lambda: len(runner.saves) == 2)
        assert engine.prompt_cache.size_bytes > 1 << 20  # no room left for 1.5 MiB
        assert post(base, "/v1/embeddings", input="hello").status_code == 200
        assert engine.prompt_cache.size_bytes <= (1 << 19)
        assert engine.prompt_cache.reclaimed > 0


def test_saved_prompt_states_stay_when_dropping_them_would_not_be_enough() -> None:
    runner = ScriptedRunner(embed_bytes=3 << 20, state_bytes_per_token=6144)  # 3 MiB
    with served(runner, parallel=1, memory_budget_mb=2) as (base, engine):
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "a" * 90}]}
        assert httpx.post(base + "/v1/chat/completions", json=chat, timeout=30).is_success
        wait_until(lambda: len(runner.saves) == 1)
        kept = engine.prompt_cache.size_bytes
        assert kept > 0
        assert post(base, "/v1/embeddings", input="hello").status_code == 503
        assert engine.prompt_cache.size_bytes == kept and engine.prompt_cache.reclaimed == 0


def test_the_grammar_tokenizer_counts_in_the_memory_budget() -> None:
    """Made on the model's first request with a grammar: a 503 that says why where it
    does not fit; counted as held (/health) where it does."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    chat = {
        "model": "scripted",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": schema,
    }
    runner = ScriptedRunner(grammar_tokenizer_bytes=3 << 20)
    with scripted_server(runner, memory_budget_mb=2) as base:
        r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 503, r.text
        assert "grammar tokenizer" in r.json()["error"]["message"]
        assert not runner.grammar_made
        plain = {k: v for k, v in chat.items() if k != "response_format"}
        assert httpx.post(base + "/v1/chat/completions", json=plain, timeout=30).is_success
    runner = ScriptedRunner(grammar_tokenizer_bytes=1 << 20)
    with scripted_server(runner, memory_budget_mb=2) as base:
        health = httpx.get(base + "/health", timeout=30).json()["models"]["scripted"]
        assert health["grammar"] is None
        r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200, r.text
        health = httpx.get(base + "/health", timeout=30).json()["models"]["scripted"]
        assert health["grammar"] == {"bytes": 1 << 20}
