"""Hostile and careless bodies: each is a 4xx naming the field, never a 500 or a stall."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.fakes import ScriptedRunner
from tests.support.helpers import CHAT, TEXT, parse_sse, scripted_server, user, wait_idle
from tests.support.servers import health_gaps_during


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with scripted_server(
        ScriptedRunner(),
        max_messages=5,
        max_stop=3,
        max_stop_length=8,
        max_logit_bias=4,
        max_json_depth=16,
    ) as url:
        yield url


def post_raw(base: str, path: str, raw: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        base + path,
        content=raw,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )


def assert_400(r: httpx.Response, param: str | None) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if param is not None:
        assert param in err["message"], err
    return err  # type: ignore[no-any-return]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (CHAT, rb'{"messages":[{"role":"user","content":"\ud800"}]}', "messages[0].content"),
        (CHAT, rb'{"messages":[{"role":"user","content":"a\udfff b"}]}', "messages[0].content"),
        (TEXT, rb'{"prompt":"x\udbff"}', "prompt"),
        (TEXT, rb'{"prompt":["ok","\ud83d"]}', "prompt[1]"),
        (CHAT, rb'{"messages":[{"role":"user","content":"x"}],"user":"\ud800"}', "user"),
        (CHAT, rb'{"messages":[{"role":"user","content":"x"}],"\ud800":1}', None),
        (TEXT, b'{"prompt":"x","seed":' + b"9" * 5000 + b"}", "seed"),
        (TEXT, b'{"prompt":"x","seed":' + b"1" * 25 + b"}", "seed"),
        (TEXT, b'{"prompt":"x","max_tokens":-' + b"1" * 30 + b"}", "max_tokens"),
        (TEXT, b'{"prompt":"x","temperature":NaN}', "temperature"),
        (TEXT, b'{"prompt":"x","temperature":Infinity}', "temperature"),
        (TEXT, b'{"prompt":"x","top_p":-Infinity}', "top_p"),
        (TEXT, b'{"prompt":"x","temperature":1e999}', "temperature"),
        (TEXT, b'{"prompt":"x","logit_bias":{"5":1e400}}', "logit_bias.5"),
        (TEXT, b'{"prompt":"x","metadata":' + nested(17).encode() + b"}", "metadata" + "[0]" * 15),
        (CHAT, b'{"messages":' + nested(1000).encode() + b"}", None),
        (CHAT, b'{"x":' + nested(100_000).encode() + b"}", None),
        (TEXT, b'{"prompt":"x","logit_bias":{"--5":1}}', "logit_bias"),
        (TEXT, '{"prompt":"x","logit_bias":{"²":1}}'.encode(), "logit_bias"),
        (TEXT, '{"prompt":"x","logit_bias":{"٣":1}}'.encode(), "logit_bias"),
        (TEXT, b'{"prompt":"x","logit_bias":{"99999999999999999999999":1}}', "logit_bias"),
        (TEXT, b'{"prompt":"x","logit_bias":{"-5":1}}', "logit_bias"),
        (TEXT, b'{"prompt":"x","stop":["a","b","c","d"]}', "stop"),
        (TEXT, b'{"prompt":"x","stop":"123456789"}', "stop"),
        (TEXT, b'{"prompt":"x","logit_bias":{"1":1,"2":1,"3":1,"4":1,"5":1}}', "logit_bias"),
        (TEXT, b'{"prompt":"x","top_k":' + str(2**40).encode() + b',"max_tokens":1}', None),
        (
            CHAT,
            (
                b'{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function",'
                b'"function":{"name":"f"}}],"tool_choice":{"type":"function","function":"f"}}'
            ),
            "tool_choice.function",
        ),
        (
            CHAT,
            (
                b'{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function",'
                b'"function":{"name":"f","parameters":{"type":"object","properties":[1]}}}]}'
            ),
            "tools[0].function.parameters",
        ),
        (
            CHAT,
            (
                b'{"messages":[{"role":"user","content":"x"}],"response_format":{"type":'
                b'"json_schema","json_schema":{"name":"s","schema":{"type":"string",'
                b'"minLength":-1000000000}}}}'
            ),
            "response_format.json_schema.schema",
        ),
        (TEXT, b"\xff\xfe\xfa not utf-8", None),
        (CHAT, b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}', None),  # CESU-8
        (TEXT, '{"prompt":"0","max_tokens":1}'.encode("utf-16"), None),
        (TEXT, b'{"prompt":"x","metadata":{"\\ud800":"\\udfff"}}', "metadata"),
        (TEXT, b'{"prompt":"x","\\ud800":NaN}', None),
        (TEXT, b'{"prompt":{"a":1}}', "prompt"),
        (CHAT, b'{"messages":[{"content":"x"}]}', "messages[0].role"),
        (TEXT, b"[1, 2]", None),
        (TEXT, b"", None),
    ],
)
def test_bad_body_is_400_naming_the_field(
    base: str, path: str, raw: bytes, param: str | None
) -> None:
    r = post_raw(base, path, raw)
    if b"top_k" in raw:  # a huge top_k is just "no top-k": it works
        assert r.status_code == 200, r.text
        return
    assert_400(r, param)


def test_message_count_is_a_limit(base: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}] * 6}
    err = assert_400(httpx.post(base + CHAT, json=body, timeout=30), "messages")
    assert "5" in err["message"] and "--max-messages" in err["message"]
    body = {"messages": [{"role": "user", "content": "x"}] * 5, "max_tokens": 1}
    assert httpx.post(base + CHAT, json=body, timeout=30).status_code == 200


def test_stream_asking_for_sse_gets_the_limit_as_an_error_frame(base: str) -> None:
    body = {"messages": user("x") * 6, "stream": True}
    r = httpx.post(base + CHAT, json=body, headers={"accept": "text/event-stream"}, timeout=30)
    assert r.status_code == 400
    frames = parse_sse(r.content)
    assert [f.event for f in frames] == ["error"]
    assert frames[0].json()["error"]["param"] == "messages"


def test_unexpected_failure_is_a_json_500_not_a_text_page() -> None:
    class Broken(ScriptedRunner):
        def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> Any:
            raise RuntimeError("a bug in the server")

    with scripted_server(Broken()) as url:
        r = httpx.post(url + TEXT, json={"prompt": "x"}, timeout=30)
        assert r.status_code == 500
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error"
        assert "a bug in the server" not in err["message"]  # no internals on the wire
        # The server is still fine.
        assert httpx.get(url + "/health", timeout=5).status_code == 200


def _health_gaps_during(base: str, send: Any) -> tuple[Any, list[float]]:
    result, gaps = health_gaps_during(base, send)
    assert len(gaps) > 20
    return result, gaps


# The server shares this process (and its GIL) with the poller and the client, on a
# machine shared with other work: the bound is loose, but it is the longest of hundreds
# of gaps, so these run with the perf marker (``pytest -m perf``). On the old code these
# requests held the event loop for seconds to minutes; benchmarks/health_gap.py measures
# the 100 ms target on a separate server process.
GAP_BOUND = 0.3


@pytest.mark.perf  # the longest of hundreds of /health gaps under 0.3 s
def test_a_huge_request_never_stalls_health(base: str) -> None:
    """100,000 tiny messages (3 MB): /health keeps answering while it is refused."""
    messages = ",".join(['{"role":"user","content":"hi"}'] * 100_000)
    raw = f'{{"messages":[{messages}],"max_tokens":1}}'.encode()
    assert len(raw) > 3_000_000
    r, gaps = _health_gaps_during(base, lambda: post_raw(base, CHAT, raw))
    assert_400(r, "messages")
    assert max(gaps) < GAP_BOUND, sorted(gaps)[-5:]
    wait_idle(base)


@pytest.mark.perf  # the longest of hundreds of /health gaps under 0.3 s
def test_templating_and_tokenizing_a_huge_prompt_never_stall_health(base: str) -> None:
    """A 4 MB message is rendered and tokenized (then too long): off the event loop."""
    body = {"messages": user("y" * 4_000_000), "max_tokens": 1}
    r, gaps = _health_gaps_during(base, lambda: httpx.post(base + CHAT, json=body, timeout=60))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert max(gaps) < GAP_BOUND, sorted(gaps)[-5:]
    wait_idle(base)


def test_valid_request_still_works_after_all_that(base: str) -> None:
    body = {"messages": user("x"), "stop": ["a", "b", "c"], "logit_bias": {"1": 5}}
    r = httpx.post(base + CHAT, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert json.loads(r.text)["choices"][0]["message"]["content"] == "Hello world!"


def test_client_gone_before_its_body_arrived_is_quiet(
    base: str, caplog: pytest.LogCaptureFixture
) -> None:
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(base)
    with caplog.at_level("ERROR"):
        for _ in range(3):
            sock = socket.create_connection((url.hostname, url.port), timeout=5)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": "half a bo'
            )
            time.sleep(0.1)
            sock.close()
        time.sleep(0.3)
        assert httpx.get(base + "/health", timeout=5).status_code == 200
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.parametrize(
    ("seed", "want"),
    [
        (-1, [None, None, None]),  # random, every choice (not -1+1 = a fixed 0)
        (2**32 - 1, [None, None, None]),
        (5, [5, 6, 7]),
        (2**32 + 5, [5, 6, 7]),  # llama.cpp seeds are 32-bit
        (2**32 - 2, [2**32 - 2, 0, 1]),  # never 2**32-1 by adding the index
        (None, [None, None, None]),
    ],
)
def test_seeds_of_the_choices(seed: int | None, want: list[int | None]) -> None:
    runner = ScriptedRunner()
    with scripted_server(runner) as url:
        r = httpx.post(url + TEXT, json={"prompt": "s", "n": 3, "seed": seed}, timeout=30)
        assert r.status_code == 200, r.text

    def order(x: int | None) -> tuple[bool, int]:
        return (x is not None, x or 0)

    assert sorted((s.params.seed for s in runner.samplers), key=order) == sorted(want, key=order)
