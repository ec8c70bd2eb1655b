#!/usr/bin/env python
"""Router overhead: one upstream asked directly, through sluice, through LiteLLM.

* **direct**: the upstream, ``sluice serve --threads 1 --parallel 8`` (embedded SmolLM2,
  empty ``SLUICE_MODELS_DIR``), model ``smollm2``;
* **sluice**: a second sluice, ``--config gw.toml --threads 1 --strict-model-names
  --api-key K``: one ``[[upstreams]]`` entry, alias ``up-smollm2`` -> ``smollm2`` (its
  own local default model stays idle; strict names make an unrouted alias a 404);
* **litellm**: the LiteLLM proxy (pinned below; its own venv outside the repo, made on
  first use), ``up-smollm2`` -> ``openai/smollm2`` at the upstream, as fast as it goes:
  one uvicorn worker on uvloop + httptools (sluice's parser), no database, spend and
  error logs off, ``LITELLM_LOG=ERROR`` (no access log), bundled cost map. It will not
  start without a master key, so both gateways check the same key.

Streaming chat completions, temperature 0, ``ignore_eos``, ``max_tokens`` 64 (--quick
16), usage chunk; every stream a distinct conversation whose first token is new to the
upstream's prefix cache (``Prompts``). A measurement is 8 streams per path: one at a
time at concurrency 1, all at once at 8, the paths taking turns wave by wave (order
rotated round by round); connections are opened before the clock; one blocking socket
and thread per stream.

* TTFT = request sent -> first chunk with non-empty ``content``; p50/p95 over all
  streams of all rounds. Added TTFT = p50/p95 of paired differences (``summarize``).
* Throughput = completion tokens / wall time of the waves, median over rounds; ratio to
  direct (of the medians; "paired": median of per-round ratios). Router CPU = the
  gateway process's CPU time per 1000 tokens.
* Identical bytes: one request (seed 42) asked directly twice (the control), through
  sluice and through LiteLLM, after a warm-up so that all see the same prefix cache;
  bodies compared raw and with only ``id`` and ``created`` blanked.

Usage: ``.venv/bin/python benchmarks/router.py [--quick] [--rounds N]``; writes
``benchmarks/results/router-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import re
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import RESULTS, client, model_path, report
from harness.litellm import LITELLM_ENV, LITELLM_PACKAGES, LITELLM_VERSION, ensure_litellm
from harness.machine import Noise, loadavg, machine_info, proc_cpu_seconds
from harness.prompts import QUESTIONS, SYSTEM_TOPICS
from harness.raw import quiet_llama_log
from harness.servers import SLUICE, Server, free_port, models_env
from harness.stats import med, pct, rotated

LITELLM_YAML = """\
model_list:
  - model_name: up-smollm2
    litellm_params: {{model: openai/smollm2, api_base: "http://127.0.0.1:{up}/v1", api_key: none}}
