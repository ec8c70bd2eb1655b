#!/usr/bin/env python
"""What the key check costs a request: sluice's ``BearerAuth`` (key lookup, role, the
management-route check) in front of an app that answers at once, against the same app
with no check, in one process, over ASGI (no sockets: nothing but the check differs).

Cases, each a request the middleware sees as a client would send it:

* ``open``: no keys and a loopback bind (the app is served bare: the anchor);
* ``user chat``: a user key on ``POST /v1/chat/completions`` (looked up among
  ``--keys`` keys, its role read, the route not management);
* ``admin load``: an admin key on ``POST /api/v1/models/load`` (a management route);
* ``user refused``: a user key on that route (the 403 in its dialect's shape);
* ``keyless refused``: no keys on a non-loopback bind, the same route (403).

The cases take turns, the order rotated each round; each time is the median of
``--calls`` calls. The report gives microseconds per request, and the added cost over
``open`` (what a request pays for the check). A chat token takes milliseconds on these
machines: a check measured in microseconds, once per request, cannot move throughput.

Usage: ``.venv/bin/python benchmarks/auth.py [--rounds 5] [--calls 5000] [--keys 8]``;
writes ``benchmarks/results/auth-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harness import RESULTS
from harness.machine import machine_info
from harness.report import save_report

from sluice.server.app import management, render_error_for
from sluice.server.auth import ADMIN, USER, ApiKeys, BearerAuth

Scope = dict[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]


async def inner(scope: Scope, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


class _State:
    sluice = None


inner.state = _State()  # type: ignore[attr-defined]  # BearerAuth reads app.state


def scope(method: str, path: str, key: str | None) -> Scope:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return {"type": "http", "method": method, "path": path, "headers": headers}


async def time_calls(app: App, request: Scope, calls: int) -> float:
    """Seconds per call of ``app`` on ``request`` (the median of 5 slices)."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    slices = []
    per = max(1, calls // 5)
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(per):
            await app(dict(request), receive, send)
        slices.append((time.perf_counter() - started) / per)
    return statistics.median(slices)


def cases(n_keys: int) -> dict[str, tuple[App, Scope]]:
    names = {f"user{i}": f"sk-user-key-{i:04d}" for i in range(n_keys - 1)}
    keys = ApiKeys({**names, "ops": "sk-ops-key-0001"}, admins=["ops"])
    user = next(iter(names.values()))
    app: Any = inner  # BearerAuth wraps any ASGI app with a ``state``
    keyed = BearerAuth(app, keys, render_error_for, admin_only=management)
    keyless = BearerAuth(app, ApiKeys({}), render_error_for, admin_only=management, open_role=USER)
    load = "/api/v1/models/load"
    return {
        "open": (inner, scope("POST", "/v1/chat/completions", None)),
        "user chat": (keyed, scope("POST", "/v1/chat/completions", user)),
        "admin load": (keyed, scope("POST", load, "sk-ops-key-0001")),
        "user refused": (keyed, scope("POST", load, user)),
        "keyless refused": (keyless, scope("POST", load, None)),
    }


async def main_async(args: argparse.Namespace) -> dict[str, list[float]]:
    table = cases(args.keys)
    times: dict[str, list[float]] = {name: [] for name in table}
    order = list(table)
    for name in order:  # warm-up
        await time_calls(*table[name], 500)
    for r in range(args.rounds):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for name in rotated:
            times[name].append(await time_calls(*table[name], args.calls))
    return times


def report(times: dict[str, list[float]], args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    info = machine_info()
    base = med["open"]
    lines = [
        (
            f"The key check per request, {args.keys} keys, median of {args.rounds} rounds "
            f"of {args.calls} calls over ASGI (no sockets)."
        ),
        f"Machine: {info.get('cpu_model', 'unknown')}; {_dt.date.today()}.",
        "",
        "| case | us / request | added over open |",
        "|---|---|---|",
    ]
    for name, us in med.items():
        added = "" if name == "open" else f"+{us - base:.1f} us"
        lines.append(f"| {name} | {us:.1f} | {added} |")
    doc = {"args": vars(args), "machine": info, "microseconds": med, "roles": [ADMIN, USER]}
    return doc, "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=8, help="keys the server has")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args()
    times = asyncio.run(main_async(args))
    doc, md = report(times, args)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    print(md)
    save_report(Path(args.out_dir), f"auth-{stamp}", doc, md)


if __name__ == "__main__":
    main()
