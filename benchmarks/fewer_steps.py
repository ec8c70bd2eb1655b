#!/usr/bin/env python
"""Fewer decode steps: jump-forward and prompt-lookup speculation, side by side with
llama.cpp's own ``llama-server`` (plain, and with its n-gram speculation).

All serve the packaged SmolLM2-135M-Instruct Q4_1 with ``--threads T`` (default 2), 4
slots of 8,192 tokens, side by side for the whole run (those not measured idle):

* sluice: ``python -m sluice serve --threads T --parallel 4 --ctx 8192`` (an empty
  models folder). Its "off" sides are the same server with the request field
  ``speculative: {"jump_forward": false}`` or ``{"max_draft": 0}``;
* llama-server (``harness/llama_build.py``): ``-t T -np 4 -c 32768 --jinja``;
* llama-server ngram: the same with ``--spec-type ngram-simple`` (its defaults: a
  12-token lookup, drafts of up to 48).

Workloads, each a streaming chat request:

* ``json``: a schema of 24 required properties with long fixed names and integer or
  boolean values (``response_format: json_schema``), "Describe a customer as JSON.",
  sampled with the servers' defaults and a seed per request (the same on every side),
  ``max_tokens`` 800; at 1 and 4 streams. Measured: the wall time to every stream's
  whole answer, and whether each answer is a valid object (every key, its type).
  Sides: sluice (jump-forward), sluice without jump-forward, llama-server.
* ``rewrite``: ``data/rewrite_input.py.txt`` (a 265-line Python file) asked back whole
  with one class renamed, temperature 0, ``max_tokens`` ``--rewrite-tokens`` (1,200),
  1 stream. Measured: output characters per second of the decode (first content to the
  end: the prompt's prefill is the same work on every side and is cached after the
  warm-up). Sides: sluice (speculation), sluice without, llama-server, llama-server
  ngram. Whether sluice's text is the same with speculation on and off is recorded.
* ``prose``: "Write a long story about ...", sampled, a prompt of its own per stream,
  ``max_tokens`` 128, at 1, 4 and 8 streams: aggregate tok/s (completion tokens over
  the wall time). Sides: sluice (speculation), sluice without, llama-server.

Method: a warm-up of each workload on every side; then per round the sides take turns
in a rotating order (``harness.stats.rotated``), each measurement after waiting (up to
``--quiet-timeout`` s) until other processes use less than ``--quiet`` cores. Ratios
are paired within a round; the report gives their median and range over rounds.

Targets (the issue's): json sluice / sluice without jump-forward >= 1.3 at 1 stream and
>= 1.1 at 4; rewrite sluice >= 1.6x llama-server and >= 1.1x llama-server ngram; prose
sluice / sluice without speculation >= 0.97 at every level and never below 1.0 at 8.

Usage: ``.venv/bin/python benchmarks/fewer_steps.py [--rounds 2]``; writes
``benchmarks/results/fewer-steps-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from harness import BENCH, RESULTS
from harness.client import CHAT, http_post, parse_sse, run_streams
from harness.llama_build import build_info, ensure_llama_server
from harness.machine import Noise, loadavg, machine_info
from harness.prompts import ADJS, PEOPLE, PLACES, THINGS
from harness.report import machine_line, now, render_table, save_report, stamp
from harness.servers import SLUICE, LlamaServer, Server, free_port, llama_server_cmd, models_env
from harness.stats import med, rotated

PARALLEL = 4
CTX = 8192
FIRST = re.compile(rb'"content":"[^"]')

# fmt: off
NAMES = [
    "customer_account_identifier", "primary_shipping_address_line",
    "preferred_contact_channel_name", "loyalty_program_membership_tier",
    "total_lifetime_purchase_amount", "has_active_subscription_flag",
    "last_successful_login_timestamp", "number_of_open_support_tickets",
    "marketing_emails_opt_in_status", "default_payment_method_type",
    "account_creation_year_number", "is_verified_business_customer",
    "average_order_value_in_cents", "count_of_returned_items_total",
    "referral_program_invite_count", "two_factor_authentication_enabled",
    "preferred_language_locale_code", "monthly_active_days_count",
    "outstanding_balance_in_cents", "is_eligible_for_free_shipping",
    "wishlist_item_total_count", "abandoned_cart_recovery_count",
    "customer_satisfaction_score_value", "has_pending_refund_request",
]
# fmt: on
BOOLEAN = ("has_", "is_", "two_", "marketing_")
KINDS = {n: "boolean" if n.startswith(BOOLEAN) else "integer" for n in NAMES}
SCHEMA = {
    "type": "object",
    "properties": {n: {"type": k} for n, k in KINDS.items()},
    "required": NAMES,
    "additionalProperties": False,
}
REWRITE = (BENCH / "data" / "rewrite_input.py.txt").read_text()
RENAME = ("PrefillPacer", "PrefillGovernor")

SIDES = {
    "json": ("sluice", "sluice-off", "llama-server"),
    "rewrite": ("sluice", "sluice-off", "llama-server", "llama-ngram"),
    "prose": ("sluice", "sluice-off", "llama-server"),
}
LEVELS = {"json": (1, 4), "rewrite": (1,), "prose": (1, 4, 8)}
OFF = {"json": {"jump_forward": False}, "rewrite": {"max_draft": 0}, "prose": {"max_draft": 0}}


def valid(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    if not isinstance(doc, dict) or list(doc) != NAMES:
        return False
    for name, kind in KINDS.items():
        value = doc[name]
        if kind == "boolean" and not isinstance(value, bool):
            return False
        if kind == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
            return False
    return True


class Bodies:
    """Each workload's request bodies, deterministic; prose prompts never repeat."""

    def __init__(self) -> None:
        self.rng = random.Random("sluice-fewer-steps")
        self.seed = 0

    def make(self, workload: str, side: str, n: int, rewrite_tokens: int) -> list[bytes]:
        out = []
        for _ in range(n):
            self.seed += 1
            body: dict[str, Any] = {
                "model": "smollm2",
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if workload == "json":
                prompt = "Describe a customer as JSON."
                body |= {
                    "max_tokens": 800,
                    "seed": self.seed,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "customer", "schema": SCHEMA},
                    },
                }
            elif workload == "rewrite":
                prompt = (
                    f"Rewrite this Python file with the class {RENAME[0]} renamed to "
                    f"{RENAME[1]}. Answer with the whole file only.\n\n```python\n{REWRITE}```"
                )
                body |= {"max_tokens": rewrite_tokens, "temperature": 0}
            else:
                r = self.rng
                prompt = (
                    f"Write a long story about {r.choice(PEOPLE)}, {r.choice(THINGS)} and "
                    f"{r.choice(PLACES)} on a {r.choice(ADJS)} day. ({self.seed})"
                )
                body |= {"max_tokens": 128, "seed": self.seed}
            body["messages"] = [{"role": "user", "content": prompt}]
            if side == "sluice-off":
                body["speculative"] = OFF[workload]
            out.append(json.dumps(body).encode())
        return out


