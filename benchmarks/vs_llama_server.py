#!/usr/bin/env python
"""sluice against llama.cpp's own ``llama-server`` on the same kernels.

``llama-server`` is built from the llama.cpp that the pinned llama-cpp-python vendors,
with the flags ``./dev`` uses (``llama_server.py``; built once, cached), so the kernels
are the ones sluice calls and every difference is the server around them. Everything
runs on SmolLM2-135M-Instruct Q4_1 (``harness.model_path()``) with ``--threads`` (default
2) for every process, one target at a time, in rounds: every server (and the raw worker)
is started fresh for each round of each scenario, so that both servers get the same
treatment. In the throughput scenario the three targets of a round stay up side by side
(idle, each blocked on its socket or stdin) and every level is measured on the three
back to back, ``--reps`` times per round in a rotating order: on this shared machine,
whose speed drifts by tens of percent over minutes, only measurements seconds apart
make a fair pair.

1. **Throughput** at 1, 4 and 8 concurrent streams, 8 slots each, 4096 tokens of
   context per slot:

   * raw: the raw worker, ``harness/raw.py`` (llama-cpp-python's low-level API, no server, no
     HTTP: one ``llama_decode`` per step for all sequences, sluice's greedy chain);
   * llama-server: ``-t 2 -np 8 -c 32768 -b 512 -ub 512`` (``-c`` is the total over the
     slots; ``-b`` matches sluice's ``--batch``, ``--llama-batch 2048`` gives
     llama-server's own default);
   * sluice: ``python -m sluice serve --threads 2 --parallel 8 --ctx 4096 --batch 512``.

   Both servers are driven by ``harness/client.py`` (one blocking socket and thread per
   stream): N streaming ``/v1/chat/completions`` requests sent at once, temperature 0,
   ``ignore_eos``, ``max_tokens`` = ``--tokens`` (default 128), the same distinct prompts
   (``harness.prompts.make_messages``) for the three targets in a round. ``agg`` = completion
   tokens / wall time (first request sent -> last stream done); ``decode`` = tokens after
   the first / time after the first token, summed over streams (``client.run_chat_streams``
   and ``RawEngine.run``). The report gives medians over rounds (the per-round values
   are in the JSON) and the ratios sluice / llama-server and each / raw.

2. **Mixed load**, 4 slots each (``--parallel 4`` / ``-np 4``, the same 4096 tokens per
   slot): one long chat prompt (~3,300 tokens of distinct deterministic text, 16 tokens
   out) is sent; 300 ms later four short chat requests (~30-token prompts, 32 tokens out
   each, streaming) arrive 100 ms apart. Per server and round, three runs, each with
   prompts no cache has seen (a distinct tag at the start):

   * the four short requests alone, on the same schedule: their inter-token gaps;
   * the long request alone: its TTFT;
   * both together: the short requests' TTFT (p50, max), their inter-token gaps that
     start while the long prompt is still prefilling (before its first token arrives),
     and the long request's TTFT.

   Figures: short TTFT p50 and max; gap p95 during the prefill / gap p95 alone; long
   TTFT / long TTFT alone (each ratio per round, then the median over rounds).

Targets, printed as met / not met: sluice >= 1.00x llama-server's aggregate
tok/s at 1, 4 and 8 streams (the median over every repetition of its ratio: the two
servers run seconds apart, so a change of the machine's speed between repetitions
does not count); sluice's short TTFT p50 <= 0.1x llama-server's; sluice's
gap p95 during the long prefill <= 3x its gap p95 without it; sluice's long TTFT <=
1.15x its TTFT alone.

Checks (printed and written): other processes' CPU during a measurement above
``--quiet`` cores (each measurement first waits up to ``--quiet-timeout`` s for a quiet
machine), prompts of another token count on another target, streams of another length,
short requests sent after the long prompt had finished prefilling.

Usage::

    .venv/bin/python benchmarks/vs_llama_server.py            # 3 rounds (~10 minutes)
    .venv/bin/python benchmarks/vs_llama_server.py --quick    # 1 round, fewer tokens
    .venv/bin/python benchmarks/vs_llama_server.py --rounds 5
    .venv/bin/python benchmarks/vs_llama_server.py --report benchmarks/results/vs-llama-server-<ts>.json

Writes ``benchmarks/results/vs-llama-server-<timestamp>.json``, ``.md`` and ``.png``,
and copies the plot to ``vs-llama-server-latest.png``. The plot needs matplotlib:
``.venv/bin/pip install -e '.[bench]'``. Builds llama-server on first use (about 7
minutes, cached).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from harness import RESULTS, client, report
from harness.llama_build import build_info, ensure_llama_server
from harness.machine import Noise, loadavg, machine_info
from harness.prompts import make_messages, paragraph
from harness.raw import RawWorker
from harness.servers import SLUICE, LlamaServer, Server, free_port, llama_server_cmd, models_env
from harness.stats import med, pct, ratio, rotated

TARGETS = ("raw", "llama-server", "sluice")
SERVERS = ("llama-server", "sluice")
LEVELS = (1, 4, 8)
PARALLEL, MIXED_PARALLEL, CTX, BATCH = 8, 4, 4096, 512
GOALS = {
    "throughput_vs_llama_min": 1.00,
    "short_ttft_p50_vs_llama_max": 0.10,
    "gap_p95_ratio_max": 3.0,
    "long_ttft_ratio_max": 1.15,
}
INSTALL_HINT = ".venv/bin/pip install -e '.[bench]'  (or: .venv/bin/pip install 'matplotlib>=3.8')"

SHORT_QUESTIONS = [
    "Why do cats purr when they are happy?",
    "How far away is the moon from us?",
    "What makes thunder so loud in storms?",
    "Why does bread go stale after some days?",
]


# --- prompts ---------------------------------------------------------------------------


def tag_of(k: int) -> int:
    """A 3-digit tag (always the same token count): prompts that differ from their first
    content token on, so that no prefix cache holds more than the template's opening."""
    return 100 + k % 900


