"""Ollama's /api/chat and /api/generate at their boundaries, on the scripted runner:
NDJSON lines, the last line's counters, tool calls whole with object arguments,
errors before and after the first line, keep_alive, load-only requests."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from sluice.dialects.ollama.schema import UNLOAD_NOW, ChatRequest
from tests.support.fakes import EOS, FAIL, ScriptedRunner
from tests.support.helpers import scripted_server
from tests.support.servers import http_server

CALL = b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}], **extra}


def lines(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.split(b"\n")[:-1]]


def test_chat_streams_ndjson_by_default_and_ends_with_the_counters() -> None:
    runner = ScriptedRunner(default=[b"Hel", b"lo", b" there", EOS])
    with scripted_server(runner) as base:
        r = httpx.post(base + "/api/chat", json=chat(), timeout=30)
        whole = httpx.post(base + "/api/chat", json=chat(stream=False), timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-ndjson"
    got = lines(r.content)
    assert [g["done"] for g in got] == [False] * (len(got) - 1) + [True]
    text = "".join(g["message"]["content"] for g in got)
    assert text == "Hello there"
    last = got[-1]
    assert last["done_reason"] == "stop" and last["message"] == {"role": "assistant", "content": ""}
    assert last["eval_count"] >= 3 and last["prompt_eval_count"] > 0
    for key in ("total_duration", "prompt_eval_duration", "eval_duration", "load_duration"):
        assert isinstance(last[key], int) and last[key] >= 0, key
    assert last["total_duration"] >= last["eval_duration"]
    assert last["created_at"].endswith("Z") and last["model"] == "scripted"
    body = whole.json()
    assert whole.headers["content-type"].startswith("application/json")
    assert body["message"] == {"role": "assistant", "content": "Hello there"}
    assert body["done"] is True and body["done_reason"] == "stop"
    assert body["eval_count"] == last["eval_count"]


def test_num_predict_is_the_limit_and_length_the_reason() -> None:
    runner = ScriptedRunner(default=[b"a", b"b", b"c", b"d", EOS])
    with scripted_server(runner) as base:
        r = httpx.post(
            base + "/api/generate",
            json={
                "model": "scripted",
                "prompt": "Hi",
                "stream": False,
                "options": {"num_predict": 2},
            },
            timeout=30,
        )
    body = r.json()
    assert (body["response"], body["done_reason"], body["eval_count"]) == ("ab", "length", 2)
    assert "message" not in body


def test_a_tool_call_comes_whole_with_object_arguments() -> None:
    runner = ScriptedRunner(default=[CALL, EOS], n_ctx_seq=4096)
    with scripted_server(runner) as base:
        r = httpx.post(base + "/api/chat", json=chat(tools=[WEATHER]), timeout=30)
        whole = httpx.post(base + "/api/chat", json=chat(tools=[WEATHER], stream=False), timeout=30)
    got = lines(r.content)
    calls = [g["message"]["tool_calls"] for g in got if g["message"].get("tool_calls")]
    assert len(calls) == 1 and len(calls[0]) == 1
    assert calls[0][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert "<tool_call>" not in "".join(g["message"]["content"] for g in got)
    assert got[-1]["done_reason"] == "stop"
    message = whole.json()["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_a_failure_after_the_first_line_is_an_error_line() -> None:
    runner = ScriptedRunner(default=[b"Hel", FAIL, b"lo"])
    with scripted_server(runner) as base:
        r = httpx.post(base + "/api/chat", json=chat(), timeout=30)
    assert r.status_code == 200
    got = lines(r.content)
    assert got[0]["message"]["content"] == "Hel"
    assert set(got[-1]) == {"error"} and got[-1]["error"]
    assert not any(g.get("done") for g in got)


@pytest.mark.parametrize(
    ("path", "data", "status", "words"),
    [
        ("/api/chat", {"messages": []}, 400, "model"),
        ("/api/chat", chat(options={"temperature": 9}), 400, "temperature"),
        ("/api/chat", chat(format="yaml"), 400, "format"),
        ("/api/chat", chat(keep_alive="soon"), 400, "keep_alive"),
        ("/api/generate", {"model": "scripted", "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/api/chat", "{not json", 400, "JSON"),
        ("/api/show", {}, 400, "model"),
    ],
)
def test_errors_before_the_stream_are_a_status_and_an_error_string(
    path: str, data: Any, status: int, words: str
) -> None:
    with scripted_server(ScriptedRunner(), strict_model_names=True) as base:
        content = data if isinstance(data, str) else json.dumps(data)
        r = httpx.post(base + path, content=content, timeout=30)
        missing = httpx.post(base + "/api/chat", json=chat(model="nope"), timeout=30)
        prompt = httpx.post(
            base + "/api/chat",
            json=chat(messages=[{"role": "user", "content": "x" * 400}]),
            timeout=30,
        )
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"]
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
    assert prompt.status_code == 400 and "context" in prompt.json()["error"]


def test_images_for_a_local_model_are_a_400_that_says_so() -> None:
    message = {"role": "user", "content": "What is this?", "images": ["aGVsbG8="]}
    with scripted_server(ScriptedRunner()) as base:
        r = httpx.post(base + "/api/chat", json=chat(messages=[message]), timeout=30)
    assert r.status_code == 400 and "images" in r.json()["error"]


def test_empty_messages_load_and_keep_alive_zero_unloads() -> None:
    with scripted_server(ScriptedRunner()) as base:
        loaded = httpx.post(base + "/api/chat", json=chat(messages=[], stream=False), timeout=30)
        assert loaded.json()["done_reason"] == "load" and loaded.json()["done"] is True
        ps = httpx.get(base + "/api/ps", timeout=30).json()["models"]
        assert [m["name"] for m in ps] == ["scripted"]
        gone = httpx.post(base + "/api/chat", json=chat(messages=[], keep_alive=0), timeout=30)
        assert gone.json()["done_reason"] == "unload"
        assert httpx.get(base + "/api/ps", timeout=30).json()["models"] == []
        generated = httpx.post(
            base + "/api/generate", json={"model": "scripted", "keep_alive": "10m"}, timeout=30
        )
        assert generated.json()["done_reason"] == "load" and generated.json()["response"] == ""


@pytest.mark.parametrize(
    ("keep_alive", "ttl"),
    [(None, None), ("5m", 300.0), ("1h30m", 5400.0), (90, 90.0), ("2.5", 2.5), (-1, 0.0),
     ("-1m", 0.0), (0, UNLOAD_NOW), ("0s", UNLOAD_NOW)],
)  # fmt: skip
def test_keep_alive_is_the_idle_ttl(keep_alive: Any, ttl: float | None) -> None:
    assert ChatRequest(model="m", keep_alive=keep_alive).ttl() == ttl


def test_version_tags_and_show() -> None:
    with scripted_server(ScriptedRunner()) as base:
        version = httpx.get(base + "/api/version", timeout=30).json()["version"]
        tags = httpx.get(base + "/api/tags", timeout=30).json()["models"]
        show = httpx.post(base + "/api/show", json={"model": "scripted:latest"}, timeout=30)
        # a lookup never falls back to the default model (strict names or not)
        unknown = httpx.post(base + "/api/show", json={"model": "nope"}, timeout=30)
    assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
    assert "nope" in unknown.json()["error"]
    major, minor, _patch = (int(p) for p in version.split("."))
    assert (major, minor) >= (0, 6)
    assert [t["name"] for t in tags] == ["scripted"]
    assert len(tags[0]["digest"]) == 64 and tags[0]["details"]["format"] == "gguf"
    assert show.status_code == 200, show.text
    assert "completion" in show.json()["capabilities"] and "tools" in show.json()["capabilities"]
    assert "temperature" in show.json()["parameters"]


def _file_server_handler(data: bytes) -> Any:
    def handle(h: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return handle


def test_pull_a_url_streams_progress_then_success(tmp_path: Any) -> None:
    data = b"GGUF" + bytes(range(256)) * 400
    settings = {"models_dir": str(tmp_path), "download_allow_private": True}
    with (
        http_server(_file_server_handler(data)) as files,
        scripted_server(ScriptedRunner(), **settings) as base,
    ):
        r = httpx.post(base + "/api/pull", json={"model": f"{files}/tiny.gguf"}, timeout=30)
        again = httpx.post(
            base + "/api/pull", json={"name": f"{files}/tiny.gguf", "stream": False}, timeout=30
        )
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    got = lines(r.content)
    assert got[0] == {"status": "pulling manifest"} and got[-1] == {"status": "success"}
    progress = [g for g in got if "total" in g]
    assert progress and progress[-1]["completed"] == progress[-1]["total"] == len(data)
    assert (tmp_path / "tiny.gguf").read_bytes() == data
    assert again.json() == {"status": "success"}  # already there


def test_pull_brings_the_projector_the_repo_offers(tmp_path: Any) -> None:
    data = b"GGUF" + bytes(range(256)) * 400
    tree = [
        {"type": "file", "path": p, "size": len(data)} for p in ("tiny.gguf", "mmproj-f16.gguf")
    ]
    serve_file = _file_server_handler(data)

    def handle(h: Any) -> None:
        if not h.path.startswith("/api/models/o/r/tree/main"):
            return serve_file(h)
        body = json.dumps(tree).encode()
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    settings = {"models_dir": str(tmp_path), "download_allow_private": True}
    with http_server(handle) as files, scripted_server(ScriptedRunner(), **settings) as base:
        url = f"{files}/o/r/resolve/main/tiny.gguf"
        r = httpx.post(base + "/api/pull", json={"model": url}, timeout=30)
    progress = [g for g in lines(r.content) if "total" in g]
    assert progress[-1]["completed"] == progress[-1]["total"] == 2 * len(data)
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["mmproj-f16.gguf", "tiny.gguf"]


def test_pull_refuses_registry_names_and_private_addresses(tmp_path: Any) -> None:
    with scripted_server(ScriptedRunner(), models_dir=str(tmp_path)) as base:
        name = httpx.post(base + "/api/pull", json={"model": "llama3.2"}, timeout=30)
        private = httpx.post(
            base + "/api/pull", json={"model": "http://127.0.0.1:9/x.gguf"}, timeout=30
        )
    assert name.status_code == 400 and "not a URL" in name.json()["error"]
    assert private.status_code == 400 and set(private.json()) == {"error"}
    assert "127.0.0.1" in private.json()["error"]