litellm_settings: {{set_verbose: false, turn_off_message_logging: true}}
general_settings: {{disable_spend_logs: true, disable_error_logs: true}}
"""
GW_TOML = """\
[[upstreams]]
name = "up"
url = "http://127.0.0.1:{up}"
models = ["smollm2"]
aliases = {{ "up-smollm2" = "smollm2" }}
"""

PATHS = ("direct", "sluice", "litellm")
MODEL = {"direct": "smollm2", "sluice": "up-smollm2", "litellm": "up-smollm2"}
LEVELS = (1, 8)
STREAMS = 8  # per measurement, in waves of the concurrency
TARGETS = {"added_ttft_p50_ms": 2.0, "throughput_ratio": 0.98}


def start_servers(tmp: Path, key: str, paths: tuple[str, ...]) -> dict[str, Server]:
    """The upstream (path ``direct``) and the gateways of ``paths`` in front of it."""
    env = models_env(tmp / "models")
    (tmp / "models").mkdir()
    sluice = [*SLUICE, "--threads", "1", "--log-level", "warning"]
    up = free_port()
    (tmp / "gw.toml").write_text(GW_TOML.format(up=up))
    (tmp / "litellm.yaml").write_text(LITELLM_YAML.format(up=up))
    ports = {p: up if p == "direct" else free_port() for p in paths}
    cmds = {
        "direct": [*sluice, "--parallel", "8"],
        "sluice": [*sluice, "--config", str(tmp / "gw.toml"), "--strict-model-names"]
        + ["--api-key", key],
        "litellm": [str(ensure_litellm()) if "litellm" in paths else "litellm", "--config"]
        + [str(tmp / "litellm.yaml"), "--host", "127.0.0.1", "--num_workers", "1"],
    }
    litellm_env = {**env, **LITELLM_ENV, "LITELLM_MASTER_KEY": key}
    servers: dict[str, Server] = {}
    try:
        for p in paths:
            servers[p] = Server(
                p,
                [*cmds[p], "--port", str(ports[p])],
                ports[p],
                tmp / f"{p}.log",
                **(
                    {"health": "/health/liveliness", "cwd": tmp, "env": litellm_env}
                    if p == "litellm"
                    else {"env": env}
                ),
            )
    except BaseException:
        for srv in servers.values():
            srv.close()
        raise
    return servers


def settle(up: Server) -> None:
    """Wait until the upstream has no request left, then a little: the next request
    starts on an idle upstream whichever path ended last (a stream's end reaches the
    client sooner directly than through a gateway, with the upstream still busy)."""
    up.wait_idle(timeout=30, poll=0.01, settle=0.05)


class Prompts:
    """Conversations whose first content token is new to the upstream's prefix cache.

    Each opens with a word that is one token of SmolLM2's vocabulary, not used before in
    the run (2000 of them, cycled): every request reuses only the chat template's opening
    from the cache, and conversations of the same ``shape`` (topic and question) have the
    same token count on every path.
    """

    def __init__(self) -> None:
        import llama_cpp as L

        quiet_llama_log(L)
        params = L.llama_model_default_params()
        params.vocab_only = True
        model = L.llama_model_load_from_file(str(model_path()).encode(), params)
        vocab = L.llama_model_get_vocab(model)
        buf, arr = ctypes.create_string_buffer(64), (L.llama_token * 8)()

        def tokens(text: str) -> list[int]:
            n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), arr, 8, False, False)
            return list(arr[: max(n, 0)])

        self.words, self.used = [], 0
        for tok in range(L.llama_vocab_n_tokens(vocab)):
            n = L.llama_token_to_piece(vocab, tok, buf, 64, 0, False)
            w = buf.raw[: max(n, 0)].decode("latin-1")
            plain = len(w) >= 4 and w.isascii() and w.isalpha() and w.istitle()
            if plain and tokens(w + ". You") == [tok, *tokens(". You")]:
                self.words.append(w)
        L.llama_model_free(model)

    def conversation(self, shape: int) -> list[dict[str, str]]:
        word = self.words[self.used % len(self.words)]
        self.used += 1
        topic = SYSTEM_TOPICS[shape % len(SYSTEM_TOPICS)]
        return [
            {"role": "system", "content": f"{word}. You are a patient tutor who likes {topic}."},
            {"role": "user", "content": QUESTIONS[shape % len(QUESTIONS)]},
        ]


# --- requests -------------------------------------------------------------------------


def request(path: str, port: int, key: str, messages: list[dict[str, str]], tokens: int) -> bytes:
    body = {
        "model": MODEL[path],
        "messages": messages,
        "stream": True,
        "temperature": 0,
        "seed": 42,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    return client.http_post(port, client.CHAT, json.dumps(body).encode(), key)


def wave(port: int, reqs: list[bytes]) -> list[client.Stream]:
    """Send ``reqs`` at once (connections opened before the clock); wait for all."""
    return client.run_streams(port, reqs, lead=0.02)


@dataclass
class PathWaves:
    """One path's share of ``measure`` so far: its requests, the streams of the waves sent,
    their wall time and the gateway's CPU time."""

    reqs: list[bytes]
    results: list[client.Stream] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0