def measure(server: Server, reqs: list[bytes]) -> dict[str, Any]:
    streams = run_streams(server.port, [http_post(server.port, CHAT, r) for r in reqs], first=FIRST)
    answers = [parse_sse(bytes(s.raw)) for s in streams]
    wall = max(s.t_done or s.t_send for s in streams) - min(s.t_send for s in streams)
    tokens = [(a.get("usage") or {}).get("completion_tokens") or 0 for a in answers]
    decode = [
        len(a["text"]) / (s.t_done - s.t_first) if s.t_first and s.t_done > s.t_first else None
        for s, a in zip(streams, answers)
    ]
    return {
        "status": [a["status"] for a in answers],
        "wall_s": wall,
        "tokens": tokens,
        "agg_tok_s": sum(tokens) / wall if wall > 0 else None,
        "decode_chars_s": decode,
        "texts": [a["text"] for a in answers],
    }


def start(args: argparse.Namespace, tmp: Path) -> dict[str, Server]:
    servers: dict[str, Server] = {}
    port = free_port()
    cmd = [*SLUICE, "--port", str(port), "--threads", str(args.threads), "--parallel"]
    cmd += [str(PARALLEL), "--ctx", str(CTX), "--log-level", "warning"]
    (tmp / "models").mkdir(exist_ok=True)
    servers["sluice"] = Server(
        "sluice", cmd, port, tmp / "sluice.log", env=models_env(tmp / "models")
    )
    try:
        for side, extra in (("llama-server", []), ("llama-ngram", ["--spec-type", "ngram-simple"])):
            port = free_port()
            cmd = llama_server_cmd(
                args.llama_server, port, args.threads, PARALLEL, CTX, "--jinja", *extra
            )
            servers[side] = LlamaServer(side, cmd, port, tmp / f"{side}.log")
    except BaseException:
        for s in servers.values():
            s.close()
        raise
    return servers