def short_messages(tag: int, i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"{tag}. Answer briefly."},
        {"role": "user", "content": SHORT_QUESTIONS[i % len(SHORT_QUESTIONS)]},
    ]


def long_messages(tag: int, words: int) -> list[dict[str, str]]:
    text = paragraph(random.Random("vs-llama-server-long"), words)
    return [
        {"role": "system", "content": f"{tag}. You are a careful reader."},
        {
            "role": "user",
            "content": "Read this chronicle; I will ask about it. "
            + text
            + " Who appears most often in the chronicle?",
        },
    ]


# --- targets: the raw worker and the two servers ----------------------------------------


class RawTarget:
    """The raw worker (no server, no HTTP) with the throughput scenario's context."""

    name = "raw"

    def __init__(self, args: argparse.Namespace) -> None:
        self.worker = RawWorker(args.threads, PARALLEL, CTX, BATCH)
        self.pid = self.worker.pid
        self.cmd = self.worker.cmd

    def run(self, convs: list[list[dict[str, str]]], tokens: int) -> dict[str, Any]:
        return self.worker.run(convs, tokens)

    def wait_idle(self) -> None:
        pass  # blocked on its stdin between commands

    def close(self) -> None:
        self.worker.close()


class ServerTarget:
    """llama-server or sluice, started fresh; driven by the harness's client."""

    def __init__(self, name: str, parallel: int, args: argparse.Namespace, tag: str) -> None:
        self.name = name
        port = free_port()
        log = args.tmp / f"{name}-{tag}.log"
        self.srv: Server
        if name == "sluice":
            cmd = [*SLUICE, "--threads", str(args.threads)]
            cmd += ["--parallel", str(parallel), "--ctx", str(CTX), "--batch", str(BATCH)]
            cmd += ["--store", str(args.tmp / f"store-{tag}.sqlite"), "--log-level", "warning"]
            cmd += ["--port", str(port), *shlex.split(args.sluice_args)]
            self.srv = Server(name, cmd, port, log, env=models_env(args.tmp / "models"))
        else:
            batch = ["-b", str(args.llama_batch), "-ub", str(BATCH)]
            cmd = llama_server_cmd(args.llama_server, port, args.threads, parallel, CTX, *batch)
            self.srv = LlamaServer(name, cmd, port, log)
        self.port, self.pid = port, self.srv.pid
        self.cmd = [a.replace(str(args.tmp), "<tmp>") for a in cmd]
        if name == "sluice":
            self.cmd.insert(0, "SLUICE_MODELS_DIR=<tmp>/models")

    def run(self, convs: list[list[dict[str, str]]], tokens: int) -> dict[str, Any]:
        return client.run_chat_streams(self.srv, convs, tokens)  # any OpenAI server

    def wait_idle(self) -> None:
        self.srv.wait_idle(settle=0.1)

    def close(self) -> None:
        self.srv.close()


Target = RawTarget | ServerTarget


def start_target(name: str, parallel: int, args: argparse.Namespace, tag: str) -> Target:
    return RawTarget(args) if name == "raw" else ServerTarget(name, parallel, args, tag)