def measure(
    servers: dict[str, Server],
    order: tuple[str, ...],
    conc: int,
    prompts: Prompts,
    shape0: int,
    args: Any,
) -> dict[str, dict[str, Any]]:
    """STREAMS streams per path in waves of ``conc``, the paths taking turns wave by wave
    (so that drift hits them alike) with the same prompt shapes: TTFTs (in wave order),
    tokens, wall time, the gateway's CPU time."""
    waves: dict[str, PathWaves] = {}
    for p in order:
        convs = [prompts.conversation(shape0 + i) for i in range(STREAMS)]
        waves[p] = PathWaves([request(p, servers[p].port, args.key, c, args.tokens) for c in convs])
    for i in range(0, STREAMS, conc):
        for p in order:
            srv, m = servers[p], waves[p]
            settle(servers["direct"])
            cpu0 = proc_cpu_seconds(srv.pid)
            got = wave(srv.port, m.reqs[i : i + conc])
            m.cpu_s += proc_cpu_seconds(srv.pid) - cpu0
            m.wall_s += max(r.t_done for r in got) - min(r.t_send for r in got)
            m.results += got
    out: dict[str, dict[str, Any]] = {}
    for p, m in waves.items():
        usage = []
        for r in m.results:
            u = r.parse()["usage"] or {}
            if r.status != 200 or not r.t_first or not r.t_done:
                sys.exit(f"router: a {p} stream failed: {bytes(r.raw[:600])!r}")
            if u.get("completion_tokens") != args.tokens:
                sys.exit(f"router: {p}: expected {args.tokens} tokens, got usage {u}")
            details = u.get("prompt_tokens_details") or {}
            usage.append([u["prompt_tokens"], details.get("cached_tokens")])
        out[p] = {
            "ttft_s": [r.t_first - r.t_send for r in m.results],
            "tokens": STREAMS * args.tokens,
            "wall_s": m.wall_s,
            "tok_s": STREAMS * args.tokens / m.wall_s,
            "router_cpu_s": m.cpu_s if p != "direct" else None,
            "prompt_and_cached_tokens": usage,
        }
    return out


# --- identical bytes ---------------------------------------------------------------------


def normalize(body: bytes) -> bytes:
    body = re.sub(rb'"id":"[^"]*"', b'"id":""', body)
    return re.sub(rb'"created":\d+', b'"created":0', body)


def json_diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths (``choices[0].delta.role``) where two JSON values differ (absent is not null)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in json_diff(a.get(k, ...), b.get(k, ...), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in json_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path.lstrip(".") or "(value)"]


def compare(ref: bytes, other: bytes) -> dict[str, Any]:
    a, b = normalize(ref), normalize(other)
    la, lb = [x for x in a.split(b"\n") if x], [x for x in b.split(b"\n") if x]
    diffs: set[str] = set()
    for x, y in zip(la, lb):
        if x != y:
            try:
                diffs.update(json_diff(json.loads(x[6:]), json.loads(y[6:])))
            except ValueError:
                diffs.add("(not JSON)")
    texts = [client.parse_sse(b"\r\n\r\n" + s)["text"] for s in (a, b)]
    return {
        "raw_equal": ref == other,
        "normalized_equal": a == b,
        "differing_fields": sorted(diffs),
        "events": [len(la), len(lb)],
        "same_text": texts[0] == texts[1],
    }


def identity_check(
    servers: dict[str, Server], conv: list[dict[str, str]], args: Any
) -> dict[str, Any]:
    def ask(path: str) -> bytes:
        srv = servers[path]
        [res] = wave(srv.port, [request(path, srv.port, args.key, conv, args.tokens)])
        if res.status != 200:
            sys.exit(f"router: the identity request via {path} failed: {bytes(res.raw[:600])!r}")
        return res.body()

    ask("direct")  # warm-up: every answer below finds this prompt in the prefix cache
    ref = ask("direct")
    out = {"control_direct_again": compare(ref, ask("direct"))}
    for path in [p for p in servers if p != "direct"]:
        before = servers["direct"].health()["engine"]["tokens_generated"]
        out[path] = compare(ref, ask(path))
        out[path]["upstream_generated"] = (
            servers["direct"].health()["engine"]["tokens_generated"] - before
        )
    return out


def ident_lines(ident: dict[str, Any]) -> list[str]:
    lines = []
    for path in [p for p in ("control_direct_again", "sluice", "litellm") if p in ident]:
        c = ident[path]
        lines.append(
            f"{'direct again (control)' if path.startswith('control') else path}: identical "
            f"bytes {'yes' if c['normalized_equal'] else 'no'} (raw bytes equal: "
            f"{'yes' if c['raw_equal'] else 'no'}; differing beyond id/created: "
            f"{', '.join(c['differing_fields']) or 'nothing'}; events {c['events'][1]} vs "
            f"{c['events'][0]}; same text: {c['same_text']}"
            + (f"; upstream generated {c['upstream_generated']} tokens)" if path in PATHS else ")")
        )
    return lines


