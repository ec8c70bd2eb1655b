#!/usr/bin/env python
"""What a dialect costs per token: the same generation streamed as OpenAI chat and as
Anthropic's Messages, side by side on one server.

One ``sluice serve`` (``--threads T --parallel 8``, the embedded SmolLM2) answers N
concurrent streams (N = each of ``--levels``) of the same distinct conversations
(``make_messages``), greedy, ``ignore_eos``, ``max_tokens`` = the token count, once as
``POST /v1/chat/completions`` (with the usage chunk) and once as ``POST /v1/messages``.
The two dialects take turns, the order rotated round by round, each after a warm-up;
every measurement waits for a quiet machine (``harness.machine.Noise``).

Per measurement: aggregate tok/s (completion tokens / first request sent -> last byte of
the last stream), and the CPU time per token of the server's main thread: the event
loop, where the dialect's work is done (formatting, encoding, HTTP); the engine's
decode runs on its own thread and is the same for both dialects. (All threads' CPU is
recorded too, but llama.cpp's spinning threads make it track the wall time.) The report gives, per level, the median of the per-round ratios
anthropic / openai ("paired") and their range: 1.00 is "costs the same".

Usage: ``.venv/bin/python benchmarks/dialects.py [--rounds 3] [--tokens 1000]``; writes
``benchmarks/results/dialects-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import RESULTS
from harness.client import http_post, run_streams
from harness.machine import Noise, loadavg, machine_info, proc_cpu_seconds
from harness.prompts import make_messages
from harness.servers import SLUICE, Server, free_port
from harness.stats import med, rotated

OPENAI = "/v1/chat/completions"
ANTHROPIC = "/v1/messages"
# A content frame of each dialect: the first marks the first token, each is counted.
MARKS = {"openai": b'"delta":{"content"', "anthropic": b'"text_delta"'}


def body(dialect: str, conversation: list[dict[str, str]], tokens: int) -> bytes:
    data: dict[str, Any] = {
        "model": "smollm2",
        "messages": conversation,
        "stream": True,
        "temperature": 0,
        "max_tokens": tokens,
        "ignore_eos": True,
    }
    if dialect == "openai":
        data["stream_options"] = {"include_usage": True}
    else:  # Anthropic's system prompt is a field of its own
        system = [m["content"] for m in conversation if m["role"] == "system"]
        data["messages"] = [m for m in conversation if m["role"] != "system"]
        if system:
            data["system"] = "\n\n".join(system)
    return json.dumps(data).encode()


def output_tokens(dialect: str, raw: bytes) -> int:
    """The completion tokens the stream's own usage reports."""
    text = raw.partition(b"\r\n\r\n")[2].decode("utf-8", "replace")
    found = 0
    for line in text.split("\n"):
        start = line.find("data: {")
        if start < 0:
            continue
        try:
            obj = json.loads(line[start + 6 :])
        except ValueError:
            continue  # a line cut by the chunked framing: usage is never in one
        usage = obj.get("usage") if dialect == "openai" else None
        if dialect == "anthropic" and obj.get("type") == "message_delta":
            usage = obj.get("usage")
        if usage:
            found = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return int(found)