def measured(
    target: Target, args: argparse.Namespace, fn: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``fn()`` on an idle target and a quiet machine, with others' CPU during it."""
    target.wait_idle()
    time.sleep(0.3)  # the previous run's thread pool goes to sleep
    res, foreign, before = Noise([target.pid]).run(fn, args.quiet, args.quiet_timeout)
    return res | {"foreign_cores": foreign, "foreign_cores_before": before}


# --- scenario 1: throughput -------------------------------------------------------------


def throughput_round(args: argparse.Namespace, rnd: int) -> dict[str, list[dict[str, Any]]]:
    """The three targets, fresh, alive side by side (idle ones cost nothing: blocked on a
    socket or stdin): a warm-up at every level, then ``--reps`` repetitions in which every
    level is measured on the three targets back to back, seconds apart, in an order that
    rotates with the round and the repetition. Each repetition is one entry per target
    (``round`` numbers the entries, ``fresh_round``/``rep`` say where it came from), so a
    paired ratio compares two runs a few seconds apart, not two that a whole target's
    round (a minute) and a change of this shared machine's speed may separate."""
    targets: dict[str, Target] = {}
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
    reps = args.reps
    try:
        for t in TARGETS:
            targets[t] = start_target(t, PARALLEL, args, f"throughput-round{rnd}")
        # Serials: (reps + 1) x len(LEVELS) per round, the same for every target in a
        # repetition; make_messages gives each serial 8 consecutive distinct tags.
        base = (rnd - 1) * (reps + 1) * len(LEVELS)
        for li, n in enumerate(LEVELS):
            convs = [make_messages(base + li, i) for i in range(n)]
            for t in rotated(TARGETS, rnd - 1):
                targets[t].wait_idle()
                targets[t].run(convs, 16)
        for rep in range(reps):
            order = rotated(TARGETS, rnd - 1 + rep)
            entries = {
                t: {
                    "round": (rnd - 1) * reps + rep + 1,
                    "fresh_round": rnd,
                    "rep": rep + 1,
                    "cmd": targets[t].cmd,
                    "levels": {},
                }
                for t in TARGETS
            }
            for li, n in enumerate(LEVELS):
                serial = base + (rep + 1) * len(LEVELS) + li
                convs = [make_messages(serial, i) for i in range(n)]
                for t in order:
                    res = measured(targets[t], args, partial(targets[t].run, convs, args.tokens))
                    entries[t]["levels"][str(n)] = res
                    print(
                        f"    rep {rep + 1} {t:12s} n={n}: agg {res['agg_tok_s']:7.1f} tok/s  "
                        f"decode {res['decode_tok_s']:7.1f} tok/s  (others used "
                        f"{res['foreign_cores']:.2f} cores)",
                        flush=True,
                    )
            for t in TARGETS:
                out[t].append(entries[t])
    finally:
        for target in targets.values():
            target.close()
    return out


# --- scenario 2: mixed load -------------------------------------------------------------


def staggered(port: int, plan: list[tuple[float, bytes]]) -> list[client.Stream]:
    """Chat streams (their bodies) sent at the given offsets (s) from a common start."""
    reqs = [(at, client.http_post(port, client.CHAT, body)) for at, body in plan]
    results = client.run_staggered(port, reqs, first=client.DELTA_RE, count=client.DELTA)
    for r in results:
        if not r.t_first or not r.t_done:
            sys.exit(f"vs_llama_server: a stream did not complete: {bytes(r.raw[:400])!r}")
    return results


def token_times(r: client.Stream) -> list[float]:
    """Arrival time of every content frame (frames read together share a time)."""
    return [t for t, k in r.reads for _ in range(k)]


def gaps_ms(r: client.Stream, before: float = math.inf) -> list[float]:
    """Inter-token gaps of a stream (ms) that start before ``before``."""
    ts = token_times(r)
    return [(b - a) * 1000 for a, b in itertools.pairwise(ts) if a < before]


def stream_facts(r: client.Stream) -> dict[str, Any]:
    p = r.parse()
    u = p["usage"] or {}
    return {
        "ttft_ms": (r.t_first - r.t_send) * 1000,
        "prompt_tokens": u.get("prompt_tokens"),
        "completion_tokens": u.get("completion_tokens"),
    }


def mixed_round(name: str, args: argparse.Namespace, rnd: int) -> dict[str, Any]:
    """One server, fresh, 4 slots: the short requests alone, the long one alone, both."""
    target = ServerTarget(name, MIXED_PARALLEL, args, f"mixed-round{rnd}")
    port = target.port
    k = 1000 + 16 * rnd  # the tags of this round: k .. k+15, the same on both servers
    offsets = [args.short_at + i * args.short_every for i in range(4)]

    def shorts(first_tag: int) -> list[tuple[float, bytes]]:
        return [
            (
                at,
                client.chat_stream_body(
                    short_messages(tag_of(first_tag + i), i), args.short_tokens
                ),
            )
            for i, at in enumerate(offsets)
        ]

    def long(tag: int) -> tuple[float, bytes]:
        return 0.0, client.chat_stream_body(
            long_messages(tag_of(tag), args.long_words), args.long_tokens
        )

    out: dict[str, Any] = {"round": rnd, "cmd": target.cmd}
    try:
        # Warm-up: a prompt of more than one batch, then four short ones at once.
        warm = long_messages(tag_of(k), 500)
        staggered(port, [(0.0, client.chat_stream_body(warm, 4))])
        target.wait_idle()
        staggered(port, [(0.0, body) for _, body in shorts(k + 1)])

        def alone_shorts() -> dict[str, Any]:
            res = staggered(port, shorts(k + 5))
            return {
                "shorts": [stream_facts(r) for r in res],
                "gaps_ms": [round(g, 2) for r in res for g in gaps_ms(r)],
            }

        def alone_long() -> dict[str, Any]:
            return {"long": stream_facts(staggered(port, [long(k + 9)])[0])}

        def mixed() -> dict[str, Any]:
            res = staggered(port, [long(k + 10), *shorts(k + 11)])
            lg, sh = res[0], res[1:]
            return {
                "long": stream_facts(lg),
                "shorts": [stream_facts(r) for r in sh],
                "gaps_ms_during_prefill": [
                    round(g, 2) for r in sh for g in gaps_ms(r, before=lg.t_first)
                ],
                "shorts_sent_before_long_first": all(r.t_send < lg.t_first for r in sh),
                "shorts_done_before_long_first": sum(r.t_done < lg.t_first for r in sh),
            }

        a = measured(target, args, alone_shorts)
        b = measured(target, args, alone_long)
        m = measured(target, args, mixed)
    finally:
        target.close()
    out |= {"alone_shorts": a, "alone_long": b, "mixed": m}
    s_ttft = [s["ttft_ms"] for s in m["shorts"]]
    out["figures"] = fig = {
        "short_ttft_p50_ms": pct(s_ttft, 50),
        "short_ttft_max_ms": max(s_ttft),
        "short_ttft_alone_p50_ms": pct([s["ttft_ms"] for s in a["shorts"]], 50),
        "gap_p95_during_prefill_ms": pct(m["gaps_ms_during_prefill"], 95),
        "gaps_during_prefill": len(m["gaps_ms_during_prefill"]),
        "gap_p95_alone_ms": pct(a["gaps_ms"], 95),
        "long_ttft_ms": m["long"]["ttft_ms"],
        "long_ttft_alone_ms": b["long"]["ttft_ms"],
    }
    fig["gap_p95_ratio"] = fig["gap_p95_during_prefill_ms"] / fig["gap_p95_alone_ms"]
    fig["long_ttft_ratio"] = fig["long_ttft_ms"] / fig["long_ttft_alone_ms"]
    print(
        f"    {name:12s} long prompt {m['long']['prompt_tokens']} tok: TTFT "
        f"{fig['long_ttft_ms']:.0f} ms (alone {fig['long_ttft_alone_ms']:.0f}); short TTFT p50 "
        f"{fig['short_ttft_p50_ms']:.0f} max {fig['short_ttft_max_ms']:.0f} ms (alone "
        f"{fig['short_ttft_alone_p50_ms']:.0f}); gap p95 during prefill "
        f"{fig['gap_p95_during_prefill_ms']:.0f} ms over {fig['gaps_during_prefill']} gaps "
        f"(alone {fig['gap_p95_alone_ms']:.0f})",
        flush=True,
    )
    return out


# --- summary ----------------------------------------------------------------------------


def summarize(runs: dict[str, Any]) -> dict[str, Any]:
    tp: dict[str, Any] = {}
    for n in map(str, LEVELS) if all(runs["throughput"][t] for t in TARGETS) else ():
        row: dict[str, Any] = {}
        per: dict[str, list[dict[str, Any]]] = {}
        for t in TARGETS:
            per[t] = [r["levels"][n] for r in runs["throughput"][t]]
            cpu_key = "proc_cpu_s" if t == "raw" else "server_cpu_s"
            row[t] = {
                "agg_tok_s": med([x["agg_tok_s"] for x in per[t]]),
                "decode_tok_s": med([x["decode_tok_s"] for x in per[t]]),
                "agg_tok_s_rounds": [x["agg_tok_s"] for x in per[t]],
                "decode_tok_s_rounds": [x["decode_tok_s"] for x in per[t]],
                "cpu_ms_per_token": med(
                    [x[cpu_key] * 1000 / (int(n) * tokens_per_stream(x)) for x in per[t]]
                ),
            }
        for kind in ("agg", "decode"):
            key = f"{kind}_tok_s"
            row[f"sluice_vs_llama_{kind}"] = ratio(row["sluice"][key], row["llama-server"][key])
            pairs = [ratio(s[key], ls[key]) for s, ls in zip(per["sluice"], per["llama-server"])]
            row[f"sluice_vs_llama_{kind}_paired"] = med(pairs)
            row[f"sluice_vs_llama_{kind}_pairs"] = pairs
            row[f"llama_vs_raw_{kind}"] = ratio(row["llama-server"][key], row["raw"][key])
            row[f"sluice_vs_raw_{kind}"] = ratio(row["sluice"][key], row["raw"][key])
        tp[n] = row
    mixed: dict[str, Any] = {}
    if not all(runs["mixed"][s] for s in SERVERS):  # --only throughput
        return {"throughput": tp, "mixed": mixed}
    for s in SERVERS:
        figs = [r["figures"] for r in runs["mixed"][s]]
        mixed[s] = {k: med([f[k] for f in figs]) for k in figs[0]}
        mixed[s]["rounds"] = figs
        # The longest pause a generating stream saw while the long prompt prefilled (the
        # p95 hides a few long ones: sluice spends its prefill share in whole chunks).
        mixed[s]["gap_max_during_prefill_ms"] = med(
            [max(r["mixed"]["gaps_ms_during_prefill"], default=math.nan) for r in runs["mixed"][s]]
        )
        mixed[s]["long_prompt_tokens"] = runs["mixed"][s][0]["mixed"]["long"]["prompt_tokens"]
        mixed[s]["short_prompt_tokens"] = [
            x["prompt_tokens"] for x in runs["mixed"][s][0]["mixed"]["shorts"]
        ]
    mixed["short_ttft_p50_sluice_vs_llama"] = ratio(
        mixed["sluice"]["short_ttft_p50_ms"], mixed["llama-server"]["short_ttft_p50_ms"]
    )
    return {"throughput": tp, "mixed": mixed}


def tokens_per_stream(res: dict[str, Any]) -> int:
    return int(res.get("tokens_per_seq") or res["completion_tokens"][0])


def targets_met(summary: dict[str, Any]) -> dict[str, bool]:
    def ok(x: float, pred: Any) -> bool:
        return not math.isnan(x) and bool(pred(x))

    tp, mx = summary["throughput"], summary["mixed"]
    met = {
        # On the paired ratio (each round's two runs back to back): a ratio of medians
        # over rounds is skewed when this shared machine changes speed between rounds.
        f"sluice >= 1.00x llama-server agg tok/s at {n} stream{'s' * (n > 1)}": ok(
            tp[str(n)]["sluice_vs_llama_agg_paired"],
            lambda x: x >= GOALS["throughput_vs_llama_min"],
        )
        for n in (LEVELS if tp else ())
    }
    if not mx:  # --only throughput
        return met
    met["short TTFT p50 <= 0.1x llama-server's"] = ok(
        mx["short_ttft_p50_sluice_vs_llama"], lambda x: x <= GOALS["short_ttft_p50_vs_llama_max"]
    )
    met["gap p95 during the long prefill <= 3x without"] = ok(
        mx["sluice"]["gap_p95_ratio"], lambda x: x <= GOALS["gap_p95_ratio_max"]
    )
    met["long TTFT <= 1.15x alone"] = ok(
        mx["sluice"]["long_ttft_ratio"], lambda x: x <= GOALS["long_ttft_ratio_max"]
    )
    return met


def checks(runs: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out = []
    quiet = args.quiet
    for t, rounds in runs["throughput"].items():
        for r in rounds:
            for n, x in r["levels"].items():
                where = f"throughput {t} round {r['round']} n={n}"
                if x["foreign_cores"] > quiet:
                    out.append(f"{where}: other processes used {x['foreign_cores']:.2f} cores")
                if t != "raw" and any(c != args.tokens for c in x["completion_tokens"]):
                    out.append(f"{where}: completion tokens {x['completion_tokens']}")
    for rnd in range(len(runs["throughput"]["raw"])):
        for n in map(str, LEVELS):
            counts = {t: runs["throughput"][t][rnd]["levels"][n]["prompt_tokens"] for t in TARGETS}
            if len({json.dumps(c) for c in counts.values()}) > 1:
                out.append(f"throughput round {rnd + 1} n={n}: prompt tokens differ: {counts}")
    for s, rounds in runs["mixed"].items():
        for r in rounds:
            where = f"mixed {s} round {r['round']}"
            for part in ("alone_shorts", "alone_long", "mixed"):
                if r[part]["foreign_cores"] > quiet:
                    out.append(
                        f"{where} ({part}): other processes used "
                        f"{r[part]['foreign_cores']:.2f} cores"
                    )
            m = r["mixed"]
            if not m["shorts_sent_before_long_first"]:
                out.append(f"{where}: a short request was sent after the long prefill ended")
            lens = [x["completion_tokens"] for x in m["shorts"] + r["alone_shorts"]["shorts"]]
            if any(c != args.short_tokens for c in lens):
                out.append(f"{where}: short completion tokens {lens}")
            if s == "sluice" and r["figures"]["gaps_during_prefill"] == 0:
                out.append(
                    f"{where}: no short stream produced two tokens during the long prefill "
                    "(gap p95 during the prefill: n/a)"
                )
    for rnd, (a, b) in enumerate(zip(runs["mixed"]["sluice"], runs["mixed"]["llama-server"]), 1):
        pa = [a["mixed"]["long"]["prompt_tokens"]] + [
            x["prompt_tokens"] for x in a["mixed"]["shorts"]
        ]
        pb = [b["mixed"]["long"]["prompt_tokens"]] + [
            x["prompt_tokens"] for x in b["mixed"]["shorts"]
        ]
        if pa != pb:
            out.append(f"mixed round {rnd}: prompt tokens sluice {pa} vs llama-server {pb}")
    return out


# --- report -----------------------------------------------------------------------------


def fmt(x: float, spec: str = ".0f") -> str:
    return "n/a" if x is None or math.isnan(x) else format(x, spec)


def _pairs_cell(pairs: list[float]) -> str:
    """How many paired ratios reach 1.00, and their spread: whether a median a few
    hundredths from 1 is a lead or this machine's noise."""
    xs = [x for x in pairs if not math.isnan(x)]
    if not xs:
        return "n/a"
    return f"{sum(x >= 1.0 for x in xs)}/{len(xs)} ({min(xs):.2f}-{max(xs):.2f})"


def throughput_table(summary: dict[str, Any], markdown: bool) -> str:
    head = ["streams", "raw agg", "llama agg", "sluice agg", "sluice/llama"]
    head += ["sluice/llama paired", "pairs >= 1 (range)", "llama/raw"]
    head += ["sluice/raw", "raw dec", "llama dec", "sluice dec", "sluice/llama dec"]
    head += ["CPU ms/tok raw / llama / sluice"]
    rows = []
    for n in map(str, LEVELS):
        x = summary["throughput"][n]
        rows.append(
            [
                n,
                *(fmt(x[t]["agg_tok_s"], ".1f") for t in TARGETS),
                fmt(x["sluice_vs_llama_agg"], ".3f"),
                fmt(x["sluice_vs_llama_agg_paired"], ".3f"),
                _pairs_cell(x.get("sluice_vs_llama_agg_pairs") or []),
                fmt(x["llama_vs_raw_agg"], ".3f"),
                fmt(x["sluice_vs_raw_agg"], ".3f"),
                *(fmt(x[t]["decode_tok_s"], ".1f") for t in TARGETS),
                fmt(x["sluice_vs_llama_decode"], ".3f"),
                " / ".join(fmt(x[t]["cpu_ms_per_token"], ".2f") for t in TARGETS),
            ]
        )
    return report.render_table(head, rows, markdown)


MIXED_ROWS = [
    ("short TTFT p50, ms", "short_ttft_p50_ms", ".0f"),
    ("short TTFT max, ms", "short_ttft_max_ms", ".0f"),
    ("short TTFT p50 alone, ms", "short_ttft_alone_p50_ms", ".0f"),
    ("short gap p95 during the long prefill, ms", "gap_p95_during_prefill_ms", ".0f"),
    ("short gap max during the long prefill, ms", "gap_max_during_prefill_ms", ".0f"),
    ("short gaps during the long prefill (count)", "gaps_during_prefill", ".0f"),
    ("short gap p95 alone, ms", "gap_p95_alone_ms", ".1f"),
    ("gap p95 ratio (during / alone)", "gap_p95_ratio", ".2f"),
    ("long TTFT, ms", "long_ttft_ms", ".0f"),
    ("long TTFT alone, ms", "long_ttft_alone_ms", ".0f"),
    ("long TTFT ratio (mixed / alone)", "long_ttft_ratio", ".3f"),
]


def mixed_table(summary: dict[str, Any], markdown: bool) -> str:
    mx = summary["mixed"]
    head = ["", "sluice", "llama-server", "sluice/llama"]
    rows = [
        [
            "prompt tokens (long; shorts)",
            *(
                f"{mx[s]['long_prompt_tokens']}; {mx[s]['short_prompt_tokens']}"
                for s in SERVERS[::-1]
            ),
            "",
        ]
    ]
    for label, key, spec in MIXED_ROWS:
        a, b = mx["sluice"][key], mx["llama-server"][key]
        rows.append([label, fmt(a, spec), fmt(b, spec), fmt(ratio(a, b), ".3f")])
    return report.render_table(head, rows, markdown)


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"vs_llama_server: the plot needs matplotlib: {INSTALL_HINT}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    tp, mx = res["summary"]["throughput"], res["summary"]["mixed"]
    colors = {"raw": "#9e9e9e", "llama-server": "#4c72b0", "sluice": "#dd8452"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.27
    for i, t in enumerate(TARGETS):
        xs = [j + (i - 1) * width for j in range(len(LEVELS))]
        ys = [tp[str(n)][t]["agg_tok_s"] for n in LEVELS]
        bars = ax1.bar(xs, ys, width, label=t, color=colors[t])
        ax1.bar_label(bars, fmt=" %.0f", fontsize=7, rotation=90, padding=2)
    ax1.set_xticks(
        range(len(LEVELS)),
        [
            f"{n} stream{'s' * (n > 1)}\nsluice/llama {fmt(tp[str(n)]['sluice_vs_llama_agg_paired'], '.2f')}x paired"
            for n in LEVELS
        ],
        fontsize=8,
    )
    ax1.set_ylabel("aggregate tok/s (median over rounds)")
    ax1.set_title("Throughput, 8 slots each")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.margins(y=0.15)

    groups: list[tuple[str, Callable[[str], float]]] = [
        ("short TTFT p50 (s)", lambda s: mx[s]["short_ttft_p50_ms"] / 1000),
        ("short gap p95:\nduring long prefill / alone", lambda s: mx[s]["gap_p95_ratio"]),
        ("long TTFT:\nmixed / alone", lambda s: mx[s]["long_ttft_ratio"]),
    ]
    goals = [
        GOALS["short_ttft_p50_vs_llama_max"] * mx["llama-server"]["short_ttft_p50_ms"] / 1000,
        GOALS["gap_p95_ratio_max"],
        GOALS["long_ttft_ratio_max"],
    ]
    width = 0.36
    for i, s in enumerate(SERVERS):
        for j, (_, value) in enumerate(groups):
            v = value(s)
            x = j + (i - 0.5) * width
            if math.isnan(v):
                ax2.text(x, 1, "n/a\n(no token\nduring it)", ha="center", va="bottom", fontsize=7)
                continue
            ax2.bar(x, v, width, color=colors[s], label=s if j == 0 else None)
            ax2.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    for j, g in enumerate(goals):
        if not math.isnan(g):
            ax2.hlines(
                g, j - 0.03, j + width + 0.03, colors="black", linestyles="dashed", linewidth=1
            )
    ax2.plot([], [], "k--", linewidth=1, label="sluice's target")
    shown = [v for s in SERVERS for _, value in groups if (v := value(s)) > 0] + goals
    shown = [v for v in shown if not math.isnan(v)]
    ax2.set_yscale("log")  # seconds and ratios from ~0.05 to ~20 on one axis
    if shown:
        ax2.set_ylim(min(shown) / 3, max(shown) * 3)
    ax2.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax2.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax2.set_ylabel("log scale")
    ax2.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
    ax2.set_title("Mixed load: a ~3,300-token prompt + 4 short requests, 4 slots each")
    ax2.title.set_fontsize(9)
    ax2.legend(fontsize=8)
    mach = res["machine"]
    fig.suptitle(
        f"sluice vs llama-server, SmolLM2-135M Q4_1, {res['settings']['threads']} threads, "
        f"{res['date'][:10]}, {mach['cpu_model']} ({mach['cores']} cores)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(res: dict[str, Any], out_dir: Path) -> None:
    summary, met, mach, st = res["summary"], res["met"], res["machine"], res["settings"]
    load, bi, stem = (
        res["load_average"],
        res["llama_server_build"],
        f"vs-llama-server-{res['stamp']}",
    )
    print(
        f"\n{throughput_table(summary, markdown=False)}\n\n{mixed_table(summary, markdown=False)}\n"
    )
    report.print_outcome(met, res["checks"], load)
    foreign = [
        x["foreign_cores"]
        for rs in res["runs"]["throughput"].values()
        for r in rs
        for x in r["levels"].values()
    ] + [
        r[p]["foreign_cores"]
        for rs in res["runs"]["mixed"].values()
        for r in rs
        for p in ("alone_shorts", "alone_long", "mixed")
    ]
    cmds = st["cmds"]
    same = {
        t: [
            (x["texts_equal_to_raw"], int(n))
            for r in res["runs"]["throughput"][t]
            for n, x in r["levels"].items()
        ]
        for t in SERVERS
    }
    same_line = "greedy texts equal to raw's, all runs: " + ", ".join(
        f"{t} {sum(a for a, _ in v)}/{sum(b for _, b in v)}" for t, v in same.items()
    )
    print(same_line)
    md = (
        f"# sluice vs llama-server, {res['date']}\n\n"
        f"SmolLM2-135M-Instruct Q4_1, {st['threads']} threads for every process, "
        f"{st['rounds']} round{'s' * (st['rounds'] > 1)} (every server and the raw worker "
        "started fresh for each round of each scenario; one target running at a time; "
        + (
            f"throughput: the three targets alive side by side, {st['reps']} repetitions per "
            "round, each level measured on the three back to back in an order that rotates; "
            if st.get("reps")
            else "the order of the targets rotates every round; "
        )
        + f"mixed: the two servers one after the other), {CTX} tokens of context per slot. The same client for both servers "
        "(the harness's: one blocking socket per stream, streaming `/v1/chat/completions`, "
        "temperature 0, `ignore_eos`).\n\n"
        f"{report.machine_line(mach, load, platform=True)}; others' CPU during a measurement at most "
        f"{max(foreign):.2f} cores.\n\n"
        "Commands:\n\n"
        f"- raw: `{' '.join(cmds['raw'])}` (no server, no HTTP)\n"
        f"- llama-server: `{' '.join(cmds['llama-server'])}` (throughput); "
        f"`{' '.join(cmds['llama-server-mixed'])}` (mixed), built from llama-cpp-python "
        f"{bi.get('llama_cpp_python')}'s vendored llama.cpp with "
        f"`{' '.join(bi.get('cmake_flags', []))}`\n"
        f"- sluice: `{' '.join(cmds['sluice'])}` (throughput); "
        f"`{' '.join(cmds['sluice-mixed'])}` (mixed)\n\n"
        + (f"Note: {st['note']}\n\n" if st.get("note") else "")
        + f"![sluice vs llama-server]({stem}.png)\n\n"
        f"## Throughput: 1, 4, 8 streams, 8 slots each, {st['tokens']} tokens per stream\n\n"
        + throughput_table(summary, markdown=True)
        + "\n\ntok/s, medians over rounds. agg = completion tokens / wall time (first request "
        "sent -> last stream done); dec = tokens after the first / time after the first "
        "token, summed over streams; ratios of the medians, except sluice/llama paired = the "
        + (
            "median over the repetitions of each one's ratio (the two servers measured seconds "
            "apart; the target is judged on it; every repetition's figures in the JSON);"
            if st.get("reps")
            else "median of each round's ratio (the two servers back to back; the target is "
            "judged on it; per-round figures in the JSON);"
        )
        + " CPU ms/tok = the server's (or raw worker's) CPU time per generated token. "
        f"{same_line} (batched float math may flip a late greedy tie).\n\n"
        f"## Mixed load: a {summary['mixed']['sluice']['long_prompt_tokens']}-token prompt and "
        "4 short requests, 4 slots each\n\n"
        + mixed_table(summary, markdown=True)
        + f"\n\nThe long prompt ({st['long_tokens']} tokens out) is sent at 0; the four short "
        f"requests ({st['short_tokens']} tokens out each) at {st['short_at'] * 1000:.0f} ms "
        f"and then every {st['short_every'] * 1000:.0f} ms. TTFT = request sent -> first "
        "content chunk, client side. Gaps during the long prefill = the short streams' "
        "inter-token gaps that start before the long request's first token; alone = the same "
        "four requests, same schedule, without the long one. Medians over rounds of the "
        "per-round figures (per-round values in the JSON).\n\n"
        "## Targets\n\n" + report.targets_and_checks(met, res["checks"], st["reproduce"])
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    report.save_report(out_dir, stem, res, md)
    png = out_dir / f"{stem}.png"
    plot(res, png)
    shutil.copyfile(png, out_dir / "vs-llama-server-latest.png")
    print(f"wrote {png} and {out_dir / 'vs-llama-server-latest.png'}")


# --- main -------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="1 round, fewer tokens, a shorter long prompt"
    )
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 1)")
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="throughput: repetitions per round, the targets back to back (default 3, quick 1)",
    )
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, every process")
    ap.add_argument("--tokens", type=int, default=None, help="throughput: tokens per stream (128)")
    ap.add_argument(
        "--long-words", type=int, default=None, help="the long prompt, words (2860: ~3,300 tokens)"
    )
    ap.add_argument("--short-tokens", type=int, default=None, help="tokens per short request (32)")
    ap.add_argument("--short-at", type=float, default=0.3, help="first short request, s after")
    ap.add_argument("--short-every", type=float, default=0.1, help="s between short requests")
    ap.add_argument(
        "--llama-batch", type=int, default=BATCH, help="llama-server -b (default 512 = sluice's)"
    )
    ap.add_argument("--quiet", type=float, default=0.3, help="noise threshold, in cores")
    ap.add_argument("--quiet-timeout", type=float, default=None, help="s (default 20, quick 3)")
    ap.add_argument(
        "--only", choices=["throughput", "mixed"], help="run one scenario (default: both)"
    )
    ap.add_argument(
        "--sluice-args", default="", help="more arguments for sluice serve (a settings A/B)"
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", default="", help="a note stored with the results")
    ap.add_argument("--report", type=Path, help="rewrite the .md and .png of a results .json")
    args = ap.parse_args()
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit(f"vs_llama_server: the plot needs matplotlib: {INSTALL_HINT}")
    if args.report:
        res = json.loads(args.report.read_text())
        res["summary"] = summarize(res["runs"])  # figures added since are derived too
        res["met"] = targets_met(res["summary"])
        write_report(res, args.report.parent)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # processes closed on the way out
    reproduce = ".venv/bin/python benchmarks/vs_llama_server.py" + " --quick" * args.quick
    reproduce += f" --rounds {args.rounds}" * bool(args.rounds)
    reproduce += f" --reps {args.reps}" * bool(args.reps)
    reproduce += f" --threads {args.threads}" * (args.threads != 2)
    reproduce += f" --llama-batch {args.llama_batch}" * (args.llama_batch != BATCH)
    reproduce += f" --only {args.only}" * bool(args.only)
    reproduce += f" --sluice-args {shlex.quote(args.sluice_args)}" * bool(args.sluice_args)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.reps = args.reps or (1 if args.quick else 3)
    args.tokens = args.tokens or (32 if args.quick else 128)
    args.long_words = args.long_words or (1000 if args.quick else 2860)
    args.short_tokens = args.short_tokens or (16 if args.quick else 32)
    args.long_tokens = 16
    if args.quiet_timeout is None:
        args.quiet_timeout = 3.0 if args.quick else 20.0
    args.llama_server = ensure_llama_server()  # built (once) before anything is timed
    args.tmp = Path(tempfile.mkdtemp(prefix="sluice-vs-llama-server-"))
    (args.tmp / "models").mkdir()
    started, load_start = report.now(), loadavg()
    print(
        f"vs_llama_server: rounds={args.rounds} threads={args.threads} tokens={args.tokens} "
        f"load={load_start}; logs in {args.tmp}",
        flush=True,
    )
    runs: dict[str, Any] = {
        "throughput": {t: [] for t in TARGETS},
        "mixed": {s: [] for s in SERVERS},
    }
    cmds: dict[str, list[str]] = {}
    for rnd in range(1, args.rounds + 1):
        if args.only != "mixed":
            print(f"  round {rnd}/{args.rounds}: throughput, {args.reps} repetitions", flush=True)
            for t, entries in throughput_round(args, rnd).items():
                cmds[t] = entries[0]["cmd"]
                runs["throughput"][t].extend(entries)
        order2 = rotated(SERVERS, rnd - 1)
        if args.only != "throughput":
            print(f"  round {rnd}/{args.rounds}: mixed load, {' -> '.join(order2)}", flush=True)
        for s in order2 if args.only != "throughput" else []:
            r = mixed_round(s, args, rnd)
            cmds[f"{s}-mixed"] = r["cmd"]
            runs["mixed"][s].append(r)
    for t in TARGETS:  # the texts were only needed for the checks below
        for r in runs["throughput"][t]:
            for n, x in r["levels"].items():
                if t != "raw":
                    raw_texts = runs["throughput"]["raw"][r["round"] - 1]["levels"][n]["texts"]
                    x["texts_equal_to_raw"] = sum(a == b for a, b in zip(x["texts"], raw_texts))
    for t in TARGETS:
        for r in runs["throughput"][t]:
            for x in r["levels"].values():
                x.pop("texts", None)
    summary = summarize(runs)
    res = {
        "date": started.isoformat(timespec="seconds"),
        "stamp": report.stamp(started),
        "finished": report.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "llama_server_build": build_info(args.llama_server),
        "load_average": {"start": load_start, "end": loadavg()},
        "settings": {
            "rounds": args.rounds,
            "reps": args.reps,
            "threads": args.threads,
            "levels": list(LEVELS),
            "parallel": PARALLEL,
            "mixed_parallel": MIXED_PARALLEL,
            "ctx_per_slot": CTX,
            "batch": BATCH,
            "llama_batch": args.llama_batch,
            "tokens": args.tokens,
            "long_words": args.long_words,
            "long_tokens": args.long_tokens,
            "short_tokens": args.short_tokens,
            "short_at": args.short_at,
            "short_every": args.short_every,
            "quiet_threshold_cores": args.quiet,
            "quick": args.quick,
            "cmds": cmds,
            "note": args.note,
            "reproduce": reproduce,
        },
        "goals": GOALS,
        "summary": summary,
        "runs": runs,
    }
    res["met"] = targets_met(summary)
    res["checks"] = checks(runs, args)
    if args.only:  # one scenario: the tables and the JSON; the report and plot need both
        if args.only == "throughput":
            print("\n" + throughput_table(summary, markdown=False))
        else:
            print("\n" + mixed_table(summary, markdown=False))
        report.print_outcome(res["met"], res["checks"])
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"vs-llama-server-{res['stamp']}-{args.only}.json"
        path.write_text(json.dumps(res, indent=1))
        print(f"wrote {path}")
    else:
        write_report(res, args.out_dir)
    shutil.rmtree(args.tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