# --- rounds and report -------------------------------------------------------------------


Runs = dict[str, dict[str, list[dict[str, Any]]]]  # concurrency -> path -> rounds


def run_rounds(servers: dict[str, Server], prompts: Prompts, args: Any) -> tuple[Runs, list[str]]:
    """Warm-up, then the rounds: at each concurrency every path, the order rotated."""
    paths = tuple(servers)
    runs: Runs = {str(c): {p: [] for p in paths} for c in LEVELS}
    checks: list[str] = []
    for conc in LEVELS:  # warm-up: connections, pools, first-request code paths
        measure(servers, paths, conc, prompts, 0, args)
    noise = Noise([s.pid for s in servers.values()])
    for rnd in range(args.rounds):
        order = rotated(paths, rnd)
        for conc in LEVELS:
            for attempt in range(args.max_retries + 1):
                noise.wait_quiet(args.quiet, args.quiet_timeout)
                # One untimed request first: no path pays for waking the idle upstream.
                up, conv = servers["direct"], prompts.conversation(0)
                wave(up.port, [request("direct", up.port, args.key, conv, 1)])
                noise.start()
                group = measure(servers, order, conc, prompts, rnd * STREAMS, args)
                foreign = noise.stop()
                for path, m in group.items():
                    m.update(foreign_cores=foreign, round=rnd + 1)
                    print(
                        f"  round {rnd + 1}/{args.rounds} streams={conc} {path:7s} TTFT p50 "
                        f"{med(m['ttft_s']) * 1000:6.1f} ms {m['tok_s']:6.1f} tok/s",
                        flush=True,
                    )
                print(f"  (others used {foreign:.2f} cores)", flush=True)
                if foreign <= args.quiet or attempt == args.max_retries:
                    break
                print("  (measuring the group again)")
            if foreign > args.quiet:
                checks.append(f"round {rnd + 1} streams={conc}: kept at {foreign:.2f} cores")
            # The same prompt lengths on every path, no reuse beyond the template's opening.
            usage = {p: m["prompt_and_cached_tokens"] for p, m in group.items()}
            lengths = [[u[0] for u in us] for us in usage.values()]
            if (
                any(n != lengths[0] for n in lengths)
                or max(u[1] for us in usage.values() for u in us) > 3
            ):
                checks.append(f"round {rnd + 1} streams={conc}: prompt/cached tokens {usage}")
            for path, m in group.items():
                runs[str(conc)][path].append(m)
    return runs, checks


def ci95(rounds: list[list[float]], n: int = 2000) -> list[float]:
    """Bootstrap 95% interval (rounds resampled whole) of the median difference, in ms."""
    rng, meds = random.Random(0), []
    for _ in range(n):
        meds.append(med([d for r in rng.choices(rounds, k=len(rounds)) for d in r]))
    meds.sort()
    return [1000 * meds[int(0.025 * n)], 1000 * meds[int(0.975 * n)]]


