"""Servers under test as subprocesses: sluice, llama.cpp's llama-server, LiteLLM.

Each runs on a loopback port (``free_port``), its output in a log file (never a pipe
nobody drains), and counts as up once its health path answers 200. ``close`` sends
SIGTERM, then SIGKILL if it does not stop.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypeVar

import httpx

from harness import REPO, model_path, prog

T = TypeVar("T")

SLUICE = [sys.executable, "-m", "sluice", "serve"]  # then its flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def models_env(models_dir: Path | str) -> dict[str, str]:
    """The environment with ``SLUICE_MODELS_DIR`` set: an empty folder keeps the user's
    own models out of sluice's catalog."""
    return {**os.environ, "SLUICE_MODELS_DIR": str(models_dir)}


def llama_server_cmd(
    binary: Path | str,
    port: int,
    threads: int,
    parallel: int,
    ctx: int,
    *extra: str,
    model: Path | None = None,
) -> list[str]:
    """llama-server on the embedded SmolLM2 with ``parallel`` slots of ``ctx`` tokens each
    (its ``-c`` is the total over the slots), ``extra`` flags, on ``port``."""
    gguf = model if model is not None else model_path()
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(parallel)]
    return [*cmd, "-c", str(parallel * ctx), *extra, "--host", "127.0.0.1", "--port", str(port)]


class Server:
    """A server process logging to ``log``, up once ``health`` answers 200 (or gone:
    the script exits naming the log)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log: Path,
        *,
        health: str = "/health",
        env: dict[str, str] | None = None,
        cwd: Path | str = REPO,
        timeout: float = 180.0,
    ) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, Path(log)
        self.base = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:  # the child writes to its own copy of the descriptor
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env
            )
        self.pid = self.proc.pid
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base + health, timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        self.close()
        sys.exit(f"{prog()}: {name} did not come up (rc {self.proc.returncode}), see {log}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, path: str, timeout: float = 10.0) -> Any:
        return http_get_json(self.base + path, timeout)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def health(self) -> Any:
        return self.get("/health")

    def busy(self) -> bool:
        """A request active or queued (sluice's ``/health`` slots)."""
        slots = self.health()["slots"]
        return bool(slots["active"] or slots["queued"])

    def wait_idle(self, timeout: float = 60.0, poll: float = 0.05, settle: float = 0.0) -> None:
        """Until nothing runs or waits, then ``settle`` seconds more."""
        deadline = time.monotonic() + timeout
        while self.busy():
            if time.monotonic() > deadline:
                sys.exit(f"{prog()}: {self.name} stays busy")
            time.sleep(poll)
        if settle:
            time.sleep(settle)

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def close(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` s: its exit code, None if killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


class LlamaServer(Server):
    """llama.cpp's llama-server: busy while one of its ``/slots`` is processing."""

    def busy(self) -> bool:
        return any(s.get("is_processing") for s in self.get("/slots"))


def health_gaps_during(
    base: str, send: Callable[[], T], settle: float = 0.2
) -> tuple[T, list[float]]:
    """Run ``send()`` while polling ``/health`` every 5 ms from another thread.

    Returns what ``send()`` returned and the gaps between consecutive /health answers
    (the longest is how long the server could not answer).
    """
    gaps: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base, timeout=30) as client:  # one kept-alive connection
            last = time.monotonic()
            while not stop.is_set():
                assert client.get("/health").status_code == 200
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(settle)
    try:
        result = send()
    finally:
        time.sleep(settle)
        stop.set()
        poller.join(30)
    return result, gaps
