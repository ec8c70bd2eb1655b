"""LM Studio's /api/v1/chat on the real models, with a real MCP server.

One server for the module: SmolLM2 (the default), the second packaged model
(Gemma 3 270M, given a chat template through the config file, loaded just in
time), API keys (MCP plugins need them), a store in a temporary folder, the
MCP test server (``tests/support/mcp_server.py``) over stdio as plugin
``mcp/calc``, and ephemeral servers allowed on loopback (the same server over
HTTP).
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.real_server import QUIET, parse_sse
from tests.support.servers import MCP_TEST_SERVER, mcp_http_server, serve_process

pytestmark = pytest.mark.integration

KEY = "lms-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def markers() -> Iterator[Path]:
    """Where the HTTP test server's `slow` tool leaves its marker files."""
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


@pytest.fixture(scope="module")
def mcp_url(markers: Path) -> Iterator[str]:
    with mcp_http_server({"MCP_TEST_MARKERS": str(markers)}) as url:
        yield url


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "gemma.jinja").write_text(GEMMA_TEMPLATE)
        (folder / "sluice.toml").write_text(
            '[[models]]\nname = "gemma-chat"\nsource = "gemma-3-270m"\n'
            'chat_template = "gemma.jinja"\nctx = 512\nparallel = 1\n'
        )
        (folder / "mcp.json").write_text(
            json.dumps(
                {
                    "mcpServers": {
                        "calc": {
                            "command": sys.executable,
                            "args": [MCP_TEST_SERVER, "stdio"],
                        }
                    }
                }
            )
        )
        args = [
            "--store", str(folder / "store.db"), "--config", str(folder / "sluice.toml"),
            "--mcp-config", str(folder / "mcp.json"), "--allow-mcp-plugins",
            "--allow-ephemeral-mcp", "--mcp-allow-private", "--tool-rounds", "2",
            "--parallel", "2", "--ctx", "2048", *QUIET,
        ]  # fmt: skip
        with serve_process(*args, env={"SLUICE_API_KEYS": f"tests:{KEY}"}) as url:
            yield url


def chat(base: str, **body: Any) -> httpx.Response:
    body = {"model": "smollm2", "temperature": 0, **body}
    return httpx.post(f"{base}/api/v1/chat", json=body, headers=AUTH, timeout=120)