def decoding(server: Server) -> dict[str, int]:
    """sluice's fewer-steps counters (drafted, accepted, forced tokens); {} for others."""
    if isinstance(server, LlamaServer):
        return {}
    health = server.health()
    found = health.get("models", {}).get(health.get("model"), {}).get("decoding") or {}
    keys = ("drafted_tokens", "accepted_tokens", "forced_tokens")
    return {k: int(found.get(k) or 0) for k in keys}


def server_of(servers: dict[str, Server], side: str) -> Server:
    return servers["sluice" if side.startswith("sluice") else side]


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    bodies = Bodies()
    with tempfile.TemporaryDirectory() as tmp:
        servers = start(args, Path(tmp))
        try:
            noise = Noise([s.pid for s in servers.values()])
            for workload in args.workloads:
                for side in SIDES[workload]:  # warm-up (and the rewrite's prompt cached)
                    measure(server_of(servers, side), bodies.make(workload, side, 1, 16))
            for rnd in range(args.rounds):
                for workload in args.workloads:
                    for level in LEVELS[workload]:
                        for side in rotated(SIDES[workload], rnd):
                            server = server_of(servers, side)
                            reqs = bodies.make(workload, side, level, args.rewrite_tokens)
                            server.wait_idle(timeout=300)
                            counters = decoding(server)
                            res, during, before = noise.run(
                                partial(measure, server, reqs),
                                args.quiet,
                                args.quiet_timeout,
                            )
                            server.wait_idle(timeout=300)  # the last step's counts too
                            res |= {
                                "round": rnd,
                                "workload": workload,
                                "level": level,
                                "side": side,
                                "noise": during,
                                "noise_before": before,
                                "decoding": {
                                    k: decoding(server).get(k, 0) - v for k, v in counters.items()
                                },
                            }
                            results.append(res)
                            print(
                                f"round {rnd} {workload:7s} x{level} {side:12s} "
                                f"wall {res['wall_s']:6.2f}s tokens {sum(res['tokens']):5d} "
                                f"agg {res['agg_tok_s'] or 0:6.1f} tok/s "
                                f"decode {med([d for d in res['decode_chars_s'] if d]) if any(res['decode_chars_s']) else 0:6.0f} chars/s "
                                f"{res['decoding'] or ''}",
                                flush=True,
                            )
            health = servers["sluice"].health()
        finally:
            for s in servers.values():
                s.close()
    return {
        "results": results,
        "decoding": health.get("models", {}).get(health.get("model"), {}).get("decoding"),
    }


def cell(
    results: list[dict[str, Any]], workload: str, level: int, side: str, rnd: int
) -> dict[str, Any]:
    return next(
        r
        for r in results
        if (r["workload"], r["level"], r["side"], r["round"]) == (workload, level, side, rnd)
    )


def metric(r: dict[str, Any]) -> float:
    """Higher is better: objects per second (json), decode chars/s (rewrite), tok/s."""
    if r["workload"] == "json":
        return len(r["texts"]) / float(r["wall_s"])
    if r["workload"] == "rewrite":
        return float(med([d for d in r["decode_chars_s"] if d]))
    return float(r["agg_tok_s"] or 0.0)


