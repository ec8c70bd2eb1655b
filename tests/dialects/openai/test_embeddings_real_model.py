"""Embeddings on the real SmolLM2 through the official ``openai`` SDK
(``embeddings.create``, float and base64) and the ``ollama`` library (``embed``), on the
local model and on an upstream model (a second sluice in front of the first)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import ollama
import pytest
from openai import OpenAI

from tests.support.real_server import wait_idle
from tests.support.servers import gateway_in_front

pytestmark = pytest.mark.integration

TEXTS = [
    "The cat sat on the mat.",
    "A cat is sitting on a mat.",
    "Quantum chromodynamics describes the strong force between quarks.",
]
BACKENDS = ["smollm2", "up-smollm2"]


@pytest.fixture(scope="module")
def gateway(base: str) -> Iterator[str]:
    with gateway_in_front(base) as url:
        yield url


def _url(base: str, gateway: str, model: str) -> str:
    return base if model == "smollm2" else gateway


@pytest.mark.parametrize("model", BACKENDS)
def test_openai_sdk_embeddings(base: str, gateway: str, model: str) -> None:
    wait_idle(base, within=10)
    url = _url(base, gateway, model)
    with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        # The SDK asks for base64 by default and decodes it; float on request.
        packed = client.embeddings.create(model=model, input=TEXTS)
        floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    a = np.array([d.embedding for d in packed.data])
    b = np.array([d.embedding for d in floats.data])
    assert a.shape == (3, 576) and np.allclose(a, b, atol=1e-6)
    assert np.allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)
    # Meaning shows: the two sentences about a cat are nearer than either to quarks.
    sims = b @ b.T
    assert sims[0, 1] > sims[0, 2] and sims[0, 1] > sims[1, 2]
    assert floats.usage.prompt_tokens > 10


@pytest.mark.parametrize("model", BACKENDS)
def test_ollama_embed_equals_openais(base: str, gateway: str, model: str) -> None:
    wait_idle(base, within=10)
    url = _url(base, gateway, model)
    answer = ollama.Client(host=url, timeout=120).embed(model=model, input=TEXTS)
    with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120) as client:
        local = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    assert np.allclose(
        np.array(answer.embeddings), np.array([d.embedding for d in local.data]), atol=1e-5
    )
    assert answer.prompt_eval_count and answer.prompt_eval_count > 10


def test_a_long_input_does_not_hold_short_ones(base: str) -> None:
    """A 100,000-character input (truncated to the 4,096-token window: seconds of
    decode) and, meanwhile, a few words from another client: the short one has its own
    pooled context and answers at once."""
    import threading
    import time

    import httpx

    wait_idle(base, within=10)
    long_text = "The lighthouse keeper wrote another line in the log. " * 1900  # ~100k chars
    done: dict[str, float] = {}

    def long_request() -> None:
        r = httpx.post(
            f"{base}/api/embed", json={"model": "smollm2", "input": long_text}, timeout=300
        )
        assert r.status_code == 200, r.text
        done["long"] = time.monotonic()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(1.5)  # its decode under way
    started = time.monotonic()
    r = httpx.post(f"{base}/api/embed", json={"model": "smollm2", "input": "a cat"}, timeout=60)
    elapsed = time.monotonic() - started
    assert r.status_code == 200 and len(r.json()["embeddings"][0]) == 576
    worker.join()
    assert "long" in done and done["long"] > started + elapsed  # the long one still ran
    assert elapsed < 1.0, f"the short input waited {elapsed:.2f} s"
