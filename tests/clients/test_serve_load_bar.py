"""``sluice serve`` on a terminal draws a progress bar while the default model loads
(a real pty, the real model); without a terminal it writes none."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.support.servers import free_port

pytestmark = pytest.mark.integration


def serve_output(tty: bool) -> str:
    """What ``sluice serve`` writes until it answers /health, then it is stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "sluice", "serve", "--port", str(port), "--threads", "1"]
    cmd += ["--parallel", "1", "--ctx", "256", "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as empty:
        env = {
            **os.environ,
            "SLUICE_MODELS_DIR": empty,
            "SLUICE_STORE": os.path.join(empty, "store.db"),
            "COLUMNS": "100",
        }
        main, child = pty.openpty() if tty else os.pipe()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=env)
        os.close(child)
        out = b""
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if select.select([main], [], [], 0.1)[0]:
                    try:
                        out += os.read(main, 65536)
                    except OSError:  # the pty closes with the child
                        break
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
            while select.select([main], [], [], 0.1)[0]:
                try:
                    out += os.read(main, 65536)
                except OSError:
                    break
        finally:
            proc.terminate()
            proc.wait(30)
            os.close(main)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode("utf-8", "replace"))


def test_a_terminal_sees_the_default_model_load() -> None:
    text = serve_output(tty=True)
    assert "loading smollm2-135m-instruct" in text, text[-1000:]
    shown = [int(p) for p in re.findall(r"(\d+)%", text)]
    assert len(set(shown)) >= 2 and max(shown) == 100, text[-1000:]


def test_no_bar_without_a_terminal() -> None:
    text = serve_output(tty=False)
    assert "loading smollm2-135m-instruct" not in text and "%" not in text, text[-1000:]
