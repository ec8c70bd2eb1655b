#!/usr/bin/env python
"""Embedding throughput: sluice against llama.cpp's own ``llama-server`` in one run.

Both serve the packaged SmolLM2-135M-Instruct Q4_1 (``harness.model_path()``) with mean
pooling and L2-normalized vectors, ``--threads T`` (default 2) each, side by side for
the whole run (the one not measured idles):

* sluice: ``python -m sluice serve --threads T`` (an empty models folder), its
  ``POST /v1/embeddings``. A local model embeds on a pooled context made on its first
  embedding request: 4,096 tokens, ``n_batch = n_ubatch = 4096``, at most 64 sequences,
  a unified KV cache, mean pooling for this chat model; a request's inputs go through
  one ``llama_decode`` where they fit (``engine/llama_embed.py``).
* llama-server (``harness/llama_build.py``: built from the llama.cpp that the pinned
  llama-cpp-python vendors, cached): ``--embeddings --pooling mean -t T -np 64 -kvu
  -c 4096 -b 4096 -ub 4096``, its OpenAI-compatible ``POST /v1/embeddings``. The same
  window as sluice's embedding context: 64 slots, so that the 64 inputs of a request
  (each a task of its own) go through one decode, and a unified KV cache of 4,096 tokens
  that any slot may use; ``-b`` = ``-ub`` since a pooled sequence must fit one ubatch.
  Its ``--embd-normalize`` stays at its default, 2 (Euclidean: L2, as sluice).

Workload: each request carries distinct short English sentences (8-15 words,
deterministic: ``harness.prompts``' story sentences, never repeated in a run, so no
cache can hold one), ``encoding_format: "float"``. Levels (``--levels``, ``CxN``: C
requests at once of N texts each): ``1x64``, one request of 64 texts at a time, the
figure the issue names; ``8x8``, eight concurrent requests of 8 texts. A measurement is
``--requests`` such waves in a row (each connection opened before the clock), and
``texts/s`` = texts / the sum of the waves' wall times (first request sent -> last byte
of the last answer, client side: tokenizing, decoding, pooling, JSON and HTTP all
count).

Method: the two servers take turns, one level at a time, the order rotated round by
round (``harness.stats.rotated``), both answering the same texts in a round; each
measurement first waits (up to ``--quiet-timeout`` s) until other processes use less
than ``--quiet`` cores over one second and records what they used during it
(``harness.machine.Noise``). A warm-up first: sluice makes its pooled context on the
first embedding request. Per round and level the ratio sluice / llama-server of
texts/s (measured seconds apart) is the paired ratio; the report gives the medians of
each side, the median of the paired ratios with their range, and how many reach 1.00.
Target: sluice >= 1.00x llama-server at ``1x64`` (the paired median).

Checks: every answer has as many vectors as texts, of one dimension on both sides,
norm 1; the prompt tokens each side reports are equal (same tokenization); the cosine
similarity of sluice's and llama-server's vector for every text (~1.0 when the pooling
and the normalization match: the same kernels, batched alike); measurements disturbed
by other processes.

Usage: ``.venv/bin/python benchmarks/embeddings.py [--rounds 5] [--requests 5]``;
writes ``benchmarks/results/embeddings-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from harness import RESULTS, model_path
from harness.client import body_of, connect
from harness.llama_build import build_info, ensure_llama_server
from harness.machine import Noise, loadavg, machine_info, proc_cpu_seconds
from harness.prompts import sentence
from harness.report import (
    machine_line,
    now,
    print_outcome,
    render_table,
    save_report,
    stamp,
    targets_and_checks,
)
from harness.servers import SLUICE, LlamaServer, Server, free_port, models_env
from harness.stats import med, rotated

SIDES = ("sluice", "llama-server")
PATH = "/v1/embeddings"
WINDOW = 4096  # sluice's embedding context (local/model.py EMBED_CTX); llama-server's -c
TARGET_LEVEL = "1x64"
MIN_COSINE = 0.999  # below this a text's two vectors are named in the checks
NORM_TOLERANCE = 1e-3


# -- texts -----------------------------------------------------------------------------


class Texts:
    """Distinct short sentences (8-15 words), deterministic, never repeated in a run."""

    def __init__(self, seed: str = "sluice-embeddings") -> None:
        self.rng = random.Random(seed)
        self.seen: set[str] = set()

    def take(self, n: int) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            s = sentence(self.rng)
            if 8 <= len(s.split()) <= 15 and s not in self.seen:
                self.seen.add(s)
                out.append(s)
        return out


def parse_level(text: str) -> tuple[int, int]:
    """``CxN`` -> (C requests at once, N texts each)."""
    at_once, _, per = text.partition("x")
    try:
        c, n = int(at_once), int(per)
    except ValueError:
        raise SystemExit(f"embeddings: a level is CxN (e.g. 1x64), not {text!r}") from None
    if c < 1 or n < 1:
        raise SystemExit(f"embeddings: bad level {text!r}")
    return c, n


# -- client ----------------------------------------------------------------------------


def request_bytes(port: int, texts: list[str]) -> bytes:
    body = json.dumps({"model": "smollm2", "input": texts, "encoding_format": "float"}).encode()
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nAccept: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def wave(port: int, reqs: list[bytes]) -> tuple[float, list[bytes]]:
    """``reqs`` sent at once (each on a connection opened before the clock), each read
    to EOF: the wall seconds (first sent -> last byte) and the raw answers."""
    start = threading.Event()
    socks = [connect(port) for _ in reqs]
    raws = [bytearray() for _ in reqs]
    t_send = [0.0] * len(reqs)
    t_end = [0.0] * len(reqs)

    def one(i: int) -> None:
        start.wait()
        t_send[i] = time.perf_counter()
        try:
            socks[i].sendall(reqs[i])
            while data := socks[i].recv(1 << 20):
                raws[i] += data
                t_end[i] = time.perf_counter()
        finally:
            socks[i].close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(reqs))]
    for t in threads:
        t.start()
    time.sleep(0.02)
    start.set()
    for t in threads:
        t.join(600)
    if not all(t_end):
        raise SystemExit("embeddings: a request got no answer")
    return max(t_end) - min(t_send), [bytes(r) for r in raws]


def parse_answer(side: str, raw: bytes, n: int) -> tuple[np.ndarray, int]:
    """The vectors of an answer (in input order) and its usage's prompt tokens."""
    head = raw.partition(b"\r\n\r\n")[0]
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"embeddings: {side} answered {raw[:400]!r}")
    doc = json.loads(body_of(raw))
    data = sorted(doc["data"], key=lambda d: d["index"])
    if len(data) != n or [d["index"] for d in data] != list(range(n)):
        raise SystemExit(f"embeddings: {side} answered {len(data)} vectors for {n} texts")
    vectors = np.asarray([d["embedding"] for d in data], dtype=np.float64)
    if vectors.ndim != 2:
        raise SystemExit(f"embeddings: {side}'s vectors differ in length")
    return vectors, int((doc.get("usage") or {}).get("prompt_tokens", 0))


