#!/usr/bin/env python
"""Cold start: request -> first token for a model that is not loaded, sluice vs llama.cpp.

Two sides, alternated round by round so that machine noise hits both:

* **direct** (the anchor): a fresh Python process that, through llama-cpp-python's
  low-level API and with the parameters ``LlamaRunner.load`` uses (``n_ctx = ctx *
  parallel``, ``n_seq_max = parallel``, ``n_batch = n_ubatch = batch``,
  ``kv_unified = False``, same thread count, no GPU layers), loads the model,
  creates the context, tokenizes the prompt (``add_special``, ``parse_special``,
  as sluice's ``/v1/completions`` does), decodes it and samples the first token
  greedily. Timed from just before ``llama_model_load_from_file`` to the sampled
  token; the process start, imports and ``llama_backend_init`` are not counted.
* **sluice**: one ``sluice serve --threads T --ctx C --parallel P`` process (empty
  ``SLUICE_MODELS_DIR``) with another model loaded. Each round makes the measured
  model cold (``POST /api/v1/models/unload`` if it is loaded; in the first round it
  has never been loaded), then sends a streaming ``/v1/completions`` request for it
  (same prompt, ``max_tokens`` 1, temperature 0) and times request sent -> first
  content chunk received, on a plain socket.

``gemma-3-270m`` is measured on a server started with its default model
(``smollm2``) loaded; ``smollm2-135m-instruct`` on a second server started with
``--model gemma3-270m``. The servers run one after the other, never together.

Where sluice's time goes is read from its log (``--log-level info``): the
registry's ``loaded '<model>' in X s`` (the whole load, sluice's model object
included) and, when the runner logs them, llama.cpp's phases (model file, context)
and the runner's own vocabulary tables.

Usage::

    .venv/bin/python benchmarks/cold_start.py                # 5 rounds per model
    .venv/bin/python benchmarks/cold_start.py --repeats 3 --models gemma-3-270m

Writes ``benchmarks/results/cold-start-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from harness import REPO, RESULTS, client
from harness.machine import Noise, loadavg, machine_info
from harness.raw import context_params, quiet_llama_log
from harness.report import machine_line, now, print_outcome, render_table, save_report, stamp
from harness.servers import SLUICE, Server, free_port, models_env
from harness.stats import med, rotated

# Short enough that the prefill is a small part of a cold start, long enough to be a
# real prompt (about 30 tokens with either vocabulary).
PROMPT = (
    "The history of the bicycle begins in the early nineteenth century, when "
    "inventors in Europe built the first two-wheeled machines. The first of them"
)

# The model measured -> the server's --model (another model, loaded at start).
OTHER_MODEL = {
    "gemma-3-270m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "gemma3-270m",
}


def model_path(name: str) -> str:
    """The GGUF file sluice loads for a packaged model (assembled once if need be)."""
    from sluice.models.catalog import resolve_model

    return str(resolve_model(name).path)


# ---------------------------------------------------------------------------
# direct: a fresh process per measurement
# ---------------------------------------------------------------------------


def direct_worker_main(args: argparse.Namespace) -> None:
    """Load, create the context, prefill the prompt, sample one token; report the times.

    Protocol: prints ``{"ready": true}`` once imports and the backend are done, waits
    for one line on stdin, then measures and prints the result as one JSON line.
    """
    import llama_cpp as L

    quiet_llama_log(L)
    L.llama_backend_init()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    sys.stdin.readline()

    t0 = time.perf_counter()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = L.llama_model_load_from_file(args.direct.encode(), mparams)
    if not model:
        raise SystemExit(f"direct: cannot load {args.direct}")
    t1 = time.perf_counter()
    cparams = context_params(L, args.threads, args.parallel, args.ctx, args.batch)
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("direct: cannot create the context")
    t2 = time.perf_counter()
    vocab = L.llama_model_get_vocab(model)
    data = PROMPT.encode()
    cap = len(data) + 8
    arr = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, data, len(data), arr, cap, True, True)
    if n <= 0:
        raise SystemExit("direct: tokenize failed")
    batch = L.llama_batch_init(int(L.llama_n_batch(ctx)), 0, 1)
    for i in range(n):
        batch.token[i] = arr[i]
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == n - 1
    batch.n_tokens = n
    chain_params = L.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    chain = L.llama_sampler_chain_init(chain_params)
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("direct: decode failed")
    token = int(L.llama_sampler_sample(chain, ctx, n - 1))
    t3 = time.perf_counter()

    buf = ctypes.create_string_buffer(256)
    k = L.llama_token_to_piece(vocab, token, buf, 256, 0, False)
    print(
        json.dumps(
            {
                "total_s": t3 - t0,
                "model_s": t1 - t0,
                "context_s": t2 - t1,
                "first_token_s": t3 - t2,
                "prompt_tokens": n,
                "token": token,
                "text": buf.raw[: max(k, 0)].decode("utf-8", "replace"),
                "n_vocab": int(L.llama_vocab_n_tokens(vocab)),
            }
        ),
        flush=True,
    )
    L.llama_sampler_free(chain)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


class DirectRun:
    """One direct measurement: a fresh worker process, started before the clock."""

    def __init__(self, args: argparse.Namespace, path: str) -> None:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--_direct",
            path,
            "--threads",
            str(args.threads),
            "--ctx",
            str(args.ctx),
            "--parallel",
            str(args.parallel),
            "--batch",
            str(args.batch),
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=REPO
        )
        self._read()  # ready: imports and backend init done

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"cold_start: the direct worker died (rc {self.proc.wait()})")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        res = self._read()
        self.proc.stdin.close()
        self.proc.wait(60)
        return res

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------
# sluice over HTTP
# ---------------------------------------------------------------------------

_LOADED_RE = re.compile(r"sluice\.registry: loaded '(?P<name>[^']+)' in (?P<s>[\d.]+) s")
# The runner's phases, if this version of sluice logs them.
_PHASES_RE = re.compile(
    r"sluice\.llama: loaded (?P<name>.+?): model (?P<model>[\d.]+) s, "
    r"context (?P<context>[\d.]+) s, vocabulary tables (?P<tables>[\d.]+) s"
)


class ColdServer(Server):
    """sluice with another model loaded, an empty models folder, logging at ``info``."""

    def __init__(self, args: argparse.Namespace, default_model: str, log_path: Path) -> None:
        self.models_dir = tempfile.TemporaryDirectory(prefix="sluice-cold-models-")
        port = free_port()
        cmd = [*SLUICE, "--port", str(port), "--model", default_model]
        cmd += ["--threads", str(args.threads), "--ctx", str(args.ctx)]
        cmd += ["--parallel", str(args.parallel), "--batch", str(args.batch), "--log-level", "info"]
        super().__init__("sluice", cmd, port, log_path, env=models_env(self.models_dir.name))

    def status(self, name: str) -> str:
        return str(self.health()["models"].get(name, {}).get("status", "unknown"))

    def make_cold(self, name: str) -> bool:
        """Unload ``name`` if it is loaded; True if it had to be unloaded."""
        state = self.status(name)
        if state == "not_loaded":
            return False
        if state != "loaded":
            raise SystemExit(f"cold_start: {name} is {state}")
        self.post("/api/v1/models/unload", {"instance_id": name})
        deadline = time.monotonic() + 30
        while self.status(name) != "not_loaded":
            if time.monotonic() > deadline:
                raise SystemExit(f"cold_start: {name} did not unload")
            time.sleep(0.05)
        return True

    def close(self, timeout: float = 20.0) -> int | None:
        rc = super().close(timeout)
        self.models_dir.cleanup()
        return rc


def sluice_request(server: ColdServer, name: str) -> dict[str, Any]:
    """One streaming /v1/completions request on a blocking socket: time to first text."""
    body = {
        "model": name,
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = client.send(server.port, "/v1/completions", json.dumps(body).encode(), client.TEXT)
    parsed = res.parse()
    if parsed["status"] != 200 or not res.t_first:
        raise SystemExit(f"cold_start: no first token from sluice: {bytes(res.raw[:600])!r}")
    return {
        "ttft_s": res.ttft,
        "text": parsed["text"],
        "prompt_tokens": (parsed["usage"] or {}).get("prompt_tokens"),
        "finish": parsed["finish"],
    }


def sluice_run(server: ColdServer, name: str) -> dict[str, Any]:
    offset = server.log_size()
    res = sluice_request(server, name)
    time.sleep(0.1)  # let the log lines land
    log = server.log_since(offset)
    loaded = [m for m in _LOADED_RE.finditer(log) if m.group("name") == name]
    phases = [m for m in _PHASES_RE.finditer(log) if m.group("name") == name]
    if len(loaded) != 1:
        raise SystemExit(f"cold_start: expected one load of {name} in the server log, got:\n{log}")
    res["registry_load_s"] = float(loaded[0].group("s"))
    if phases:
        p = phases[-1]
        res["model_s"] = float(p.group("model"))
        res["context_s"] = float(p.group("context"))
        res["tables_s"] = float(p.group("tables"))
    return res


# ---------------------------------------------------------------------------
# orchestration and report
# ---------------------------------------------------------------------------


def measure_model(
    args: argparse.Namespace, name: str, log_path: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], list[str]]:
    path = model_path(name)
    server = ColdServer(args, OTHER_MODEL[name], log_path)
    direct: list[dict[str, Any]] = []
    slu: list[dict[str, Any]] = []
    checks: list[str] = []
    try:
        if server.status(name) != "not_loaded":
            raise SystemExit(f"cold_start: {name} is loaded at start (--model clash?)")
        for rnd in range(args.repeats):
            order = rotated(("direct", "sluice"), rnd)
            for attempt in range(args.max_retries + 1):
                pair: dict[str, dict[str, Any]] = {}
                for side in order:
                    quiet = (args.quiet, args.quiet_timeout)
                    if side == "direct":
                        worker = DirectRun(args, path)
                        try:
                            noise = Noise([server.pid, worker.proc.pid])
                            res, foreign, before = noise.run(worker.run, *quiet)
                        finally:
                            worker.kill()
                    else:
                        was_loaded = server.make_cold(name)
                        time.sleep(0.3)  # let the unload's threads settle
                        run = partial(sluice_run, server, name)
                        res, foreign, before = Noise([server.pid]).run(run, *quiet)
                        res = {"was_loaded": was_loaded, **res}
                    res["foreign_cores"] = foreign
                    res["foreign_cores_before"] = before
                    pair[side] = res
                    extra = ""
                    if side == "sluice":
                        extra = f"  (registry load {res['registry_load_s'] * 1000:.0f} ms"
                        if "tables_s" in res:
                            extra += (
                                f"; model {res['model_s'] * 1000:.0f}, context "
                                f"{res['context_s'] * 1000:.0f}, tables {res['tables_s'] * 1000:.0f} ms"
                            )
                        extra += ")"
                    else:
                        extra = (
                            f"  (model {res['model_s'] * 1000:.0f}, context "
                            f"{res['context_s'] * 1000:.0f}, first token {res['first_token_s'] * 1000:.0f} ms)"
                        )
                    key = "total_s" if side == "direct" else "ttft_s"
                    print(
                        f"  {name} round {rnd + 1}/{args.repeats} {side:6s} "
                        f"{res[key] * 1000:7.1f} ms{extra}  (others used {res['foreign_cores']:.2f} cores)",
                        flush=True,
                    )
                worst = max(p["foreign_cores"] for p in pair.values())
                if worst <= args.quiet or attempt == args.max_retries:
                    if worst > args.quiet:
                        checks.append(
                            f"{name} round {rnd + 1}: kept a pair measured while others used "
                            f"{worst:.2f} cores"
                        )
                    break
                print(f"  (others used {worst:.2f} cores during the pair: measuring it again)")
            d, s = pair["direct"], pair["sluice"]
            s["round"] = d["round"] = rnd + 1
            if d["prompt_tokens"] != s["prompt_tokens"]:
                checks.append(
                    f"{name} round {rnd + 1}: prompt tokens differ: direct {d['prompt_tokens']}, "
                    f"sluice {s['prompt_tokens']}"
                )
            if d["text"] != s["text"]:
                checks.append(
                    f"{name} round {rnd + 1}: first token differs: direct {d['text']!r}, "
                    f"sluice {s['text']!r}"
                )
            direct.append(d)
            slu.append(s)
    finally:
        server.close()
    return direct, slu, checks, server.cmd


def summarize(direct: list[dict[str, Any]], slu: list[dict[str, Any]]) -> dict[str, Any]:
    d_total = [x["total_s"] for x in direct]
    s_total = [x["ttft_s"] for x in slu]
    row: dict[str, Any] = {
        "direct_ms": med(d_total) * 1000,
        "sluice_ms": med(s_total) * 1000,
        "direct_min_ms": min(d_total) * 1000,
        "sluice_min_ms": min(s_total) * 1000,
        "sluice_first_round_ms": s_total[0] * 1000,
        "direct_model_ms": med([x["model_s"] for x in direct]) * 1000,
        "direct_context_ms": med([x["context_s"] for x in direct]) * 1000,
        "direct_first_token_ms": med([x["first_token_s"] for x in direct]) * 1000,
        "sluice_registry_load_ms": med([x["registry_load_s"] for x in slu]) * 1000,
        # request -> first token minus the whole load: HTTP, routing, prompt
        # preparation, prefill and first token, SSE (10 ms resolution: the log's).
        "sluice_outside_load_ms": med([x["ttft_s"] - x["registry_load_s"] for x in slu]) * 1000,
    }
    if all("tables_s" in x for x in slu):
        row["sluice_model_ms"] = med([x["model_s"] for x in slu]) * 1000
        row["sluice_context_ms"] = med([x["context_s"] for x in slu]) * 1000
        row["sluice_tables_ms"] = med([x["tables_s"] for x in slu]) * 1000
        # the registry's load minus the runner's: LocalModel's own set-up (engine
        # thread, chat template, prompt guard, ...), 10 ms resolution
        row["sluice_local_model_ms"] = (
            med([x["registry_load_s"] - x["model_s"] - x["context_s"] - x["tables_s"] for x in slu])
            * 1000
        )
    row["ratio"] = row["sluice_ms"] / row["direct_ms"]
    row["ratio_paired_median"] = med([s["ttft_s"] / d["total_s"] for d, s in zip(direct, slu)])
    row["max_foreign_cores"] = max(x["foreign_cores"] for x in direct + slu)
    return row


TARGET = 1.1  # sluice / direct, request -> first token of a cold model


def table(summary: dict[str, Any], markdown: bool) -> str:
    head = [
        "model",
        "direct ms",
        "sluice ms",
        "ratio",
        "paired ratio",
        "sluice 1st round ms",
        "direct: model / ctx / 1st token ms",
        "sluice: load ms (model / ctx / tables)",
        "sluice outside load ms",
    ]
    rows = []
    for name, x in summary.items():
        load = f"{x['sluice_registry_load_ms']:.0f}"
        if "sluice_tables_ms" in x:
            load += (
                f" ({x['sluice_model_ms']:.0f} / {x['sluice_context_ms']:.0f} / "
                f"{x['sluice_tables_ms']:.0f})"
            )
        rows.append(
            [
                name,
                f"{x['direct_ms']:.0f}",
                f"{x['sluice_ms']:.0f}",
                f"{x['ratio']:.3f}",
                f"{x['ratio_paired_median']:.3f}",
                f"{x['sluice_first_round_ms']:.0f}",
                (
                    f"{x['direct_model_ms']:.0f} / {x['direct_context_ms']:.0f} / "
                    f"{x['direct_first_token_ms']:.0f}"
                ),
                load,
                f"{x['sluice_outside_load_ms']:.0f}",
            ]
        )
    return render_table(head, rows, markdown)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5, help="rounds per model (default 5)")
    ap.add_argument(
        "--models",
        default="gemma-3-270m,smollm2-135m-instruct",
        help=f"models to measure, comma-separated (of: {', '.join(OTHER_MODEL)})",
    )
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1)")
    ap.add_argument("--ctx", type=int, default=512, help="context per sequence (default 512)")
    ap.add_argument("--parallel", type=int, default=1, help="slots (default 1)")
    ap.add_argument("--batch", type=int, default=512, help="n_batch = n_ubatch (default 512)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.15,
        help="a measurement is clean if other processes used at most this many cores",
    )
    ap.add_argument("--quiet-timeout", type=float, default=60.0)
    ap.add_argument(
        "--max-retries", type=int, default=3, help="re-measure a disturbed pair (default 3)"
    )
    ap.add_argument("--note", default="", help="a note stored with the results")
    ap.add_argument("--_direct", dest="direct", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.direct:
        direct_worker_main(args)
        return

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in OTHER_MODEL:
            sys.exit(f"cold_start: unknown model {m!r} (known: {', '.join(OTHER_MODEL)})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = now()
    load_start = loadavg()
    print(
        f"cold_start: models={models} repeats={args.repeats} threads={args.threads} "
        f"ctx={args.ctx} parallel={args.parallel} batch={args.batch} load={load_start}",
        flush=True,
    )
    when = stamp(started)
    runs: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    checks: list[str] = []
    server_cmds: dict[str, list[str]] = {}
    for name in models:
        log_path = Path(tempfile.gettempdir()) / f"sluice-cold-start-{when}-{name}.log"
        direct, slu, model_checks, cmd = measure_model(args, name, log_path)
        runs[name] = {"direct": direct, "sluice": slu, "server_log": str(log_path)}
        server_cmds[name] = cmd
        summary[name] = summarize(direct, slu)
        checks += model_checks
    finished = now()
    load_end = loadavg()
    mach = machine_info()

    print()
    print(table(summary, markdown=False))
    print()
    for name, x in summary.items():
        met = x["ratio"] <= TARGET
        print(
            f"{name}: sluice/direct {x['ratio']:.3f} (paired median {x['ratio_paired_median']:.3f}) "
            f"vs target <= {TARGET}: {'met' if met else 'NOT met'}"
        )
        where = (
            f"  sluice extra {x['sluice_ms'] - x['direct_ms']:.0f} ms: the load took "
            f"{x['sluice_registry_load_ms']:.0f} ms (direct model+context "
            f"{x['direct_model_ms'] + x['direct_context_ms']:.0f} ms)"
        )
        if "sluice_tables_ms" in x:
            where += (
                f", of which llama.cpp {x['sluice_model_ms'] + x['sluice_context_ms']:.0f}, "
                f"runner tables {x['sluice_tables_ms']:.0f}, LocalModel set-up ~{x['sluice_local_model_ms']:.0f}"
            )
        where += (
            f"; outside the load {x['sluice_outside_load_ms']:.0f} ms "
            f"(direct first token {x['direct_first_token_ms']:.0f} ms)"
        )
        print(where)
    print_outcome({}, checks, {"start": load_start, "end": load_end})

    reproduce = (
        f".venv/bin/python benchmarks/cold_start.py --repeats {args.repeats}"
        + (f" --models {args.models}" if models != list(OTHER_MODEL) else "")
        + (f" --threads {args.threads}" if args.threads != 1 else "")
        + (f" --ctx {args.ctx}" if args.ctx != 512 else "")
        + (f" --parallel {args.parallel}" if args.parallel != 1 else "")
    )
    settings = {
        "threads": args.threads,
        "ctx_per_seq": args.ctx,
        "parallel": args.parallel,
        "n_batch": args.batch,
        "repeats": args.repeats,
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "quiet_threshold_cores": args.quiet,
        "server_cmds": server_cmds,
        "note": args.note,
        "reproduce": reproduce,
    }
    doc: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "machine": mach,
        "load_average": {"start": load_start, "end": load_end},
        "settings": settings,
        "target": {
            "ratio_max": TARGET,
            "met": {n: x["ratio"] <= TARGET for n, x in summary.items()},
        },
        "summary": summary,
        "checks": checks,
        "runs": runs,
    }
    md = (
        f"# Cold start {started.isoformat(timespec='seconds')}\n\n"
        "Request -> first token for a model that is not loaded: sluice (streaming "
        "`/v1/completions`, `max_tokens` 1, temperature 0, while another model is loaded) vs "
        "llama.cpp direct (a fresh process: load, context, tokenize, decode, greedy sample; "
        "process start excluded). Median of "
        f"{args.repeats} rounds, direct and sluice alternating.\n\n"
        f"{machine_line(mach, doc['load_average'])}.\n"
        f"Parameters: threads {args.threads}, ctx {args.ctx} per sequence, parallel "
        f"{args.parallel}, batch {args.batch}; prompt of "
        + ", ".join(f"{runs[n]['direct'][0]['prompt_tokens']} tokens ({n})" for n in models)
        + ".\n\n"
        + (f"Note: {args.note}\n\n" if args.note else "")
        + table(summary, markdown=True)
        + "\n\nratio = sluice median / direct median; paired ratio = median of the per-round "
        "ratios. sluice load = the registry's load time from its log (10 ms resolution), with "
        "the runner's phases when logged; outside load = request -> first token minus that "
        "(HTTP, routing, prompt preparation, prefill and first token, SSE). The first round "
        "also sizes the model from its GGUF metadata (cached afterwards).\n\n"
        + "".join(
            f"Target {n}: ratio <= {TARGET}: {'met' if x['ratio'] <= TARGET else 'not met'} "
            f"({x['ratio']:.3f}).\n"
            for n, x in summary.items()
        )
        + ("\nChecks:\n" + "".join(f"- {c}\n" for c in checks) if checks else "")
        + f"\nReproduce: `{reproduce}`\n"
    )
    save_report(args.out_dir, f"cold-start-{when}", doc, md)


if __name__ == "__main__":
    main()
