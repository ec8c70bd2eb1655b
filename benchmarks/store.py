#!/usr/bin/env python
"""The conversation store's speed: SQLite as it was before the usage ledger and the
PostgreSQL store (``--anchor``, a git revision run from a worktree), SQLite now, and
PostgreSQL now (a throwaway local server, when PostgreSQL is installed), in one run.

The workload is a ``/c1`` turn as the gateway stores it: ``--writers`` tasks at once,
each doing ``--turns`` turns of: the path to the head read, the user's message added,
the assistant's added (each write committed, SQLite with ``synchronous = FULL``, so
concurrent turns share the group commit's fsync). Each path runs in a process of its
own (the anchor's sources first on its ``PYTHONPATH``), the order rotated each round.

Per path: turns a second and the median and p95 of a turn's time; the report gives
SQLite now as a share of before (target: as fast, within the noise).

Usage: ``.venv/bin/python benchmarks/store.py [--rounds 5] [--writers 8] [--turns 50]``;
writes ``benchmarks/results/store-<stamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import RESULTS, report
from harness.anchor import ROOT, anchor_sources
from harness.machine import loadavg, machine_info
from harness.stats import med, pct, rotated

sys.path.insert(0, str(ROOT))  # tests.support.postgres: the suite's throwaway server


async def workload(location: str, writers: int, turns: int) -> dict[str, Any]:
    """Run in a worker process: the turns on the store at ``location``."""
    from sluice.store import NewMessage, SQLiteStore

    if location.startswith("postgresql://"):
        from sluice.store import open_store

        store: Any = await open_store(location)
    else:
        store = await SQLiteStore.open(location)
    times: list[float] = []

    async def writer(i: int) -> None:
        conversation = await store.create_conversation(owner="bench", user_id=None, model="m")
        head = None
        for turn in range(turns):
            start = time.perf_counter()
            if head is not None:
                await store.path(head)
            await store.add_message(
                conversation.id, NewMessage(role="user", content=f"turn {turn} of {i}")
            )
            answer = NewMessage(role="assistant", content="An answer. " * 20, model="m")
            head = (await store.add_message(conversation.id, answer)).id
            times.append(time.perf_counter() - start)

    began = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(writers)))
    wall = time.perf_counter() - began
    await store.close()
    return {"turns_s": writers * turns / wall, "turn_ms": [1000 * t for t in times]}


def measure(path: str, where: str, args: argparse.Namespace, src: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, __file__, "--worker", where, "--writers", str(args.writers)]
    out = subprocess.run(
        [*cmd, "--turns", str(args.turns)], env=env, capture_output=True, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    from tests.support.postgres import PostgresServer, find_bin

    with tempfile.TemporaryDirectory(prefix="sluice-store-") as tmp_name:
        tmp = Path(tmp_name)
        with (
            anchor_sources(args.anchor, tmp / "anchor") as src,
            PostgresServer.start() if find_bin() else contextlib.nullcontext() as pg,
        ):
            paths = ["before", "sqlite"] + (["postgresql"] if pg is not None else [])
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
            for rnd in range(args.rounds):
                for path in rotated(tuple(paths), rnd):
                    where = str(tmp / f"{path}-{rnd}.db")
                    if path == "postgresql":
                        assert pg is not None
                        where = pg.create_database()
                    m = measure(path, where, args, src if path == "before" else None)
                    runs[path].append(m)
                    print(
                        f"  round {rnd + 1} {path:10s} {m['turns_s']:7.0f} turns/s, turn "
                        f"p50 {med(m['turn_ms']):6.2f} ms p95 {pct(m['turn_ms'], 95):6.2f} ms",
                        flush=True,
                    )
    return runs


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    rows = [
        f"# The conversation store's speed ({doc['stamp']})",
        "",
        (
            f"{doc['args']['writers']} writers at once, {doc['args']['turns']} turns each "
            f"(read the path, add two messages), {doc['args']['rounds']} rounds, medians; "
            f"anchor `{doc['args']['anchor']}`."
        ),
        "",
        "| path | turns/s | x before | turn p50 ms | p95 ms |",
        "|---|---|---|---|---|",
    ]
    for p, f in s.items():
        rows.append(
            f"| {p} | {f['turns_s']:.0f} | {f['x_before']:.2f} | {f['p50_ms']:.2f} | "
            f"{f['p95_ms']:.2f} |"
        )
    rows += ["", f"{report.machine_line(doc['machine'], doc['load_average'])}."]
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--anchor", default="ff30c00", help="the revision before the change")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(workload(args.worker, args.writers, args.turns))))
        return
    load0 = loadavg()
    runs = run(args)
    before = med([m["turns_s"] for m in runs["before"]])
    summary = {
        p: {
            "turns_s": med([m["turns_s"] for m in ms]),
            "x_before": med([m["turns_s"] for m in ms]) / before,
            "p50_ms": med([med(m["turn_ms"]) for m in ms]),
            "p95_ms": med([pct(m["turn_ms"], 95) for m in ms]),
        }
        for p, ms in runs.items()
    }
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    doc = {
        "stamp": stamp,
        "args": {k: v for k, v in vars(args).items() if k not in ("out_dir", "worker")},
        "machine": machine_info(),
        "load_average": {"start": load0, "end": loadavg()},
        "runs": runs,
        "summary": summary,
    }
    text = markdown(doc)
    report.save_report(args.out_dir, f"store-{stamp}", doc, text)
    print(text)


if __name__ == "__main__":
    main()