def events(base: str, **body: Any) -> list[tuple[str, dict[str, Any]]]:
    """The named events of a streamed chat: (event name, data), the names checked against
    the data's type."""
    r = chat(base, stream=True, **body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for e in parse_sse(r.content):
        data = json.loads(e.data)
        assert data["type"] == e.event
        out.append((e.event, data))
    return out


def shape(evs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Event names with runs of deltas and progress collapsed to one."""
    names: list[str] = []
    for name, _ in evs:
        if names and names[-1] == name and name.endswith((".delta", ".progress")):
            continue
        names.append(name)
    return names


def without_timing(result: dict[str, Any]) -> dict[str, Any]:
    stats = {
        k: v
        for k, v in result["stats"].items()
        if k not in ("tokens_per_second", "time_to_first_token_seconds")
    }
    return {**{k: v for k, v in result.items() if k != "response_id"}, "stats": stats}


def test_a_streamed_chat_and_its_end_equal_the_non_streamed_body(base: str) -> None:
    evs = events(base, input="Say hello to Ada.", max_output_tokens=8)
    assert shape(evs) == [
        "chat.start",
        "prompt_processing.start",
        "prompt_processing.progress",
        "prompt_processing.end",
        "message.start",
        "message.delta",
        "message.end",
        "chat.end",
    ]
    assert evs[0][1] == {"type": "chat.start", "model_instance_id": "smollm2-135m-instruct"}
    progress = [d["progress"] for n, d in evs if n == "prompt_processing.progress"]
    assert progress == sorted(set(progress)) and progress[-1] == 1
    text = "".join(d["content"] for n, d in evs if n == "message.delta")
    result = evs[-1][1]["result"]
    assert result["output"] == [{"type": "message", "content": text}]
    assert result["stats"]["total_output_tokens"] == 8
    assert result["response_id"].startswith("resp_")
    assert "model_load_time_seconds" not in result["stats"]  # loaded already
    body = chat(base, input="Say hello to Ada.", max_output_tokens=8).json()
    assert list(body) == list(result)
    assert list(body["stats"]) == list(result["stats"])
    assert without_timing(body) == without_timing(result)
    assert body["response_id"] != result["response_id"]


def test_loading_a_model_just_in_time_streams_its_progress(base: str) -> None:
    evs = events(base, model="gemma-chat", input="Hello", max_output_tokens=4)
    names = shape(evs)
    assert names[:5] == [
        "chat.start",
        "model_load.start",
        "model_load.progress",
        "model_load.end",
        "prompt_processing.start",
    ]
    loads = [d["progress"] for n, d in evs if n == "model_load.progress"]
    assert all(a < b for a, b in itertools.pairwise(loads)) and loads[-1] == 1 and len(loads) > 2
    end = next(d for n, d in evs if n == "model_load.end")
    assert end["model_instance_id"] == "gemma-chat" and end["load_time_seconds"] > 0
    stats = evs[-1][1]["result"]["stats"]
    assert stats["model_load_time_seconds"] == end["load_time_seconds"]
    # Loaded now: the next request has no model_load events.
    again = events(base, model="gemma-chat", input="Hello", max_output_tokens=4)
    assert not any(n.startswith("model_load") for n, _ in again)
    assert "model_load_time_seconds" not in again[-1][1]["result"]["stats"]


def _tool_events(evs: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, d) for n, d in evs if n.startswith("tool_call")]


@pytest.mark.parametrize("kind", ["ephemeral", "plugin"])
def test_the_model_calls_an_mcp_tool_through_the_server(base: str, mcp_url: str, kind: str) -> None:
    if kind == "ephemeral":
        integration: Any = {
            "type": "ephemeral_mcp", "server_label": "calc", "server_url": mcp_url,
            "allowed_tools": ["add"],
        }  # fmt: skip
        provider = {"type": "ephemeral_mcp", "server_label": "calc"}
    else:
        integration = {"type": "plugin", "id": "mcp/calc", "allowed_tools": ["add"]}
        provider = {"type": "plugin", "plugin_id": "mcp/calc"}
    request = {
        "input": "What is 2 plus 3? Use the add tool.",
        "integrations": [integration],
        "tool_choice": "required",
        "max_output_tokens": 48,
        "temperature": 0,  # greedy: the streamed and whole answers below are compared
    }
    evs = events(base, **request)
    names = shape(evs)
    # The first round: a call, its arguments and its output, then the model again.
    first = names.index("tool_call.start")
    assert names[first : first + 3] == [
        "tool_call.start",
        "tool_call.arguments",
        "tool_call.success",
    ]
    assert names[first + 3] == "prompt_processing.start"  # the round with the tool's output
    assert names[-1] == "chat.end"
    start, arguments, success = (d for _, d in _tool_events(evs)[:3])
    assert start == {"type": "tool_call.start", "tool": "add", "provider_info": provider}
    args = arguments["arguments"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    assert arguments == {
        "type": "tool_call.arguments", "tool": "add", "arguments": args, "provider_info": provider,
    }  # fmt: skip
    assert success == {
        "type": "tool_call.success",
        "tool": "add",
        "arguments": args,
        "output": json.dumps(
            [{"type": "text", "text": str(args["a"] + args["b"])}], separators=(",", ":")
        ),
        "provider_info": provider,
    }
    result = evs[-1][1]["result"]
    items = result["output"]
    assert items[0] == {
        "type": "tool_call", "tool": "add", "arguments": args, "output": success["output"],
        "provider_info": provider,
    }  # fmt: skip
    # Two rounds: their output tokens add up.
    assert result["stats"]["total_output_tokens"] > 0
    # Not streamed: the same rounds, the same body as streamed again now. (Not as the
    # first run: that one prefilled the prompt, later ones find it cached and decode its
    # last token alone, whose logits llama.cpp rounds differently: at a near tie, say
    # "}" then a forced "}" against "}}", the same text comes in other tokens.)
    body = chat(base, **request).json()
    again = events(base, **request)[-1][1]["result"]
    assert without_timing(body) == without_timing(again)


def test_follow_ups_continue_any_stored_response(base: str) -> None:
    a = chat(base, input="My name is Ada.", system_prompt="Be brief.", max_output_tokens=6).json()
    b1 = chat(base, input="What is my name?", previous_response_id=a["response_id"], max_output_tokens=6).json()  # fmt: skip
    b2 = chat(base, input="What is my name?", previous_response_id=a["response_id"], max_output_tokens=6).json()  # fmt: skip
    # Two branches of one response: the same history, not one after the other.
    assert b1["stats"]["input_tokens"] == b2["stats"]["input_tokens"] > a["stats"]["input_tokens"]
    assert b1["output"] == b2["output"]
    c = chat(base, input="Thanks.", previous_response_id=b1["response_id"], max_output_tokens=6).json()  # fmt: skip
    assert c["stats"]["input_tokens"] > b1["stats"]["input_tokens"]
    assert len({a["response_id"], b1["response_id"], b2["response_id"], c["response_id"]}) == 4


def test_store_false_keeps_nothing_and_unknown_ids_are_404_before_the_stream(base: str) -> None:
    body = chat(base, input="Hi", store=False, max_output_tokens=2).json()
    assert "response_id" not in body
    for stream in (False, True):
        r = chat(base, input="Hi", previous_response_id="resp_" + "0" * 48, stream=stream)
        assert r.status_code == 404
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "response_not_found"
        assert r.json()["error"]["type"] == "invalid_request"


def test_errors_before_the_stream_are_statuses_in_lm_studio_shape(base: str) -> None:
    r = chat(base, model="no-such-model", input="Hi", stream=True)
    assert (r.status_code, r.json()["error"]["type"]) == (404, "model_not_found")
    r = chat(base, input="Hi", reasoning="high", stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"
    r = chat(base, model="gemma-3-270m", input="Hi", stream=True)  # no chat template
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_chat_template"
    bad = {"type": "ephemeral_mcp", "server_label": "x", "server_url": "http://127.0.0.1:9/mcp"}
    r = chat(base, input="Hi", integrations=[bad], stream=True)
    assert (r.status_code, r.json()["error"]["type"]) == (502, "mcp_connection_error")
    r = httpx.post(f"{base}/api/v1/chat", json={"model": "smollm2", "input": "Hi"}, timeout=30)
    assert r.status_code == 401


def wait_for(condition: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within} s: {what}")
        time.sleep(0.05)


def test_a_disconnect_mid_tool_call_leaves_nothing_running(
    base: str, mcp_url: str, markers: Path
) -> None:
    integration = {
        "type": "ephemeral_mcp", "server_label": "slow", "server_url": mcp_url,
        "allowed_tools": ["slow"],
    }  # fmt: skip
    body = {
        "model": "smollm2",
        "input": 'Call slow with seconds 30 and marker "m".',
        "integrations": [integration],
        "tool_choice": "required",
        "stream": True,
        "max_output_tokens": 256,  # room for the arguments: the call runs once they are whole
    }
    # A raw socket: the client stays connected (reading) until the call runs, then goes.
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /api/v1/chat HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    received = b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + payload)
        sock.settimeout(0.05)
        deadline = time.monotonic() + 60
        while not list(markers.glob("*.started")):  # the call runs on the MCP server
            assert time.monotonic() < deadline, f"the tool call did not start: {received[-500:]!r}"
            try:
                received += sock.recv(65536)
            except TimeoutError:
                pass
        assert b"event: tool_call.arguments" in received
        assert b"tool_call.success" not in received and b"tool_call.failure" not in received
    # The client is gone: the call is cancelled on the MCP server, the slot is free.
    wait_for(lambda: list(markers.glob("*.cancelled")), 30, "the tool call was cancelled")
    assert not list(markers.glob("*.done"))
    wait_for(
        lambda: httpx.get(f"{base}/health", timeout=5).json()["slots"]["active"] == 0,
        30,
        "the slot is free",
    )
