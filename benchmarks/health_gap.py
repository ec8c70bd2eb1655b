"""How long /health goes unanswered while one heavy request is validated.

The target: no gap over 100 ms in /health answers while any single
request is parsed, validated, templated, tokenized or has its grammar built.
This starts a real server (the embedded model, ``--threads 1``), polls
``/health`` every 5 ms from a thread of its own, sends each heavy request in
turn, and reports the longest gap between two answers during each one.

Usage::

    .venv/bin/python benchmarks/health_gap.py [--rounds 3] [--url http://127.0.0.1:8080]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from harness.report import render_table
from harness.servers import SLUICE, Server, free_port, health_gaps_during, models_env

TINY = '{"role":"user","content":"hi"}'


def _messages(n: int) -> bytes:
    return ('{"messages":[' + ",".join([TINY] * n) + '],"max_tokens":1}').encode()


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _schema(schema: dict[str, Any]) -> bytes:
    """A one-token chat request whose answer must follow ``schema``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    messages = [{"role": "user", "content": "hi"}]
    return _json({"messages": messages, "max_tokens": 1, "response_format": fmt})


CASES: dict[str, tuple[str, Callable[[], bytes]]] = {
    "100k tiny messages (3 MB, over --max-messages)": (
        "/v1/chat/completions",
        lambda: _messages(100_000),
    ),
    "240k tiny messages (7.4 MB)": ("/v1/chat/completions", lambda: _messages(240_000)),
    "4,000 messages (at the limit, templated)": (
        "/v1/chat/completions",
        lambda: _messages(4_000),
    ),
    "one 4 MB message (tokenized, too long)": (
        "/v1/chat/completions",
        lambda: _json(
            {"messages": [{"role": "user", "content": "hello world. " * 300_000}], "max_tokens": 1}
        ),
    ),
    "100k <|im_end|> in a text prompt": (
        "/v1/completions",
        lambda: _json({"prompt": "<|im_end|>" * 100_000, "max_tokens": 1}),
    ),
    "JSON nested 100,000 deep": (
        "/v1/completions",
        lambda: b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ),
    "schema at the grammar budget": (
        "/v1/chat/completions",
        lambda: _schema({"type": "string", "minLength": 4000, "maxLength": 4000}),
    ),
    "schema with maxLength 10^9": (
        "/v1/chat/completions",
        lambda: _schema({"type": "string", "maxLength": 10**9}),
    ),
}


def measure(base: str, path: str, raw: bytes) -> tuple[int, float, float]:
    """(status, seconds the request took, longest /health gap in seconds)."""

    def send() -> tuple[int, float]:
        t0 = time.monotonic()
        r = httpx.post(
            base + path, content=raw, headers={"content-type": "application/json"}, timeout=600
        )
        return r.status_code, time.monotonic() - t0

    (status, took), gaps = health_gaps_during(base, send, settle=0.3)
    return status, took, max(gaps)


@contextlib.contextmanager
def server(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="sluice-health-gap-") as tmp:
        port = free_port()
        cmd = [*SLUICE, "--port", str(port), "--threads", "1", "--log-level", "warning"]
        models = Path(tmp) / "models"  # empty: the user's own models stay out
        models.mkdir()
        log = Path(tmp) / "sluice.log"
        with Server("sluice", cmd, port, log, env=models_env(models)) as srv:
            yield srv.base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", help="measure a running server instead of starting one")
    args = parser.parse_args()
    rows = []
    with server(args.url) as base:
        for name, (path, make) in CASES.items():
            raw = make()
            runs = [measure(base, path, raw) for _ in range(args.rounds)]
            gaps = [g for _, _, g in runs]
            rows.append(
                (
                    name,
                    f"{len(raw) / 1e6:.2f}",
                    runs[0][0],
                    f"{statistics.median(t for _, t, _ in runs):.2f}",
                    f"{statistics.median(gaps) * 1000:.0f}",
                    f"{max(gaps) * 1000:.0f}",
                )
            )
            print(" | ".join(str(x) for x in rows[-1]), flush=True)
    print()
    head = ["request", "MB", "status", "took s (median)", "max /health gap ms (median)", "(worst)"]
    print(render_table(head, [[str(x) for x in row] for row in rows], markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
