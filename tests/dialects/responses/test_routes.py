"""/v1/responses on the real app around a scripted runner: resume after a dropped
stream, background runs, cancel, the grace period, what is stored and for whom, and
errors before the stream."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.support.fakes import EOS, ScriptedRunner
from tests.support.helpers import scripted_server

RESPONSES = "/v1/responses"
SLOW = [b"w"] * 40 + [EOS]


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in raw.split(b"\n\n")[:-1]:
        if frame.startswith(b":"):
            continue
        name, data = frame.split(b"\n")
        parsed = json.loads(data[6:])
        assert parsed["type"] == name[7:].decode()
        out.append(parsed)
    return out


def create(base: str, **body: Any) -> httpx.Response:
    return httpx.post(
        base + RESPONSES, json={"model": "scripted", "input": "Hi", **body}, timeout=30
    )


def test_a_dropped_stream_resumes_where_it_left_off() -> None:
    runner = ScriptedRunner(default=SLOW, step_delay=0.02)
    with scripted_server(runner, resume_grace=30) as base:
        seen: list[dict[str, Any]] = []
        with httpx.stream(
            "POST",
            base + RESPONSES,
            json={"model": "scripted", "input": "Hi", "stream": True},
            timeout=30,
        ) as r:
            buffer = b""
            for chunk in r.iter_raw():
                buffer += chunk
                if buffer.count(b"response.output_text.delta") >= 3:
                    break
        seen = events(buffer[: buffer.rfind(b"\n\n") + 2])
        last = seen[-1]["sequence_number"]
        response_id = seen[0]["response"]["id"]
        resumed = httpx.get(
            f"{base}{RESPONSES}/{response_id}",
            params={"stream": "true", "starting_after": last},
            timeout=30,
        )
        rest = events(resumed.content)
        stored = httpx.get(f"{base}{RESPONSES}/{response_id}", timeout=30).json()
    # The replay starts right after the last event seen, and the run went on meanwhile.
    assert rest[0]["sequence_number"] == last + 1
    numbers = [e["sequence_number"] for e in seen + rest]
    assert numbers == list(range(len(numbers)))
    assert rest[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in seen + rest if e["type"] == "response.output_text.delta")
    assert text == "w" * 40 == rest[-1]["response"]["output"][0]["content"][0]["text"]
    assert stored["status"] == "completed" and stored["id"] == response_id


def test_background_returns_at_once_and_can_be_cancelled() -> None:
    runner = ScriptedRunner(default=[b"w"] * 500 + [EOS], step_delay=0.02)
    with scripted_server(runner) as base:
        started = time.monotonic()
        r = create(base, background=True)
        assert time.monotonic() - started < 2
        body = r.json()
        assert r.status_code == 200 and body["status"] == "queued" and body["background"]
        time.sleep(0.3)
        live = httpx.get(f"{base}{RESPONSES}/{body['id']}", timeout=30).json()
        assert live["status"] == "in_progress"
        cancelled = httpx.post(f"{base}{RESPONSES}/{body['id']}/cancel", timeout=30).json()
        assert cancelled["status"] == "cancelled"
        text = cancelled["output"][0]["content"][0]["text"]
        assert 0 < len(text) < 500  # it stopped part way
        again = httpx.get(f"{base}{RESPONSES}/{body['id']}", timeout=30).json()
        # A foreground response cannot be cancelled.
        done = create(base, input="x").json()
        refused = httpx.post(f"{base}{RESPONSES}/{done['id']}/cancel", timeout=30)
    assert again["status"] == "cancelled"
    assert refused.status_code == 400


def test_an_abandoned_foreground_stream_is_cancelled_after_the_grace() -> None:
    runner = ScriptedRunner(default=[b"w"] * 2000 + [EOS], step_delay=0.01)
    with scripted_server(runner, resume_grace=0.5) as base:
        with httpx.stream(
            "POST",
            base + RESPONSES,
            json={"model": "scripted", "input": "Hi", "stream": True},
            timeout=30,
        ) as r:
            first = next(r.iter_raw())
        response_id = events(first[: first.find(b"\n\n") + 2])[0]["response"]["id"]
        deadline = time.monotonic() + 10
        status = ""
        while time.monotonic() < deadline and status != "cancelled":
            time.sleep(0.2)
            status = httpx.get(f"{base}{RESPONSES}/{response_id}", timeout=30).json()["status"]
    assert status == "cancelled"


def test_store_false_is_not_kept_and_another_key_sees_nothing() -> None:
    keys = "alice:sk-alice-0001,bob:sk-bob-000002"
    with scripted_server(ScriptedRunner(), api_keys=keys) as base:
        alice = {"Authorization": "Bearer sk-alice-0001"}
        bob = {"Authorization": "Bearer sk-bob-000002"}
        kept = httpx.post(
            base + RESPONSES, json={"model": "scripted", "input": "Hi"}, headers=alice, timeout=30
        ).json()
        gone = httpx.post(
            base + RESPONSES,
            json={"model": "scripted", "input": "Hi", "store": False},
            headers=alice,
            timeout=30,
        ).json()
        assert httpx.get(f"{base}{RESPONSES}/{kept['id']}", headers=alice).status_code == 200
        assert httpx.get(f"{base}{RESPONSES}/{gone['id']}", headers=alice).status_code == 404
        assert httpx.get(f"{base}{RESPONSES}/{kept['id']}", headers=bob).status_code == 404
        follow = {"model": "scripted", "input": "more", "previous_response_id": kept["id"]}
        assert httpx.post(base + RESPONSES, json=follow, headers=bob).status_code == 404
        assert httpx.post(base + RESPONSES, json=follow, headers=alice).status_code == 200
        items = httpx.get(f"{base}{RESPONSES}/{kept['id']}/input_items", headers=alice).json()
        deleted = httpx.delete(f"{base}{RESPONSES}/{kept['id']}", headers=alice).json()
        after = httpx.get(f"{base}{RESPONSES}/{kept['id']}", headers=alice).status_code
    assert [i["type"] for i in items["data"]] == ["message"] and items["data"][0]["id"]
    assert deleted == {"id": kept["id"], "object": "response.deleted", "deleted": True}
    assert after == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        # (a string where the list goes was a TypeError and a 500)
        ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary"),
        ({"input": [{"type": "reasoning", "content": {"text": "x"}}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}
                ]
            },
            "input",
        ),
    ],
)
def test_errors_before_the_stream_name_the_field(body: dict[str, Any], param: str) -> None:
    with scripted_server(ScriptedRunner()) as base:
        r = create(base, stream=True, **body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_a_prompt_over_the_context_is_a_400_before_the_stream() -> None:
    with scripted_server(ScriptedRunner(n_ctx_seq=64)) as base:
        r = create(base, input="x" * 200, stream=True)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"  # this dialect's name for the prompt


def test_tools_a_local_server_cannot_run_are_accepted() -> None:
    tools = [
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch", "description": "x"},
        {"type": "local_shell"},
        {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}},
    ]
    history = [
        {
            "type": "local_shell_call",
            "id": "x",
            "call_id": "c",
            "action": {},
            "status": "completed",
        },
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    with scripted_server(ScriptedRunner(n_ctx_seq=4096)) as base:
        r = create(
            base,
            input=history,
            tools=tools,
            include=["reasoning.encrypted_content"],
            reasoning={"effort": "low", "summary": "auto"},
            truncation="auto",
            metadata={"a": "b"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == "Hello world!"


def test_what_codex_sends_is_one_system_prompt_first() -> None:
    from sluice.dialects.responses.schema import parse

    body = parse(
        {
            "model": "m",
            "stream": True,
            "store": False,
            "input": [
                {
                    "type": "message",
                    "id": "msg_a",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "Base."}],
                },
                {
                    "type": "message",
                    "id": "msg_b",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "Skills."}],
                },
                {
                    "type": "message",
                    "id": "msg_c",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": None,
                    "encrypted_content": "E",
                },
                {
                    "type": "function_call",
                    "status": "completed",
                    "id": "fc_1",
                    "name": "exec_command",
                    "arguments": "{}",
                    "call_id": "call_1",
                },
                {
                    "type": "function_call_output",
                    "id": "fco_1",
                    "call_id": "call_1",
                    "output": "ok",
                },
            ],
            "tools": [
                {"type": "namespace", "name": "multi_agent_v1", "tools": []},
                {"type": "web_search"},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {},
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
            "client_metadata": {"session_id": "s"},
        }
    )
    request = body.neutral_request([])
    assert request.messages == [
        {"role": "system", "content": "Base.\n\nSkills."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    assert request.tools is None and request.tool_choice is None
    assert body.unknown_fields() == []


def _follow_in_thread(base: str, response_id: str) -> tuple[Any, list[bytes]]:
    import threading

    got: list[bytes] = []

    def read() -> None:
        with httpx.stream(
            "GET", f"{base}{RESPONSES}/{response_id}", params={"stream": "true"}, timeout=30
        ) as r:
            got.extend(r.iter_raw())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, got


@pytest.mark.parametrize("path", ["responses", "requests"])
def test_a_cancelled_run_ends_its_followers_with_response_cancelled(path: str) -> None:
    """Cancelled from either path, the run is stored cancelled (not failed) and every
    follower's stream ends with the terminal response.cancelled."""
    runner = ScriptedRunner(default=[b"w"] * 500 + [EOS], step_delay=0.02)
    with scripted_server(runner) as base:
        body = create(base, background=True).json()
        thread, got = _follow_in_thread(base, body["id"])
        time.sleep(0.4)
        url = f"{base}/v1/{path}/{body['id']}/cancel"
        assert httpx.post(url, timeout=30).status_code == 200
        thread.join(10)
        assert not thread.is_alive(), "the follower's stream did not end"
        stored = httpx.get(f"{base}{RESPONSES}/{body['id']}", timeout=30).json()
    seen = events(b"".join(got))
    assert seen[-1]["type"] == "response.cancelled"
    assert seen[-1]["response"]["status"] == "cancelled"
    assert [e["type"] for e in seen].count("response.cancelled") == 1
    assert stored["status"] == "cancelled"


def test_a_resumed_stream_whose_events_are_gone_gets_the_terminal_event() -> None:
    with scripted_server(ScriptedRunner(), resume_grace=0) as base:
        done = create(base, input="x").json()
        time.sleep(0.1)  # past the grace: only the stored response is left
        replay = httpx.get(
            f"{base}{RESPONSES}/{done['id']}",
            params={"stream": "true", "starting_after": 3},
            timeout=30,
        )
    (only,) = events(replay.content)
    assert only["type"] == f"response.{done['status']}" and only["sequence_number"] == 4
    assert only["response"] == done