def summarize(runs: Runs) -> dict[str, Any]:
    """Per concurrency and path: TTFT percentiles, added TTFT, throughput and its ratio.

    Added TTFT pairs streams of the same wave index by rank (at 1 stream: the stream of
    the path minus direct's, same prompt shape, measured back to back; at 8: the k-th
    fastest minus the k-th fastest, since the upstream admits 8 requests in groups and
    their TTFTs form clusters that a pooled percentile would jump between); p50 and p95
    are over all these paired differences, the CI resamples whole rounds.
    """
    out = {}
    for conc, by_path in runs.items():
        d, k = by_path["direct"], int(conc)
        rows: dict[str, Any] = {}
        for path, ms in by_path.items():
            ttft = [t for m in ms for t in m["ttft_s"]]
            r = rows[path] = {
                "ttft_p50_ms": pct(ttft, 50) * 1000,
                "ttft_p95_ms": pct(ttft, 95) * 1000,
                "tok_s": med([m["tok_s"] for m in ms]),
                "samples": len(ttft),
                "max_foreign_cores": max(m["foreign_cores"] for m in ms),
            }
            if path == "direct":
                continue
            per_round = [
                [
                    a - b
                    for w in range(0, STREAMS, k)
                    for a, b in zip(sorted(m["ttft_s"][w : w + k]), sorted(x["ttft_s"][w : w + k]))
                ]
                for m, x in zip(ms, d)
            ]
            diffs = [x for r_ in per_round for x in r_]
            r["added_ttft_p50_ms"] = pct(diffs, 50) * 1000
            r["added_ttft_p50_ci95_ms"] = ci95(per_round)
            r["added_ttft_p95_ms"] = pct(diffs, 95) * 1000
            r["ttft_p50_minus_direct_ms"] = r["ttft_p50_ms"] - rows["direct"]["ttft_p50_ms"]
            r["ratio"] = r["tok_s"] / rows["direct"]["tok_s"]
            r["ratio_paired"] = med([m["tok_s"] / x["tok_s"] for m, x in zip(ms, d)])
            r["router_cpu_ms_per_1k_tok"] = med([1e6 * m["router_cpu_s"] / m["tokens"] for m in ms])
        out[conc] = rows
    return out


def targets(summary: dict[str, Any], ident: dict[str, Any]) -> dict[str, bool]:
    """The targets for sluice, at every concurrency ({} if sluice was not run)."""
    if "sluice" not in ident:
        return {}
    s = [r["sluice"] for r in summary.values()]
    met = {
        "identical_bytes": ident["sluice"]["normalized_equal"],
        "added_ttft_p50_le_2ms": all(
            r["added_ttft_p50_ms"] <= TARGETS["added_ttft_p50_ms"] for r in s
        ),
        "throughput_ge_0.98x": all(r["ratio"] >= TARGETS["throughput_ratio"] for r in s),
    }
    if "litellm" in ident:
        ll = [r["litellm"] for r in summary.values()]
        met["ahead_of_litellm_ttft"] = all(
            a["added_ttft_p50_ms"] < b["added_ttft_p50_ms"] for a, b in zip(s, ll)
        )
        met["ahead_of_litellm_throughput"] = all(a["tok_s"] > b["tok_s"] for a, b in zip(s, ll))
    return met


