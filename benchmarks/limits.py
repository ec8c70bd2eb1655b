#!/usr/bin/env python
"""What limits per key and the usage ledger cost a request: the same gateway traffic
through sluice as it was before them (``--anchor``, a git revision run from a worktree),
and through sluice now, with a key without limits and with a key that has every limit
(set high enough never to refuse), in one run.

The traffic is ``fanout.py``'s: its stdlib upstream streaming OpenAI chat deltas (here
``--deltas`` of them, few, so a request's own costs dominate), ``--streams`` streams
started at once, each its own request. The gateways take turns on core 0 (the upstream
and the load on core 1), each measured alone (the other stopped with SIGSTOP: as
``fanout.py`` does), the order rotated each round.

Per path: the gateway's CPU per request (its process's CPU seconds over the requests),
frames a second, and time to first frame p50 / p99. The figures that answer the question:
CPU per request now minus before, for the key with limits (target: at most 0.2 ms) and
for the key without (the ledger alone), and frames a second as a share of before's (the
streaming speed; the ledger writes its SQLite rows once a second, off the request path).

Usage: ``.venv/bin/python benchmarks/limits.py [--rounds 5] [--streams 256]
[--anchor REV]``; writes ``benchmarks/results/limits-<stamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import fanout
from harness import RESULTS, report
from harness.anchor import ROOT, anchor_sources
from harness.machine import loadavg, machine_info, proc_cpu_seconds
from harness.servers import SLUICE, Server, free_port, models_env
from harness.stats import med, pct, rotated

FREE, LIMITED = "sk-bench-free-000001", "sk-bench-limited-001"
PATHS = ("before", "free", "limited")  # the anchor, and now with each key
TARGET_ADDED_MS = 0.2
BIG = 10**9  # limits set, never reached
UPSTREAM = """\
[[upstreams]]
name = "fan"
url = "http://127.0.0.1:{up}"
models = ["{model}"]
"""
KEYS_BEFORE = f'[keys]\nfree = "{FREE}"\nlimited = "{LIMITED}"\n'
KEYS_NOW = (
    f'[keys]\nfree = "{FREE}"\n'
    f'limited = {{ key = "{LIMITED}", rpm = {BIG}, tpm = {BIG}, max_streams = {BIG}, '
    f'token_budget = {BIG}, budget_period = "day", models = ["{fanout.MODEL}"] }}\n'
)


def gateway(name: str, tmp: Path, up: int, keys: str, src: Path | None) -> Server:
    conf = tmp / f"{name}.toml"
    conf.write_text(UPSTREAM.format(up=up, model=fanout.MODEL) + keys)
    port = free_port()
    env = models_env(tmp / "models")
    env["SLUICE_STORE"] = str(tmp / f"{name}.db")
    if src is not None:  # the anchor's sources before the installed ones
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [*fanout.pinned(fanout.GATEWAY_CORE), *SLUICE, "--threads", "1"]
    cmd += ["--log-level", "warning", "--config", str(conf), "--strict-model-names"]
    return Server(name, [*cmd, "--port", str(port)], port, tmp / f"{name}.log", env=env)


def batches(port: int, key: str, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    """``--batches`` loads of ``--streams`` at once, one after another, as one measure:
    the CPU clock ticks in 10 ms, a few hundredths of a millisecond per request at 256."""
    cpu0 = proc_cpu_seconds(pid)
    parts = [fanout.measure(port, args.streams, key, args, None) for _ in range(args.batches)]
    requests = args.streams * args.batches
    cpu = proc_cpu_seconds(pid) - cpu0
    return {
        "requests": requests,
        "gateway_cpu_s": cpu,
        "cpu_ms_per_request": 1000 * cpu / requests,
        "frames_s": med([p["frames_s"] for p in parts]),
        "ttff_ms": [t for p in parts for t in p["ttff_ms"]],
        "stalled": sum(p["stalled"] for p in parts),
    }


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    with tempfile.TemporaryDirectory(prefix="sluice-limits-") as tmp_name:
        tmp = Path(tmp_name)
        with anchor_sources(args.anchor, tmp / "anchor") as src:
            measure_all(args, tmp, src, runs)
    return runs


def measure_all(
    args: argparse.Namespace, tmp: Path, src: Path, runs: dict[str, list[dict[str, Any]]]
) -> None:
    """Every round of every path, the anchor's gateway running ``src``."""
    upstream, up, _ = fanout.start_servers(tmp, "unused", (), deltas=args.deltas)
    servers: dict[str, Server] = {}
    try:
        servers["before"] = gateway("before", tmp, up, KEYS_BEFORE, src)
        servers["now"] = gateway("now", tmp, up, KEYS_NOW, None)
        pids = {"before": servers["before"].pid, "now": servers["now"].pid}
        ports = {"before": servers["before"].port, "now": servers["now"].port}
        where = {"before": ("before", FREE), "free": ("now", FREE)}
        where["limited"] = ("now", LIMITED)
        for gw, key in where.values():  # warm-up: first-request paths, pools
            fanout.measure(ports[gw], 8, key, args, None)
        for rnd in range(args.rounds):
            for path in rotated(PATHS, rnd):
                gw, key = where[path]
                time.sleep(0.5)
                fanout.alone(gw, pids)
                m = batches(ports[gw], key, args, pids[gw])
                m["round"] = rnd + 1
                runs[path].append(m)
                print(
                    f"  round {rnd + 1} {path:8s} {m['cpu_ms_per_request']:6.3f} CPU ms/request"
                    f" {m['frames_s']:8.0f} frames/s, first frame p50 "
                    f"{med(m['ttff_ms']):7.1f} ms p99 {pct(m['ttff_ms'], 99):7.1f} ms, "
                    f"{m['stalled']} stalled",
                    flush=True,
                )
    finally:
        for srv in servers.values():
            os.kill(srv.pid, signal.SIGCONT)
            srv.close()
        upstream.kill()
        upstream.wait()


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def figure(path: str, field: str) -> float:
        return med([m[field] for m in runs[path]])

    cpu = {p: figure(p, "cpu_ms_per_request") for p in PATHS}
    frames = {p: figure(p, "frames_s") for p in PATHS}
    return {
        "cpu_ms_per_request": cpu,
        "added_cpu_ms_limited": cpu["limited"] - cpu["before"],
        "added_cpu_ms_free": cpu["free"] - cpu["before"],
        "frames_s": frames,
        "frames_x_before": {p: frames[p] / frames["before"] for p in PATHS},
        "ttff_p50_ms": {p: med([med(m["ttff_ms"]) for m in runs[p]]) for p in PATHS},
        "ttff_p99_ms": {p: med([pct(m["ttff_ms"], 99) for m in runs[p]]) for p in PATHS},
        "stalled": {p: sum(m["stalled"] for m in runs[p]) for p in PATHS},
    }


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    rows = [
        f"# Limits and usage: what they cost a request ({doc['stamp']})",
        "",
        (
            f"{doc['args']['batches']} x {doc['args']['streams']} streams at once of "
            f"{doc['args']['deltas']} deltas a measure, "
            f"{doc['args']['rounds']} rounds, medians; anchor `{doc['args']['anchor']}` "
            f"({doc['anchor_commit']})."
        ),
        "",
        "| path | CPU ms / request | frames/s | x before | first frame p50 ms | p99 ms | stalled |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in PATHS:
        rows.append(
            f"| {p} | {s['cpu_ms_per_request'][p]:.3f} | {s['frames_s'][p]:.0f} | "
            f"{s['frames_x_before'][p]:.3f} | {s['ttff_p50_ms'][p]:.1f} | "
            f"{s['ttff_p99_ms'][p]:.1f} | {s['stalled'][p]} |"
        )
    met = s["added_cpu_ms_limited"] <= TARGET_ADDED_MS
    rows += [
        "",
        (
            f"Added CPU per request, every limit on: **{s['added_cpu_ms_limited']:+.3f} ms** "
            f"(target <= {TARGET_ADDED_MS} ms: {'met' if met else 'NOT met'}); "
            f"a key without limits (the ledger alone): {s['added_cpu_ms_free']:+.3f} ms."
        ),
        "",
        f"{report.machine_line(doc['machine'], doc['load_average'])}.",
    ]
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=256, help="requests at once, each a stream")
    ap.add_argument("--deltas", type=int, default=8, help="content deltas a stream")
    ap.add_argument("--batches", type=int, default=4, help="loads of --streams a measure")
    ap.add_argument("--anchor", default="ff30c00", help="the revision before limits and usage")
    ap.add_argument("--stall", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=120.0, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.anchor],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    load0 = loadavg()
    runs = run(args)
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    doc = {
        "stamp": stamp,
        "args": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "anchor_commit": commit,
        "machine": machine_info(),
        "load_average": {"start": load0, "end": loadavg()},
        "runs": runs,
        "summary": summarize(runs),
    }
    text = markdown(doc)
    report.save_report(args.out_dir, f"limits-{stamp}", doc, text)
    print(text)


if __name__ == "__main__":
    main()
