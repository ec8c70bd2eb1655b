#!/usr/bin/env python
"""Where the real server's engine thread spends each step, next to the raw anchor.

Runs ``sluice serve`` in a subprocess whose ``LlamaRunner.decode`` and
``Engine._step`` are wrapped with timers (nothing in ``src/`` changes), drives
it over HTTP/SSE with the harness's client, alternating with the harness's
raw worker, and prints for the steady decode steps (every stream generating):

* ``llama_decode`` time per step (compare with the raw step time);
* after decode -> end of ``_step``: sampling, text, event delivery (includes
  waiting for the GIL while the event loop thread runs);
* end of ``_step`` -> next decode: snapshot, commands, admission, planning;
* the seq ids of each decode batch (llama.cpp splits a batch at every gap in
  the seq ids when ``kv_unified=False``, one graph pass per run of ids);
* the event loop thread's CPU per streamed token.

``--warm 1,4,8,1`` sends batches of that many requests first, to reproduce a
slot history (for instance the one ``bench.py`` leaves before its 4-stream run).

Usage::

    python benchmarks/profile_server.py --n 4 --tokens 128 --repeats 3 --warm 1,4,8,1
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from harness.client import run_chat_streams
from harness.machine import Noise, proc_cpu_seconds
from harness.prompts import make_messages
from harness.raw import RawWorker
from harness.servers import Server, free_port


def serve_with_timers(argv: list[str], log_path: str) -> None:
    """``sluice serve`` with the engine step timed; records dumped every second."""
    from sluice.engine import engine as eng_mod
    from sluice.engine import llama_runner as lr
    from sluice.engine.runner import BatchEntry

    rec: list[tuple[float, float, float, list[int], int]] = []
    cur: dict[str, Any] = {}
    orig_decode = lr.LlamaRunner.decode
    orig_step = eng_mod.Engine._step

    def decode(self: lr.LlamaRunner, entries: list[BatchEntry]) -> None:
        t0 = time.perf_counter()
        orig_decode(self, entries)
        cur["d"] = (
            t0,
            time.perf_counter(),
            [e.seq for e in entries],
            sum(len(e.tokens) for e in entries),
        )

    def step(self: eng_mod.Engine) -> bool:
        cur.clear()
        ran = orig_step(self)  # False: nothing ran, the engine waits for a command
        if "d" in cur:
            t0, t1, seqs, n_tok = cur["d"]
            rec.append((t0, t1, time.perf_counter(), seqs, n_tok))
        return ran

    # The timed wrappers in place of the methods (mypy rejects assigning to a method).
    lr.LlamaRunner.decode = decode  # type: ignore[method-assign]
    eng_mod.Engine._step = step  # type: ignore[method-assign]

    def dump() -> None:
        while True:
            time.sleep(1.0)
            tmp = log_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, log_path)

    threading.Thread(target=dump, daemon=True).start()
    from sluice.cli import main

    sys.exit(main(argv))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=1, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument(
        "--warm", default="", help="request batch sizes sent before measuring, e.g. 1,4,8,1"
    )
    ap.add_argument("--_serve", dest="serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve_with_timers(args.serve, os.environ["SLUICE_STEP_LOG"])
        return

    steps_path = Path(tempfile.gettempdir()) / f"sluice-steps-{os.getpid()}.json"
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_serve", "serve"]
    cmd += ["--port", str(port), "--parallel", str(args.parallel)]
    cmd += ["--threads", str(args.threads), "--ctx", str(args.ctx), "--log-level", "warning"]
    env = dict(os.environ, SLUICE_STEP_LOG=str(steps_path))
    server = Server("sluice", cmd, port, steps_path.with_suffix(".log"), env=env)
    pid = server.pid
    raw = RawWorker(args.threads, args.parallel, args.ctx, 512)
    noise = Noise([pid, raw.pid])
    windows: list[tuple[float, float]] = []
    raw_steps: list[float] = []
    loop_us: list[float] = []
    serial = 600
    try:
        for wn in [int(x) for x in args.warm.split(",") if x] or [args.n]:
            serial += 1
            run_chat_streams(server, [make_messages(serial, i) for i in range(wn)], 8)
        for rep in range(args.repeats):
            serial += 1
            convs = [make_messages(serial, i) for i in range(args.n)]
            time.sleep(0.3)
            r, f_raw, _ = noise.run(partial(raw.run, convs, args.tokens), 0.15, 60)
            time.sleep(0.3)
            noise.wait_quiet(0.15, 60)
            noise.start()
            loop0 = proc_cpu_seconds(pid, pid)
            t0 = time.perf_counter()
            s = run_chat_streams(server, convs, args.tokens)
            windows.append((t0, time.perf_counter()))
            loop_us.append((proc_cpu_seconds(pid, pid) - loop0) / (args.n * args.tokens) * 1e6)
            f_slu = noise.stop()
            raw_steps.append(r["step_ms_median"])
            print(
                f"rep {rep + 1}: raw decode {r['decode_tok_s']:.1f} tok/s (step {r['step_ms_median']:.2f} ms)"
                f" | sluice steady {s['steady_decode_tok_s']:.1f} tok/s"
                f" (x{s['steady_decode_tok_s'] / r['decode_tok_s']:.3f})"
                f"  [others used {f_raw:.2f} / {f_slu:.2f} cores]",
                flush=True,
            )
        time.sleep(2.0)  # one more dump of the step records
    finally:
        raw.close()
        server.close()
    rec = json.loads(steps_path.read_text())
    # perf_counter is per process, but CLOCK_MONOTONIC on Linux: comparable here.
    rec = [x for x in rec if any(a <= x[0] <= b for a, b in windows)]
    steady = [x for x in rec if len(x[3]) == args.n and x[4] == args.n]
    if len(steady) < 2:
        sys.exit("profile: no steady decode steps recorded")
    dec = [x[1] - x[0] for x in steady]
    post = [x[2] - x[1] for x in steady]
    nxt = {id(a): b for a, b in itertools.pairwise(rec)}
    pre = [nxt[id(x)][0] - x[2] for x in steady if id(x) in nxt and nxt[id(x)][0] - x[2] < 0.05]
    cycle = [nxt[id(x)][0] - x[0] for x in steady if id(x) in nxt and nxt[id(x)][0] - x[0] < 0.5]
    runs = [1 + sum(1 for a, b in itertools.pairwise(x[3]) if b != a + 1) for x in steady]
    layouts = collections.Counter(tuple(x[3]) for x in steady)
    print(f"\nsluice engine thread, {len(steady)} steady decode steps ({args.n} streams):")
    print(
        f"  llama_decode            median {statistics.median(dec) * 1000:7.3f} ms"
        f"   (raw step incl. sampling: median {statistics.median(raw_steps):.3f} ms)"
    )
    print(
        f"  after decode -> step end median {statistics.median(post) * 1e6:7.0f} us"
        "   (sample, text, deliver; GIL waits)"
    )
    print(
        f"  step end -> next decode  median {statistics.median(pre) * 1e6:7.0f} us"
        "   (snapshot, commands, admit, plan, build)"
    )
    print(
        f"  decode start -> next     median {statistics.median(cycle) * 1000:7.3f} ms"
        f"   -> {args.n / statistics.median(cycle):.1f} tok/s"
    )
    print(
        f"  event loop thread CPU    median {statistics.median(loop_us):7.0f} us per streamed token"
    )
    print(
        f"  runs of consecutive seq ids per decode (1 = one ubatch): median {statistics.median(runs)}"
    )
    print(f"  most common batch layouts (seq ids): {layouts.most_common(4)}")


if __name__ == "__main__":
    main()