def summarize(
    doc: dict[str, Any], rounds: int
) -> tuple[list[list[str]], dict[str, bool], list[str]]:
    results = doc["results"]
    rows: list[list[str]] = []
    met: dict[str, bool] = {}
    checks: list[str] = []
    for workload in doc["workloads"]:
        for level in LEVELS[workload]:
            values = {
                side: [metric(cell(results, workload, level, side, k)) for k in range(rounds)]
                for side in SIDES[workload]
            }
            pairs = {
                side: sorted(values["sluice"][k] / values[side][k] for k in range(rounds))
                for side in SIDES[workload]
                if side != "sluice"
            }
            for side, pair in pairs.items():
                rows.append(
                    [
                        workload,
                        str(level),
                        side,
                        f"{med(values['sluice']):.3g}",
                        f"{med(values[side]):.3g}",
                        f"{med(pair):.2f} [{pair[0]:.2f}-{pair[-1]:.2f}]",
                    ]
                )
            off = med(pairs["sluice-off"])
            if workload == "json":
                met[f"json x{level} >= {1.3 if level == 1 else 1.1}x without jump-forward"] = (
                    off >= (1.3 if level == 1 else 1.1)
                )
                for side in SIDES[workload]:
                    texts = [
                        t
                        for k in range(rounds)
                        for t in cell(results, workload, level, side, k)["texts"]
                    ]
                    bad = sum(not valid(t) for t in texts)
                    checks.append(
                        f"json x{level} {side}: {len(texts) - bad}/{len(texts)} valid objects"
                    )
            elif workload == "rewrite":
                met["rewrite >= 1.6x llama-server"] = med(pairs["llama-server"]) >= 1.6
                met["rewrite >= 1.1x llama-server ngram"] = med(pairs["llama-ngram"]) >= 1.1
                for k in range(rounds):
                    same = (
                        cell(results, workload, 1, "sluice", k)["texts"]
                        == cell(results, workload, 1, "sluice-off", k)["texts"]
                    )
                    checks.append(
                        f"rewrite round {k}: sluice's text {'the same' if same else 'DIFFERENT'} with speculation off"
                    )
            else:
                met[f"prose x{level} >= {1.0 if level == 8 else 0.97}x without speculation"] = (
                    off >= (1.0 if level == 8 else 0.97)
                )
    noisy = [r for r in results if r["noise"] > doc["quiet"]]
    checks.append(f"{len(noisy)} of {len(results)} measurements disturbed by other processes")
    return rows, met, checks


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="json,rewrite,prose")
    ap.add_argument("--rewrite-tokens", type=int, default=1200)
    ap.add_argument("--quiet", type=float, default=0.3)
    ap.add_argument("--quiet-timeout", type=float, default=60.0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.llama_server = ensure_llama_server()
    started = now()
    load_start = loadavg()
    doc = run(args)
    doc |= {
        "when": started.isoformat(),
        "machine": machine_info(),
        "llama_server": build_info(args.llama_server),
        "load_average": {"start": load_start, "end": loadavg()},
        "workloads": args.workloads,
        "rounds": args.rounds,
        "quiet": args.quiet,
        "threads": args.threads,
        "note": args.note,
        "reproduce": " ".join(["python benchmarks/fewer_steps.py", *sys.argv[1:]]),
    }
    rows, met, checks = summarize(doc, args.rounds)
    doc |= {"met": met, "checks": checks}
    head = ["workload", "streams", "against", "sluice", "it", "sluice / it, paired [range]"]
    table_md = render_table(head, rows, markdown=True)
    md = (
        f"# Fewer decode steps: sluice against llama-server\n\n{machine_line(doc['machine'], doc['load_average'])}.\n\n"
        "Values: json objects/s (all streams), rewrite decode chars/s, prose tok/s (medians "
        f"over {args.rounds} rounds); sluice-off is sluice with the request field turning the "
        "workload's feature off; the ratio is paired per round.\n\n"
        f"{table_md}\n\n"
        f"sluice's counters at the end: {doc['decoding']}\n\n"
        + "".join(f"- {name}: {'met' if ok else 'NOT met'}\n" for name, ok in met.items())
        + "".join(f"- check: {c}\n" for c in checks)
        + f"\nReproduce: `{doc['reproduce']}`\n"
    )
    print()
    print(render_table(head, rows, markdown=False))
    for name, ok in met.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    for c in checks:
        print("check:", c)
    save_report(args.out_dir, f"fewer-steps-{stamp(started)}", doc, md)


if __name__ == "__main__":
    main()