def measure(
    side: str, server: Server, waves: list[list[list[str]]]
) -> tuple[dict[str, Any], np.ndarray]:
    """``waves`` (each C requests of N texts) in a row: texts/s and what was answered;
    the vectors in the order of the texts."""
    walls: list[float] = []
    tokens = 0
    vectors: list[np.ndarray] = []
    cpu0 = proc_cpu_seconds(server.pid)
    answers: list[list[bytes]] = []
    for texts in waves:
        wall, raws = wave(server.port, [request_bytes(server.port, t) for t in texts])
        walls.append(wall)
        answers.append(raws)
    cpu = proc_cpu_seconds(server.pid) - cpu0
    for texts, raws in zip(waves, answers):  # parsed after the clock
        for t, raw in zip(texts, raws):
            vec, used = parse_answer(side, raw, len(t))
            vectors.append(vec)
            tokens += used
    allv = np.concatenate(vectors)
    norms = np.linalg.norm(allv, axis=1)
    n_texts = sum(len(t) for w in waves for t in w)
    return {
        "texts_per_s": n_texts / sum(walls),
        "wave_s": walls,
        "texts": n_texts,
        "prompt_tokens": tokens,
        "server_cpu_s": cpu,
        "dim": int(allv.shape[1]),
        "norm_min": float(norms.min()),
        "norm_max": float(norms.max()),
    }, allv


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape != b.shape:
        raise SystemExit(f"embeddings: vectors of shape {a.shape} vs {b.shape}")
    cos: np.ndarray = np.sum(a * b, axis=1) / (
        np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    )
    return cos


# -- servers ---------------------------------------------------------------------------


