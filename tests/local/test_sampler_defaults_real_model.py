"""Sampling defaults on the real model: a field a request leaves out gets the model's
declared default (here its config entry), else llama.cpp's, shown by /v1/info; an
explicit value wins."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

STORY = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("cfg") / "sluice.toml"
    config.write_text(
        '[[models]]\nname = "greedy-fox"\nsource = "smollm2"\n'
        "sampling = { temperature = 0, top_k = 7 }\n"
        '[[models]]\nname = "fussy-fox"\nsource = "smollm2"\n'
        "sampling = { temperature = 0, repeat_penalty = 1.8, penalty_last_n = 256 }\n"
    )
    with serve_process("--config", str(config), "--parallel", "2", *QUIET) as url:
        yield url


def _chat(base: str, model: str, **fields: object) -> str:
    body = {"model": model, "messages": STORY, "max_tokens": 24, **fields}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_info_shows_each_models_defaults_and_where_they_come_from(base: str) -> None:
    models = {m["id"]: m for m in httpx.get(f"{base}/v1/info", timeout=30).json()["models"]}
    assert models["greedy-fox"]["sampling_defaults"] == {
        "temperature": 0.0,
        "top_k": 7,
        "top_p": 0.95,
        "min_p": 0.05,
        "repeat_penalty": 1.0,
        "repeat_last_n": 64,
        "source": "config",
    }
    # The packaged SmolLM2 declares none in its GGUF: llama.cpp's server's defaults.
    assert models["smollm2-135m-instruct"]["sampling_defaults"] == {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "repeat_penalty": 1.0,
        "repeat_last_n": 64,
        "source": "llama.cpp",
    }


def test_a_left_out_temperature_takes_the_config_entrys(base: str) -> None:
    greedy = _chat(base, "greedy-fox", temperature=0)
    # Its config says temperature 0: leaving it out is greedy, every time.
    assert _chat(base, "greedy-fox") == greedy
    assert _chat(base, "greedy-fox", seed=11) == greedy
    # An explicit value wins: hot sampling over the whole vocabulary wanders off.
    hot = {_chat(base, "greedy-fox", temperature=2.0, top_k=0, seed=s) for s in (1, 2, 3)}
    assert greedy not in hot and len(hot) > 1
    # The same model under its packaged name samples at llama.cpp's 0.8: seeds differ.
    packaged = {_chat(base, "smollm2", seed=s) for s in (1, 2, 3, 4)}
    assert len(packaged) > 1


def test_a_left_out_repeat_penalty_takes_the_config_entrys(base: str) -> None:
    """Greedy both times: only the penalty can make the answers differ."""
    penalized = _chat(base, "fussy-fox")
    assert _chat(base, "fussy-fox", repeat_penalty=1.8, repeat_last_n=256) == penalized
    assert _chat(base, "fussy-fox", repeat_penalty=1.0) != penalized
