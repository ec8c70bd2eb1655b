"""Requests in flight on the real model: GET /v1/requests lists each key's own (a key
named admin sees all), under the id the client already has, with its state; POST
/v1/requests/{id}/cancel ends it in the client's own dialect and frees the slot."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.support.real_server import QUIET
from tests.support.servers import gateway_in_front, serve_process

pytestmark = pytest.mark.integration

ALICE, BOB, ADMIN = "alice-key-0123456789", "bob-key-0123456789", "admin-key-0123456789"
KEYS = {"SLUICE_API_KEYS": f"alice:{ALICE},bob:{BOB},admin:{ADMIN}"}
LONG = "Count from 1 to 1000, separated by commas."


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serve_process("--parallel", "1", "--ctx", "4096", *QUIET, env=KEYS) as base:
        yield base


@pytest.fixture
async def client(server: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        yield c


async def listed(client: httpx.AsyncClient, key: str) -> list[dict[str, Any]]:
    r = await client.get("/v1/requests", headers=auth(key))
    assert r.status_code == 200
    data: list[dict[str, Any]] = r.json()["data"]
    return data


async def until(check: Any, within: float = 30.0) -> Any:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        value = await check()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "not seen in time"
        await asyncio.sleep(0.05)


class Streamed:
    """A streamed request read on a task: its SSE data lines as they come."""

    def __init__(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str):
        self.lines: list[str] = []
        self.status = 0
        self.task = asyncio.create_task(self._read(client, path, body, key))

    async def _read(
        self, client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str
    ) -> None:
        async with client.stream("POST", path, json=body, headers=auth(key)) as r:
            self.status = r.status_code
            async for line in r.aiter_lines():
                if line:
                    self.lines.append(line)

    def data(self) -> list[Any]:
        out = []
        for line in self.lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
            elif line.startswith("{"):
                out.append(json.loads(line))  # Ollama's NDJSON
        return out


def chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


async def test_each_key_sees_its_own_and_the_owner_cancels(client: httpx.AsyncClient) -> None:
    a = Streamed(client, "/v1/chat/completions", chat_body(stream=True), ALICE)
    await until(lambda: asyncio.sleep(0, len(a.data()) > 3))
    chunk_id = a.data()[0]["id"]
    assert chunk_id.startswith("chatcmpl-")

    (mine,) = await listed(client, ALICE)
    assert mine["id"] == chunk_id
    assert (mine["key"], mine["dialect"]) == ("alice", "openai")
    assert mine["slot"].startswith("smollm2")
    assert mine["model"] == a.data()[0]["model"]
    assert mine["state"] == "generating" and mine["generated_tokens"] >= 1
    assert mine["prompt_tokens"] > 5 and mine["age_seconds"] > 0
    assert await listed(client, BOB) == []
    assert [r["id"] for r in await listed(client, ADMIN)] == [chunk_id]

    # Someone else's request is unknown to them; its owner stops it.
    other = await client.post(f"/v1/requests/{chunk_id}/cancel", headers=auth(BOB))
    assert other.status_code == 404 and other.json()["error"]["code"] == "request_not_found"
    done = await client.post(f"/v1/requests/{chunk_id}/cancel", headers=auth(ALICE))
    assert done.status_code == 200 and done.json()["state"] == "cancelled"
    await asyncio.wait_for(a.task, 10)
    last = a.data()[-1]
    assert last["error"]["code"] == "request_cancelled", last
    assert "cancelled by the key 'alice'" in last["error"]["message"]
    assert await listed(client, ADMIN) == []
    again = await client.post(f"/v1/requests/{chunk_id}/cancel", headers=auth(ALICE))
    assert again.status_code == 404
    # The slot is free: a new request is answered at once.
    quick = await client.post(
        "/v1/chat/completions",
        json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers=auth(ALICE),
    )
    assert quick.status_code == 200


async def test_queued_requests_of_every_dialect_and_admin_cancels(
    client: httpx.AsyncClient,
) -> None:
    first = Streamed(client, "/v1/chat/completions", chat_body(stream=True), ALICE)
    await until(lambda: asyncio.sleep(0, len(first.data()) > 2))
    # --parallel 1: these wait behind the first.
    anthropic = Streamed(
        client,
        "/v1/messages",
        {
            "model": "smollm2",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
        },
        BOB,
    )
    responses = Streamed(
        client,
        "/v1/responses",
        {"model": "smollm2", "input": "Hi", "max_output_tokens": 64, "stream": True},
        BOB,
    )
    ollama = Streamed(
        client,
        "/api/chat",
        {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]},
        BOB,
    )
    plain = asyncio.create_task(
        client.post("/v1/chat/completions", json=chat_body(), headers=auth(BOB))
    )
    unstored = asyncio.create_task(  # not streamed, not stored: no run behind it
        client.post(
            "/v1/responses",
            json={"model": "smollm2", "input": "Hi", "max_output_tokens": 8, "store": False},
            headers=auth(ALICE),
        )
    )

    async def six() -> list[dict[str, Any]] | None:
        entries = await listed(client, ADMIN)
        return entries if len(entries) == 6 else None

    entries = await until(six)
    (quiet,) = [e for e in entries if e["dialect"] == "responses" and e["key"] == "alice"]
    assert quiet["id"].startswith("resp_") and quiet["state"] == "queued"
    r = await client.post(f"/v1/requests/{quiet['id']}/cancel", headers=auth(ALICE))
    assert r.status_code == 200
    answered = await asyncio.wait_for(unstored, 10)
    assert answered.status_code == 499, answered.text
    entries = [e for e in entries if e["id"] != quiet["id"]]
    by_dialect = {e["dialect"]: e for e in entries if e["key"] == "bob"}
    assert set(by_dialect) == {"anthropic", "responses", "ollama", "openai"}
    assert all(e["state"] == "queued" for e in by_dialect.values())
    assert by_dialect["anthropic"]["id"].startswith("msg_")
    assert by_dialect["responses"]["id"].startswith("resp_")
    assert by_dialect["ollama"]["id"].startswith("req_")
    assert by_dialect["openai"]["id"].startswith("chatcmpl-")
    assert entries[0]["key"] == "alice" and entries[0]["state"] == "generating"  # oldest first
    assert len(await listed(client, BOB)) == 4

    for entry in by_dialect.values():  # the admin key cancels anyone's
        r = await client.post(f"/v1/requests/{entry['id']}/cancel", headers=auth(ADMIN))
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
    for streamed in (anthropic, responses, ollama):
        await asyncio.wait_for(streamed.task, 10)
    # Each client hears it in its own dialect.
    assert anthropic.data()[-1]["type"] == "error"
    assert anthropic.data()[-1]["error"]["message"].startswith("This request was cancelled")
    # A Responses run cancelled from any path ends with its own terminal event.
    assert responses.data()[-1]["type"] == "response.cancelled"
    assert responses.data()[-1]["response"]["status"] == "cancelled"
    assert "cancelled" in ollama.data()[-1]["error"]
    answered = await asyncio.wait_for(plain, 10)
    assert answered.status_code == 499
    assert answered.json()["error"]["code"] == "request_cancelled"

    assert [e["key"] for e in await listed(client, ADMIN)] == ["alice"]
    r = await client.post(f"/v1/requests/{entries[0]['id']}/cancel", headers=auth(ADMIN))
    assert r.status_code == 200
    await asyncio.wait_for(first.task, 10)
    assert await listed(client, ADMIN) == []


def sluice(server: str, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sluice", "ps", "--url", server, "--api-key", key, *args]
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)


async def test_sluice_ps_lists_and_cancels(client: httpx.AsyncClient, server: str) -> None:
    assert "no requests in flight" in (await asyncio.to_thread(sluice, server, ALICE)).stdout
    a = Streamed(client, "/v1/chat/completions", chat_body(stream=True), ALICE)
    await until(lambda: asyncio.sleep(0, len(a.data()) > 2))
    chunk_id = a.data()[0]["id"]
    shown = await asyncio.to_thread(sluice, server, ADMIN)
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if chunk_id in line)
    assert "generating" in row and "openai" in row and "alice" in row
    refused = await asyncio.to_thread(sluice, server, BOB, "--cancel", chunk_id)
    assert refused.returncode == 1 and f"No request '{chunk_id}'" in refused.stdout
    done = await asyncio.to_thread(sluice, server, ALICE, "--cancel", chunk_id)
    assert done.returncode == 0 and f"cancelled {chunk_id}" in done.stdout
    await asyncio.wait_for(a.task, 10)
    assert a.data()[-1]["error"]["code"] == "request_cancelled"


# -- answers passed through unchanged from an upstream (a real second sluice) ----------


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve_process("--parallel", "1", "--ctx", "4096", *QUIET) as base:
        yield base


@pytest.fixture(scope="module")
def gateway(upstream: str) -> Iterator[str]:
    with gateway_in_front(upstream, native_apis=("anthropic",)) as base:
        yield base


async def test_passed_through_answers_are_in_flight_under_the_upstreams_ids(
    upstream: str, gateway: str
) -> None:
    async with (
        httpx.AsyncClient(base_url=gateway, timeout=60) as front,
        httpx.AsyncClient(base_url=upstream, timeout=60) as back,
    ):
        a = Streamed(front, "/v1/chat/completions", chat_body(model="up-smollm2", stream=True), "")
        await until(lambda: asyncio.sleep(0, len(a.data()) > 3))
        chunk_id = a.data()[0]["id"]
        (entry,) = await listed(front, "")
        assert (entry["id"], entry["slot"], entry["replica"]) == (chunk_id, "up", upstream)
        assert entry["state"] == "generating" and entry["generated_tokens"] >= 2
        # the upstream lists it under the same id: one name end to end
        assert [e["id"] for e in await listed(back, "")] == [chunk_id]

        # --parallel 1 upstream: these wait there. The gateway lists them at once, queued,
        # under ids of its own until the upstream's first event names them.
        message = Streamed(
            front,
            "/v1/messages",
            {
                "model": "native-smollm2",
                "max_tokens": 1000,
                "messages": [{"role": "user", "content": LONG}],
                "ignore_eos": True,
                "stream": True,
            },
            "",
        )
        plain = asyncio.create_task(
            front.post("/v1/chat/completions", json=chat_body(model="up-smollm2"))
        )

        async def three() -> list[dict[str, Any]] | None:
            entries = await listed(front, "")
            return entries if len(entries) == 3 else None

        entries = await until(three)
        waiting = {e["dialect"]: e for e in entries if e["id"] != chunk_id}
        assert set(waiting) == {"openai", "anthropic"}
        assert all(e["state"] == "queued" and e["id"].startswith("req_") for e in waiting.values())
        assert waiting["anthropic"]["slot"] == "native"

        # Cancelled before the upstream answered at all: a 499 in the dialect's shape.
        r = await front.post(f"/v1/requests/{waiting['openai']['id']}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        answered = await asyncio.wait_for(plain, 10)
        assert answered.status_code == 499
        assert answered.json()["error"]["code"] == "request_cancelled"

        # Cancelled mid-stream: the client's stream ends with the error frame.
        r = await front.post(f"/v1/requests/{chunk_id}/cancel")
        assert r.status_code == 200
        await asyncio.wait_for(a.task, 10)
        assert a.data()[-1]["error"]["code"] == "request_cancelled"

        # The upstream now answers the Messages request: its first event names it.
        async def named() -> dict[str, Any] | None:
            entries = await listed(front, "")
            return entries[0] if entries and entries[0]["id"].startswith("msg_") else None

        entry = await until(named)
        assert entry["dialect"] == "anthropic"
        assert message.data()[0]["message"]["id"] == entry["id"]
        r = await front.post(f"/v1/requests/{entry['id']}/cancel")
        assert r.status_code == 200
        await asyncio.wait_for(message.task, 10)
        assert message.data()[-1]["type"] == "error"
        assert message.data()[-1]["error"]["message"].startswith("This request was cancelled")
        assert await listed(front, "") == []
        # the gateway closed its upstream requests: the upstream stops generating too
        assert await until(lambda: _empty(back))


async def _empty(client: httpx.AsyncClient) -> bool:
    return await listed(client, "") == []