def table(summary: dict[str, Any], markdown: bool) -> str:
    head = ["streams", "path", "TTFT p50 ms", "TTFT p95 ms", "added p50 ms (95% CI)"]
    head += ["added p95 ms", "p50 - direct p50", "tok/s", "x direct", "paired x"]
    head += ["router CPU ms/1k tok"]
    rows = []
    for conc, by_path in summary.items():
        for path, r in by_path.items():
            row = [conc, path, f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p95_ms']:.1f}"]
            if path == "direct":
                rows.append([*row, *"---", f"{r['tok_s']:.1f}", *"---"])
                continue
            lo, hi = r["added_ttft_p50_ci95_ms"]
            row += [f"{r['added_ttft_p50_ms']:+.2f} ({lo:+.1f} .. {hi:+.1f})"]
            row += [f"{r['added_ttft_p95_ms']:+.2f}", f"{r['ttft_p50_minus_direct_ms']:+.2f}"]
            row += [f"{r['tok_s']:.1f}", f"{r['ratio']:.3f}", f"{r['ratio_paired']:.3f}"]
            rows.append([*row, f"{r['router_cpu_ms_per_1k_tok']:.0f}"])
    return report.render_table(head, rows, markdown)


def write_report(res: dict[str, Any], out_dir: Path) -> None:
    """Print the table and the targets; write the JSON and the Markdown."""
    summary, ident, met, mach = res["summary"], res["identical_bytes"], res["met"], res["machine"]
    load, st = res["load_average"], res["settings"]
    print(f"\n{table(summary, markdown=False)}\n")
    report.print_outcome(met, res["checks"], load)
    md = (
        f"# Router overhead {res['date']}\n\n"
        "One upstream (`sluice serve --threads 1 --parallel 8`, SmolLM2 135M) asked directly, "
        "through a sluice gateway (`[[upstreams]]`) and through the LiteLLM proxy "
        f"{LITELLM_VERSION}: streaming chat completions, temperature 0, `ignore_eos`, "
        f"{st['max_tokens']} tokens, {STREAMS} streams per measurement (one after the other at "
        f"1 stream, at once at 8), {st['rounds']} rounds, path order rotated each round.\n\n"
        f"{report.machine_line(mach, load)}.\n\n"
        + (f"Note: {st['note']}\n\n" if st["note"] else "")
        + table(summary, markdown=True)
        + "\n\nTTFT = request sent -> first chunk with content; p50/p95 over all streams of "
        "all rounds. added = paired differences (1 stream: path minus direct, same prompt shape, "
        "back to back; 8: the k-th fastest of a wave minus the k-th fastest of direct's); "
        "their p50 (95% CI: bootstrap over rounds) and p95. "
        "p50 - direct p50 = difference of the pooled percentiles. tok/s = completion tokens / "
        "wall time, median over rounds; x direct = ratio of medians; paired x = median of "
        "per-round ratios. Router CPU = the gateway process's CPU time per 1000 tokens. At 8 "
        "streams the upstream admits the requests in groups that change from wave to wave "
        "(1+3+3+1, 2+3+3, all 8 at once, ...), which moves TTFTs by hundreds of ms: the added "
        "TTFT at 8 streams measures that more than the router (see runs in the JSON).\n\n"
        "Identical bytes (same request, temperature 0, seed 42, after a warm-up):\n\n"
        + "".join(f"- {line}\n" for line in ident_lines(ident))
        + "\nTargets (sluice, at 1 and 8 streams): "
        + report.targets_and_checks(met, res["checks"], st["reproduce"])
    )
    report.save_report(out_dir, f"router-{res['stamp']}", res, md)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="1 round, 16 tokens")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5, --quick 1)")
    ap.add_argument("--tokens", type=int, default=None, help="max_tokens (default 64, --quick 16)")
    ap.add_argument("--paths", default=",".join(PATHS), help="direct and which gateways")
    ap.add_argument("--quiet", type=float, default=0.3, help="noise threshold, in cores")
    ap.add_argument("--quiet-timeout", type=float, default=30.0)
    ap.add_argument("--max-retries", type=int, default=2, help="re-measure a disturbed group")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", default="", help="a note stored with the results")
    args = ap.parse_args()
    paths = tuple(p for p in PATHS if p == "direct" or p in args.paths.split(","))
    reproduce = ".venv/bin/python benchmarks/router.py" + " --quick" * args.quick
    reproduce += f" --rounds {args.rounds}" * bool(args.rounds)
    reproduce += f" --paths {','.join(paths)}" * (paths != PATHS)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.tokens = args.tokens or (16 if args.quick else 64)
    args.key = "sk-bench-" + secrets.token_hex(16)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started, load_start = report.now(), loadavg()
    print(f"router: rounds={args.rounds} tokens={args.tokens} paths={paths} load={load_start}")
    tmp = Path(tempfile.mkdtemp(prefix="sluice-router-"))
    print(f"router: configs and server logs in {tmp}", flush=True)
    servers = start_servers(tmp, args.key, paths)
    prompts = Prompts()
    try:
        ident = identity_check(servers, prompts.conversation(0), args)
        for line in ident_lines(ident):
            print("  " + line, flush=True)
        if "sluice" in ident and ident["sluice"]["upstream_generated"] != args.tokens:
            sys.exit("router: the sluice gateway did not send the request to the upstream")
        runs, checks = run_rounds(servers, prompts, args)
    finally:
        for srv in servers.values():
            srv.close()
    summary = summarize(runs)
    settings = {
        "rounds": args.rounds,
        "max_tokens": args.tokens,
        "streams_per_measurement": STREAMS,
        "litellm": LITELLM_PACKAGES,
        "server_cmds": {
            p: [a if a != args.key else "<key>" for a in s.cmd] for p, s in servers.items()
        },
        "note": args.note,
        "reproduce": reproduce,
    }
    res = {
        "date": started.isoformat(timespec="seconds"),
        "stamp": report.stamp(started),
        "machine": machine_info(),
        "load_average": {"start": load_start, "end": loadavg()},
        "settings": settings,
        "targets": TARGETS,
        "met": targets(summary, ident),
        "summary": summary,
        "identical_bytes": ident,
        "checks": checks,
        "runs": runs,
    }
    write_report(res, args.out_dir)


if __name__ == "__main__":
    main()
