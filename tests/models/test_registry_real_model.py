"""Many models in one server, on the real models: just-in-time loads, eviction, the memory guard.

Each test starts its own server (their settings differ) with one llama.cpp
thread, a small context and an empty models folder.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.real_server import QUIET, parse_sse
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"
SMALL = ("--ctx", "512", "--parallel", "1", *QUIET)


def states(base: str) -> dict[str, str]:
    data = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["status"] for m in data}


def complete(base: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json={**body, **extra}, timeout=120)


def wait_for(check: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_slots() -> Iterator[str]:
    with serve_process("--ctx", "512", "--parallel", "2", *QUIET) as url:
        yield url


def test_a_request_for_another_model_loads_it_while_the_first_keeps_streaming(
    two_slots: str,
) -> None:
    base = two_slots
    assert states(base) == {SMOL: "loaded", GEMMA: "not_loaded"}
    stamps: list[float] = []
    done = threading.Event()

    def stream_smol() -> None:
        body = {
            "model": SMOL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())
        done.set()

    streamer = threading.Thread(target=stream_smol)
    streamer.start()
    wait_for(lambda: len(stamps) > 5)
    started = time.monotonic()
    res = complete(base, GEMMA)  # not loaded: loads now, then answers
    finished = time.monotonic()
    streamer.join(120)
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["model"] == GEMMA and body["choices"][0]["text"]
    assert states(base) == {SMOL: "loaded", GEMMA: "loaded"}
    # The other model's stream went on while gemma loaded and answered.
    during = [t for t in stamps if started <= t <= finished]
    assert len(during) >= 3, (len(during), finished - started)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(gaps) < 3.0, max(gaps)
    # Both answer by name, and an alias finds the same model.
    assert complete(base, "gemma3-270m").json()["model"] == GEMMA
    assert complete(base, "smollm2").json()["model"] == SMOL


def test_concurrent_first_requests_share_one_load() -> None:
    with serve_process(*SMALL) as base:
        results: list[httpx.Response] = []

        def one() -> None:
            results.append(complete(base, GEMMA))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["models"][GEMMA]["loads"] == 1
        assert health["models"][SMOL]["loads"] == 1


def test_the_least_recently_used_idle_model_makes_room() -> None:
    with serve_process("--max-loaded-models", "1", *SMALL) as base:
        assert complete(base, GEMMA).status_code == 200
        assert states(base) == {SMOL: "not_loaded", GEMMA: "loaded"}
        assert complete(base, SMOL).status_code == 200  # loads again: gemma makes room
        assert states(base) == {SMOL: "loaded", GEMMA: "not_loaded"}


def test_an_idle_model_unloads_after_its_ttl() -> None:
    with serve_process("--model-ttl", "1", *SMALL) as base:
        assert complete(base, GEMMA).status_code == 200
        assert states(base)[GEMMA] == "loaded"
        wait_for(lambda: states(base)[GEMMA] == "not_loaded", within=10)
        # The default model, loaded at start, stays: the TTL is for models loaded on demand.
        assert states(base)[SMOL] == "loaded"
        assert complete(base, GEMMA).status_code == 200  # and it comes back on demand


def test_a_model_over_the_memory_budget_is_refused_not_loaded() -> None:
    # smollm2 at this size is estimated ~170 MiB, gemma ~420 MiB.
    with serve_process("--memory-budget-mb", "300", *SMALL) as base:
        res = complete(base, GEMMA)
        assert res.status_code == 400, res.text
        err = res.json()["error"]
        assert err["code"] == "model_too_large" and "MiB" in err["message"]
        assert states(base) == {SMOL: "loaded", GEMMA: "not_loaded"}
        # Streaming requests get the same refusal before any byte.
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            json={"model": GEMMA, "prompt": "x", "stream": True},
            headers={"Accept": "text/event-stream"},
            timeout=60,
        ) as r:
            body = r.read()
        assert r.status_code == 400
        events = parse_sse(body)
        assert events[0].event == "error" and events[0].json()["code"] == "model_too_large"
        assert complete(base, SMOL).status_code == 200  # the loaded model still answers


def test_a_model_that_needs_memory_in_use_waits_its_turn() -> None:
    # Room for one model at a time; the loaded one is busy streaming.
    with serve_process("--memory-budget-mb", "500", *SMALL) as base:
        body = {
            "model": SMOL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            res = complete(base, GEMMA)
            assert res.status_code == 503, res.text
            assert res.json()["error"]["code"] == "insufficient_memory"
            assert int(res.headers["Retry-After"]) > 0
        # Once the stream is over, smollm2 is idle and makes room.
        wait_for(lambda: complete(base, GEMMA).status_code == 200, within=30)
        assert states(base) == {SMOL: "not_loaded", GEMMA: "loaded"}


def test_strict_names_refuse_an_unknown_model_and_loose_names_serve_the_default() -> None:
    with serve_process("--strict-model-names", *SMALL) as base:
        res = complete(base, "local-model")
        assert res.status_code == 404 and res.json()["error"]["code"] == "model_not_found"
        assert complete(base, GEMMA).status_code == 200  # a known model still loads
    with serve_process(*SMALL) as base:
        res = complete(base, "local-model")
        assert res.status_code == 200 and res.json()["model"] == SMOL


def test_unload_on_request_ends_the_streams_on_that_model_with_an_error_frame(
    two_slots: str,
) -> None:
    base = two_slots
    assert complete(base, GEMMA).status_code == 200
    body = {"model": GEMMA, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        res = httpx.post(f"{base}/api/v1/models/unload", json={"instance_id": GEMMA}, timeout=60)
        assert res.status_code == 200 and res.json() == {"instance_id": GEMMA}
        rest = "\n".join(lines)
    # Ended at once, in-band (the status was already 200): the error frame, no [DONE].
    assert "event: error" in rest and "model_unloaded" in rest
    assert "[DONE]" not in rest
    assert states(base)[GEMMA] == "not_loaded"
    assert complete(base, GEMMA).status_code == 200  # loads again on the next request


def test_a_request_can_set_the_idle_ttl_of_the_model_it_loads(two_slots: str) -> None:
    base = two_slots
    res = complete(base, GEMMA, ttl=1)  # LM Studio's per-request ttl, in seconds
    assert res.status_code == 200, res.text
    # A request's ttl does not unpin a model loaded explicitly (the default, at start).
    assert complete(base, SMOL, ttl=1).status_code == 200
    wait_for(lambda: states(base)[GEMMA] == "not_loaded", within=10)
    time.sleep(1.5)
    assert states(base)[SMOL] == "loaded"
    bad = complete(base, GEMMA, ttl=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl"


def test_saved_prompt_states_stay_within_the_memory_budget() -> None:
    # smollm2 at this size is estimated ~170 MiB: ~20 MiB are left for its prompt cache
    # (--cache-ram's 2 GiB would hold every state), ~10 MiB a 450-token state.
    budget = 190 << 20
    with serve_process("--memory-budget-mb", str(budget >> 20), *SMALL) as base:

        def held() -> int:
            (model,) = httpx.get(f"{base}/api/ps", timeout=10).json()["models"]
            return int(model["size"])

        def cache() -> dict[str, int]:
            health = httpx.get(f"{base}/health", timeout=10).json()
            return dict(health["models"][SMOL]["prompt_cache"])

        for i in range(6):
            words = " ".join(f"w{i}x{j}" for j in range(85))
            res = complete(base, SMOL, prompt=f"Text {i}: {words}", max_tokens=1)
            assert res.status_code == 200, res.text
            assert 300 < res.json()["usage"]["prompt_tokens"] < 500
            wait_for(lambda: cache()["entries"] > 0)
        wait_for(lambda: cache()["bytes"] > 10 << 20)
        time.sleep(0.5)  # the last save, if one is under way
        assert 0 < held() <= budget
        assert cache()["entries"] < 6  # the oldest states made room for the newest