def start_servers(args: argparse.Namespace, tmp: Path) -> dict[str, Server]:
    servers: dict[str, Server] = {}
    port = free_port()
    cmd = [*SLUICE, "--port", str(port), "--threads", str(args.threads)]
    cmd += ["--log-level", "warning"]
    (tmp / "models").mkdir(exist_ok=True)
    servers["sluice"] = Server(
        "sluice", cmd, port, tmp / "sluice.log", env=models_env(tmp / "models")
    )
    try:
        port = free_port()
        cmd = [str(args.llama_server), "-m", str(model_path()), "-t", str(args.threads)]
        cmd += ["--embeddings", "--pooling", "mean", "-np", str(args.llama_parallel), "-kvu"]
        cmd += ["-c", str(WINDOW), "-b", str(args.llama_batch), "-ub", str(args.llama_batch)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        servers["llama-server"] = LlamaServer("llama-server", cmd, port, tmp / "llama.log")
    except BaseException:
        servers["sluice"].close()
        raise
    return servers


# -- report ----------------------------------------------------------------------------


def span(xs: list[float], fmt: str = ".3f") -> str:
    """``median [min-max]``."""
    return f"{med(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]" if xs else "-"


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, rounds in res["results"].items():
        s = [r["sluice"]["texts_per_s"] for r in rounds]
        ll = [r["llama-server"]["texts_per_s"] for r in rounds]
        paired = [a / b for a, b in zip(s, ll)]
        out[label] = {
            "sluice_texts_per_s": med(s),
            "llama_texts_per_s": med(ll),
            "ratio_of_medians": med(s) / med(ll),
            "paired": med(paired),
            "paired_all": paired,
            "pairs_at_least_1": sum(p >= 1.0 for p in paired),
            "cosine_min": min(r["cosine_min"] for r in rounds),
            "cosine_median": med([r["cosine_median"] for r in rounds]),
        }
    return out


def checks(res: dict[str, Any], quiet: float) -> list[str]:
    out: list[str] = []
    dims = {r[side]["dim"] for rounds in res["results"].values() for r in rounds for side in SIDES}
    out.append(f"vector dimension: {', '.join(map(str, sorted(dims)))} (both sides)")
    if len(dims) != 1:
        out.append("the two sides' vectors differ in dimension")
    for side in SIDES:
        lo = min(r[side]["norm_min"] for rs in res["results"].values() for r in rs)
        hi = max(r[side]["norm_max"] for rs in res["results"].values() for r in rs)
        ok = abs(lo - 1) < NORM_TOLERANCE and abs(hi - 1) < NORM_TOLERANCE
        out.append(f"{side}: vector norms {lo:.6f}-{hi:.6f}" + ("" if ok else " (NOT 1)"))
    for label, rounds in res["results"].items():
        toks = {side: sum(r[side]["prompt_tokens"] for r in rounds) for side in SIDES}
        same = "equal" if len(set(toks.values())) == 1 else "DIFFERENT"
        texts = sum(r["sluice"]["texts"] for r in rounds)
        out.append(
            f"{label}: prompt tokens {same} (sluice {toks['sluice']}, llama-server "
            f"{toks['llama-server']}, {texts} texts); cosine sluice vs llama-server per "
            f"text: min {min(r['cosine_min'] for r in rounds):.6f}, median "
            f"{med([r['cosine_median'] for r in rounds]):.6f}"
        )
        low = sum(r["cosine_below"] for r in rounds)
        if low:
            out.append(f"{label}: {low} texts with cosine < {MIN_COSINE}")
        for r in rounds:
            for side in SIDES:
                if r[side]["foreign_cores"] > quiet:
                    out.append(
                        f"{label} round {r['round']} {side}: others used "
                        f"{r[side]['foreign_cores']:.2f} cores during it (kept)"
                    )
    return out


def write_report(res: dict[str, Any], out_dir: Path) -> Path:
    st, summary = res["settings"], res["summary"]
    head = [
        "level",
        "requests at once x texts",
        "sluice texts/s",
        "llama-server texts/s",
        "ratio of medians",
        "sluice/llama paired [range]",
        "pairs >= 1",
    ]
    rows = []
    for label, s in summary.items():
        c, n = parse_level(label)
        rows.append(
            [
                label,
                f"{c} x {n}",
                f"{s['sluice_texts_per_s']:.1f}",
                f"{s['llama_texts_per_s']:.1f}",
                f"{s['ratio_of_medians']:.3f}",
                span(s["paired_all"]),
                f"{s['pairs_at_least_1']}/{len(s['paired_all'])}",
            ]
        )
    md = (
        f"# Embedding throughput: sluice vs llama-server ({res['date']})\n\n"
        f"SmolLM2-135M-Instruct Q4_1, mean pooling, L2-normalized, {st['threads']} threads "
        f"each; {st['rounds']} rounds alternating (order rotated), {st['requests']} waves "
        "per measurement, distinct 8-15-word texts, `encoding_format: float`. texts/s = "
        "texts / wall time of the waves (client side); medians over rounds, 'paired' = "
        "median of the per-round ratios sluice / llama-server.\n\n"
        f"{machine_line(res['machine'], res['load_average'])}.\n\n"
        f"sluice: `{' '.join(st['cmds']['sluice'])}`; llama-server: "
        f"`{' '.join(st['cmds']['llama-server'])}`.\n\n"
        + render_table(head, rows, markdown=True)
        + "\n\n"
        + targets_and_checks(res["met"], res["checks"], st["reproduce"])
    )
    return save_report(out_dir, f"embeddings-{res['stamp']}", res, md)


# -- main ------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=5, help="waves per measurement (5)")
    ap.add_argument(
        "--levels", default="1x64,8x8", help="CxN: C requests at once of N texts (1x64,8x8)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-parallel", type=int, default=64, help="llama-server's -np (64)")
    ap.add_argument(
        "--llama-batch", type=int, default=WINDOW, help=f"llama-server's -b and -ub ({WINDOW})"
    )
    ap.add_argument(
        "--quiet", type=float, default=0.3, help="max cores others may use (default 0.3)"
    )
    ap.add_argument("--quiet-timeout", type=float, default=60.0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    levels = {label: parse_level(label) for label in args.levels.split(",")}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers closed on the way out
    reproduce = ".venv/bin/python benchmarks/embeddings.py " + " ".join(sys.argv[1:])
    args.llama_server = ensure_llama_server()  # built (once) before anything is timed
    model_path()  # the packaged GGUF is there
    started, load_start = now(), loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-embeddings-"))
    print(
        f"embeddings: threads={args.threads} rounds={args.rounds} requests={args.requests} "
        f"levels={list(levels)} load={load_start}; logs in {tmp}",
        flush=True,
    )
    texts = Texts()
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in levels}
    servers = start_servers(args, tmp)
    try:
        noise = Noise([s.pid for s in servers.values()])
        for side in SIDES:  # warm-up: sluice makes its pooled context on first use
            for c, n in levels.values():
                warm = [[texts.take(n) for _ in range(c)] for _ in range(2)]
                measure(side, servers[side], warm)
        for rnd in range(args.rounds):
            for li, (label, (c, n)) in enumerate(levels.items()):
                waves = [[texts.take(n) for _ in range(c)] for _ in range(args.requests)]
                entry: dict[str, Any] = {"round": rnd + 1}
                vectors: dict[str, np.ndarray] = {}
                for side in rotated(SIDES, rnd + li):
                    srv = servers[side]
                    srv.wait_idle()
                    time.sleep(0.3)
                    (m, vec), foreign, before = noise.run(
                        partial(measure, side, servers[side], waves),
                        args.quiet,
                        args.quiet_timeout,
                    )
                    m |= {"foreign_cores": foreign, "foreign_cores_before": before}
                    entry[side], vectors[side] = m, vec
                    print(
                        f"  round {rnd + 1}/{args.rounds} {label:5s} {side:12s} "
                        f"{m['texts_per_s']:8.1f} texts/s  ({m['prompt_tokens']} tokens; "
                        f"others used {foreign:.2f} cores)",
                        flush=True,
                    )
                cos = cosines(vectors["sluice"], vectors["llama-server"])
                entry["ratio"] = (
                    entry["sluice"]["texts_per_s"] / entry["llama-server"]["texts_per_s"]
                )
                entry["cosine_min"] = float(cos.min())
                entry["cosine_median"] = float(np.median(cos))
                entry["cosine_below"] = int((cos < MIN_COSINE).sum())
                results[label].append(entry)
                print(
                    f"  round {rnd + 1}/{args.rounds} {label:5s} sluice/llama-server "
                    f"{entry['ratio']:.3f}; cosine min {entry['cosine_min']:.6f}",
                    flush=True,
                )
        cmds = {side: s.cmd for side, s in servers.items()}
    finally:
        for s in servers.values():
            s.close()
    res: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "stamp": stamp(started),
        "machine": machine_info(),
        "llama_server_build": build_info(args.llama_server),
        "load_average": {"start": load_start, "end": loadavg()},
        "settings": {
            "rounds": args.rounds,
            "requests": args.requests,
            "levels": list(levels),
            "threads": args.threads,
            "quiet": args.quiet,
            "cmds": {
                side: [Path(a).name if a.startswith("/") else a for a in cmd]
                for side, cmd in cmds.items()
            },
            "note": args.note,
            "reproduce": reproduce.strip(),
        },
        "results": results,
    }
    res["summary"] = summarize(res)
    target = res["summary"].get(TARGET_LEVEL)
    res["met"] = (
        {} if target is None else {"1x64 sluice/llama paired >= 1.00": target["paired"] >= 1.0}
    )
    res["checks"] = checks(res, args.quiet)
    print()
    for label, s in res["summary"].items():
        print(
            f"{label}: sluice {s['sluice_texts_per_s']:.1f} texts/s, llama-server "
            f"{s['llama_texts_per_s']:.1f} texts/s, paired {span(s['paired_all'])}"
        )
    print_outcome(res["met"], res["checks"], res["load_average"])
    write_report(res, args.out_dir)


if __name__ == "__main__":
    main()
