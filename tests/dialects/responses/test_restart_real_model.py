"""A background response the server was generating when it was killed (SIGKILL, no
shutdown): after a restart on the same store it reads failed with a reason, and a
client resuming its stream gets the terminal event instead of waiting forever."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.real_server import QUIET
from tests.support.servers import serve_process, serve_process_handle

pytestmark = pytest.mark.integration


def test_a_killed_servers_background_response_reads_failed(tmp_path: Path) -> None:
    store = str(tmp_path / "store.db")
    args = ("--parallel", "1", "--store", store, *QUIET)
    with serve_process_handle(*args) as (base, proc):
        created = httpx.post(
            f"{base}/v1/responses",
            json={
                "input": "Count from one to ten thousand, one number a line.",
                "background": True,
                "max_output_tokens": 4000,
            },
            timeout=30,
        ).json()
        response_id = created["id"]
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/v1/responses/{response_id}").json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with serve_process(*args) as base:
        after = httpx.get(f"{base}/v1/responses/{response_id}", timeout=30).json()
        resumed = httpx.get(
            f"{base}/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": 5},
            timeout=30,
        )
    assert created["status"] == "queued"
    assert after["status"] == "failed"
    assert "stopped while this response was generating" in after["error"]["message"]
    frames = [f for f in resumed.text.split("\n\n") if f.startswith("event:")]
    assert len(frames) == 1 and frames[0].startswith("event: response.failed\n")
    data = json.loads(frames[0].split("data: ", 1)[1])
    assert data["sequence_number"] == 6 and data["response"]["status"] == "failed"
