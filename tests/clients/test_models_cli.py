"""``sluice models`` against a real server (the real models, a real file server):
the listing, a load whose progress bar is fed by the server's load events, unload,
and a download whose bar moves with the bytes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.real_server import QUIET
from tests.support.servers import http_server, serve_process

pytestmark = pytest.mark.integration

GEMMA = "gemma-3-270m"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    models = tmp_path_factory.mktemp("models")
    env = {"SLUICE_MODELS_DIR": str(models)}
    args = ("--parallel", "1", "--ctx", "512", "--download-allow-private", *QUIET)
    with serve_process(*args, env=env) as url:
        yield url, models


def cli(url: str, *args: str, tty: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    if tty:  # rich draws its live progress as for a terminal
        env |= {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"}
    else:
        env.pop("FORCE_COLOR", None)
    cmd = [sys.executable, "-m", "sluice", "models", "--url", url, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    done.stdout = ANSI.sub("", done.stdout)  # colours and cursor moves: the text is checked
    return done


def test_list_load_unload(server: tuple[str, Path]) -> None:
    url, _ = server
    listed = cli(url, "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:] if line.strip()}
    assert "loaded" in rows["smollm2-135m-instruct"] and "not loaded" in rows[GEMMA]
    loaded = cli(url, "load", "gemma3-270m", "--context-length", "256", tty=True)
    assert loaded.returncode == 0, loaded.stderr
    assert re.search(r"loaded gemma-3-270m in [0-9.]+ s \(context 256\)", loaded.stdout)
    # The bar was redrawn as the server reported progress, up to 100%.
    shown = [int(p) for p in re.findall(r"(\d+)%", loaded.stdout)]
    assert len(set(shown)) >= 2 and shown[-1] == 100, loaded.stdout[-500:]
    assert "loaded" in cli(url, "list").stdout.split(GEMMA, 1)[1].splitlines()[0]
    unloaded = cli(url, "unload", GEMMA)
    assert unloaded.returncode == 0 and f"unloaded {GEMMA}" in unloaded.stdout
    missing = cli(url, "unload", GEMMA)
    assert missing.returncode == 1 and "No model instance" in missing.stdout


def test_the_load_stream_carries_the_servers_progress(server: tuple[str, Path]) -> None:
    url, _ = server
    body = {"model": "gemma3-270m", "context_length": 256}
    with httpx.stream(
        "POST",
        f"{url}/api/v1/models/load",
        json=body,
        headers={"accept": "text/event-stream"},
        timeout=120,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [
            (e.split("\n", 1)[0].removeprefix("event: "), json.loads(e.split("data: ", 1)[1]))
            for e in r.read().decode().strip().split("\n\n")
        ]
    kinds = [k for k, _ in events]
    assert kinds[0] == "model_load.start" and kinds[-1] == "model_load.end"
    progress = [d["progress"] for k, d in events if k == "model_load.progress"]
    assert len(progress) >= 3 and progress == sorted(progress) and progress[-1] == 1.0
    assert events[-1][1]["status"] == "loaded" and events[-1][1]["instance_id"] == GEMMA
    httpx.post(f"{url}/api/v1/models/unload", json={"instance_id": GEMMA}, timeout=60)
    # A refusal before the stream is LM Studio's error, with its status.
    r = httpx.post(
        f"{url}/api/v1/models/load",
        json={"model": "nope"},
        headers={"accept": "text/event-stream"},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["type"]


def _slow_file(data: bytes, chunk: int, pause: float) -> Any:
    def handle(h: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        for i in range(0, len(data), chunk):
            h.wfile.write(data[i : i + chunk])
            h.wfile.flush()
            time.sleep(pause)

    return handle


def test_download_shows_the_bar_moving(server: tuple[str, Path]) -> None:
    url, models = server
    data = b"GGUF" + bytes(range(256)) * 8000  # ~2 MB, in 20 pieces 0.1 s apart
    with http_server(_slow_file(data, len(data) // 20 + 1, 0.1)) as files:
        done = cli(url, "download", f"{files}/moving.gguf", tty=True)
        again = cli(url, "download", f"{files}/moving.gguf")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "downloaded moving" in done.stdout
    # rich redrew the bar with the bytes as they came (e.g. "0.8/2.0 MB").
    amounts = re.findall(r"([0-9.]+)/([0-9.]+) MB", done.stdout)
    assert len({a for a, _ in amounts}) >= 3, done.stdout[-800:]
    assert amounts[-1][0] == amounts[-1][1]
    assert (models / "moving.gguf").read_bytes() == data
    assert again.returncode == 0 and "already downloaded" in again.stdout
    bad = cli(url, "download", "http://127.0.0.1:9/nothing.gguf")
    assert bad.returncode == 1 and "error:" in bad.stdout