def measure(
    server: Server, dialect: str, convs: list[list[dict[str, str]]], tokens: int
) -> dict[str, Any]:
    path = OPENAI if dialect == "openai" else ANTHROPIC
    reqs = [http_post(server.port, path, body(dialect, c, tokens)) for c in convs]
    cpu0 = proc_cpu_seconds(server.pid)
    loop0 = proc_cpu_seconds(server.pid, server.pid)  # the main thread: asyncio, HTTP, SSE
    results = run_streams(server.port, reqs, count=MARKS[dialect])
    cpu = proc_cpu_seconds(server.pid) - cpu0
    loop = proc_cpu_seconds(server.pid, server.pid) - loop0
    comp = [output_tokens(dialect, bytes(r.raw)) for r in results]
    if any(not r.reads or c != tokens for r, c in zip(results, comp)):
        raise SystemExit(f"dialects: a {dialect} stream did not complete: {comp}")
    end = max(r.reads[-1][0] for r in results)
    wall = end - min(r.t_send for r in results)
    total = sum(comp)
    return {
        "agg_tok_s": total / wall,
        "server_cpu_ms_per_1k_tokens": 1e6 * cpu / total,
        "loop_cpu_us_per_token": 1e6 * loop / total,
        "wall_s": wall,
        "completion_tokens": comp,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    # Many tokens: /proc counts CPU time in 10 ms ticks, and the event loop spends tens
    # of microseconds a token, so a short stream's figure is a tick or two.
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quiet", type=float, default=0.3, help="max cores others may use (default 0.3)"
    )
    ap.add_argument("--quiet-timeout", type=float, default=60.0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    started = _dt.datetime.now()
    print(
        f"dialects: threads={args.threads} tokens={args.tokens} rounds={args.rounds} levels={levels} load={loadavg()}",
        flush=True,
    )
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"sluice-dialects-{port}.log"
    cmd = [*SLUICE, "--port", str(port), "--parallel", "8", "--threads", str(args.threads)]
    cmd += ["--ctx", str(args.tokens + 256), "--log-level", "warning"]
    results: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {"openai": [], "anthropic": []} for n in levels
    }
    with Server("sluice", cmd, port, log) as server:
        noise = Noise([server.pid])
        serial = int(time.time()) % 900
        for n in levels:  # warm-up: both dialects, every level
            for dialect in ("openai", "anthropic"):
                serial += 1
                measure(server, dialect, [make_messages(serial, i) for i in range(n)], 16)
        for rnd in range(args.rounds):
            for li, n in enumerate(levels):
                serial += 1
                convs = [make_messages(serial, i) for i in range(n)]
                for dialect in rotated(("openai", "anthropic"), rnd + li):
                    server.wait_idle()
                    time.sleep(0.3)
                    res, foreign, _ = noise.run(
                        lambda d=dialect, c=convs: measure(server, d, c, args.tokens),
                        args.quiet,
                        args.quiet_timeout,
                    )
                    res["foreign_cores"] = foreign
                    results[n][dialect].append(res)
                    print(
                        f"  round {rnd + 1}/{args.rounds} n={n} {dialect:9s} "
                        f"{res['agg_tok_s']:7.1f} tok/s  server CPU "
                        f"{res['server_cpu_ms_per_1k_tokens']:6.0f} ms/1k tok, event loop "
                        f"{res['loop_cpu_us_per_token']:5.0f} us/tok  "
                        f"(others used {foreign:.2f} cores)",
                        flush=True,
                    )
    summary: dict[str, Any] = {}
    lines = [
        f"# Dialect overhead: Anthropic Messages vs OpenAI chat ({started:%Y-%m-%d %H:%M})",
        "",
        (
            f"SmolLM2-135M Q4_1, {args.threads} threads, {args.tokens} tokens per stream, "
            f"greedy, ignore_eos, {args.rounds} rounds alternating (order rotated). Ratios "
            "are anthropic / openai per round; 'paired' is their median."
        ),
        "",
        (
            "| streams | openai tok/s (median) | anthropic tok/s (median) "
            "| tok/s ratio paired [range] | event-loop CPU/token: openai, anthropic (us, median) "
            "| event-loop CPU/token ratio paired [range] |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for n in levels:
        o, a = results[n]["openai"], results[n]["anthropic"]
        speed = [x["agg_tok_s"] / y["agg_tok_s"] for x, y in zip(a, o)]
        cpu = [x["loop_cpu_us_per_token"] / y["loop_cpu_us_per_token"] for x, y in zip(a, o)]
        summary[str(n)] = {"tok_s_ratio": speed, "cpu_ratio": cpu}
        lines.append(
            f"| {n} | {med([x['agg_tok_s'] for x in o]):.1f} | {med([x['agg_tok_s'] for x in a]):.1f} "
            f"| {med(speed):.3f} [{min(speed):.3f}-{max(speed):.3f}] "
            f"| {med([x['loop_cpu_us_per_token'] for x in o]):.0f}, "
            f"{med([x['loop_cpu_us_per_token'] for x in a]):.0f} "
            f"| {med(cpu):.3f} [{min(cpu):.3f}-{max(cpu):.3f}] |"
        )
    md = "\n".join(lines) + "\n"
    print(md)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"dialects-{started:%Y-%m-%d-%H%M%S}"
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "args": vars(args) | {"out_dir": str(args.out_dir)},
                "machine": machine_info(),
                "results": results,
                "summary": summary,
            },
            indent=1,
        )
    )
    stem.with_suffix(".md").write_text(md)
    print(f"dialects: wrote {stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
