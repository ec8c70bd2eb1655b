#!/usr/bin/env python
"""Conversations and the prompt cache: sluice against llama-server.

Two servers on the same model (SmolLM2-135M), one at a time, each started fresh per round
(empty caches), the order swapped every round:

* **sluice**: ``python -m sluice serve --threads 1 --parallel 4 --ctx 8192 --store <tmp>``
  (its RAM prompt cache, ``--cache-ram``, on by default: 2048 MiB); the conversation goes
  through ``POST /c1/chat``: only the new message, the history from its store
  (``conversation_id`` from the ``x-conversation-id`` header);
* **llama-server**: llama.cpp's own server built from the llama.cpp the pinned
  llama-cpp-python vendors (``llama_server.py``), ``-t 1 -np 4 -c 32768`` (its ``-c`` is
  the total over the slots: 4 x 8192), ``--cache-ram 2048`` (sluice's default budget;
  its own default is 8192), prompt caching on (``cache_prompt: true`` in every request);
  fed the whole history through ``/v1/chat/completions`` every turn, its own answers
  appended.

A round on one server:

1. **Conversation under load**: 3 background clients keep the other 3 slots generating
   (streams of distinct short prompts, ``ignore_eos``, ``--background-tokens`` (4000)
   tokens each, enough to outlast the conversation and its cold reference, so that no
   background prompt is being prefilled while a turn is measured; one that ends anyway is
   restarted, and the checks name the turns it overlapped); one conversation of 10
   turns, each user message ~150 words (distinct, deterministic, the same bytes on both
   servers), temperature 0, ``ignore_eos``, 64 tokens per answer (so that both
   histories have the same length). TTFT of every turn.
2. **Cold prefill** (the load still on): the 10th turn's whole prompt (sluice: the
   history read back from its store) with one word added at the start of the first user
   message, so that no cache holds any of it beyond the chat template's system part,
   sent through ``/v1/chat/completions``: its TTFT is the reference of the 10th turn.
3. **Re-sent prompt** (the load stopped, the server idle): a ~2000-token prompt, then 8
   other requests (~200-token distinct prompts, 16 tokens each, sent at once: 4 run, 4
   queue, every slot reused), then the long prompt again: the TTFT of both sends.

TTFT = request sent -> first chunk with non-empty ``content``, client side, one blocking
socket (``harness/client.py``). Per-turn figures are medians over rounds; the
targets are judged on the medians (and counted per round).

Targets: every turn's TTFT and the re-sent prompt's at or below llama-server's
in the same run; the 10th turn's TTFT <= 0.25x a cold prefill of its whole prompt.

Checks (printed and written with the results): a turn whose prompt has another token count
on the two servers (one history lacks a message: e.g. a streamed ``/c1/chat`` answer not
yet stored when the next turn, sent as soon as ``[DONE]`` arrives, reads the history),
background streams not all generating when a turn was sent (or one ended during it),
answers of another length, other processes' CPU above ``--quiet`` during a round. The next turn follows the answer at
once (``--think`` adds a pause).

Usage: ``.venv/bin/python benchmarks/conversation.py [--quick] [--rounds N]``; writes
``benchmarks/results/conversation-<timestamp>.json`` and ``.md``. Builds llama-server on
first use (about 7 minutes, cached).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from harness import RESULTS, client, report
from harness.llama_build import build_info, ensure_llama_server
from harness.machine import Noise, loadavg, machine_info
from harness.prompts import SYSTEM_TOPICS, paragraph
from harness.servers import SLUICE, LlamaServer, Server, free_port, llama_server_cmd, models_env
from harness.stats import med, rotated

SERVERS = ("sluice", "llama-server")
PARALLEL, CTX, CACHE_RAM_MB = 4, 8192, 2048
TARGETS = {"turn_ttft_ratio_max": 1.0, "resent_ttft_ratio_max": 1.0, "last_turn_vs_cold_max": 0.25}

# --- deterministic text ---------------------------------------------------------------


def turn_messages(turns: int, words: int) -> list[str]:
    """The user's messages: ~``words`` words each, distinct, the same every run."""
    return [
        f"Here is part {i + 1} of the story I am writing. "
        + paragraph(random.Random(f"turn-{i}"), words - 25)
        + " Please tell me in two sentences what you think of this part and what could happen"
        " next."
        for i in range(turns)
    ]


def long_prompt(words: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": "Read this chronicle carefully; I will ask questions about it. "
            + paragraph(random.Random("long"), words)
            + " Who appears most often in the chronicle?",
        }
    ]


def other_prompt(k: int, words: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f"Request {k}: summarize this note. "
            + paragraph(random.Random(f"other-{k}"), words),
        }
    ]


# --- the client: one blocking socket per stream ------------------------------------------


def stream(port: int, path: str, body: dict[str, Any]) -> client.Stream:
    res = client.send(port, path, json.dumps(body).encode())
    if res.status != 200 or not res.t_first or not res.t_done:
        sys.exit(f"conversation: {path} failed: {bytes(res.raw[:800])!r}")
    return res


def streams_at_once(port: int, bodies: list[dict[str, Any]]) -> list[client.Stream]:
    reqs = [client.http_post(port, client.CHAT, json.dumps(b).encode()) for b in bodies]
    results = client.run_streams(port, reqs, lead=0.0)
    for res in results:
        if res.status != 200 or not res.t_done:
            sys.exit(f"conversation: a request failed: {bytes(res.raw[:800])!r}")
    return results


def chat_body(messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": messages,
        "stream": True,
        "temperature": 0,
        "max_tokens": tokens,
        "ignore_eos": True,
        "cache_prompt": True,  # llama-server's prompt cache (its default; sluice ignores it)
        "stream_options": {"include_usage": True},
    }


def usage_of(res: client.Stream) -> dict[str, Any]:
    p = res.parse()
    u = p["usage"] or {}
    t = p["timings"] or {}
    return {
        "prompt_tokens": u.get("prompt_tokens"),
        "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "completion_tokens": u.get("completion_tokens"),
        "server_prompt_ms": t.get("prompt_ms"),  # llama-server only
        "ttft_ms": res.ttft * 1000,
    }


class Background:
    """``n`` clients that keep ``n`` slots generating: a stream of a distinct short prompt,
    restarted as soon as it ends, until ``stop``."""

    def __init__(self, port: int, n: int, tokens: int) -> None:
        self.port, self.n, self.tokens = port, n, tokens
        self.stop_ev = threading.Event()
        self.socks: list[socket.socket | None] = [None] * n
        self.generating = [False] * n
        self.started = 0
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)
        ]

    def _loop(self, i: int) -> None:
        while not self.stop_ev.is_set():
            with self.lock:
                k = self.started
                self.started += 1
            topic = SYSTEM_TOPICS[k % len(SYSTEM_TOPICS)]
            body = chat_body(
                [{"role": "user", "content": f"Story {k}: tell me a long story about {topic}."}],
                self.tokens,
            )
            req = client.http_post(self.port, client.CHAT, json.dumps(body).encode())
            try:
                sock = client.connect(self.port)
            except OSError as exc:
                if not self.stop_ev.is_set():
                    print(f"  background client: {exc}", flush=True)
                return
            self.socks[i] = sock
            if self.stop_ev.is_set():
                sock.close()
                return
            res = client.Stream()
            generating = partial(self.generating.__setitem__, i, True)
            client.read_stream(sock, req, res, stop=self.stop_ev, on_first=generating)
            self.generating[i] = False
            if not self.stop_ev.is_set() and (res.status != 200 or not res.t_done):
                print(f"  background stream failed: {bytes(res.raw[:300])!r}", flush=True)
                time.sleep(1)

    def active(self) -> int:
        return sum(self.generating)

    def start(self) -> None:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 120
        while self.active() < self.n:
            if time.monotonic() > deadline:
                sys.exit("conversation: the background streams do not all start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.stop_ev.set()
        for s in self.socks:
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self.threads:
            t.join(30)


# --- the servers -------------------------------------------------------------------------


def start_server(name: str, tmp: Path, rnd: int) -> Server:
    port = free_port()
    log = tmp / f"{name}-round{rnd}.log"
    if name == "sluice":
        cmd = [*SLUICE, "--threads", "1"]
        cmd += ["--parallel", str(PARALLEL), "--ctx", str(CTX), "--cache-ram", str(CACHE_RAM_MB)]
        cmd += ["--store", str(tmp / f"store-round{rnd}.sqlite"), "--log-level", "warning"]
        return Server(name, [*cmd, "--port", str(port)], port, log, env=models_env(tmp / "models"))
    cache = ["--cache-ram", str(CACHE_RAM_MB)]
    cmd = llama_server_cmd(ensure_llama_server(), port, 1, PARALLEL, CTX, *cache)
    return LlamaServer(name, cmd, port, log)


def prompt_cache_stats(srv: Server) -> dict[str, Any]:
    """sluice's prompt cache figures (entries, bytes, restores) from ``/health``."""
    found: dict[str, Any] = {}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "prompt_cache" in x:
                found.update(x["prompt_cache"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(srv.get("/health"))
    return found


# --- one round on one server ----------------------------------------------------------------


def run_server(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    is_sluice = srv.name == "sluice"
    out: dict[str, Any] = {"turns": []}
    # Warm-up: first-request code paths; nothing of it is reused below.
    stream(srv.port, "/v1/chat/completions", chat_body([{"role": "user", "content": "Hi."}], 4))
    srv.wait_idle(settle=0.1)
    noise = Noise([srv.pid])
    noise.wait_quiet(args.quiet, args.quiet_timeout)
    noise.start()

    # 1. the conversation, every other slot generating
    bg = Background(srv.port, args.background, args.background_tokens)
    bg.start()
    history: list[dict[str, str]] = []
    conv_id = None
    for i, msg in enumerate(turn_messages(args.turns, args.words)):
        active, restarts = bg.active(), bg.started
        if is_sluice:
            body = chat_body([], args.tokens)
            del body["messages"]
            body["message"] = msg
            if conv_id:
                body["conversation_id"] = conv_id
            res = stream(srv.port, "/c1/chat", body)
            conv_id = res.headers.get("x-conversation-id")
            if not conv_id:
                sys.exit("conversation: /c1/chat sent no x-conversation-id")
        else:
            history.append({"role": "user", "content": msg})
            res = stream(srv.port, "/v1/chat/completions", chat_body(history, args.tokens))
            history.append({"role": "assistant", "content": res.parse()["text"]})
        turn = usage_of(res) | {
            "background_active": [active, bg.active()],
            "background_restarts": bg.started - restarts,  # streams that ended during it
        }
        turn["text"] = res.parse()["text"]
        out["turns"].append(turn)
        print(
            f"    turn {i + 1:2d}: TTFT {turn['ttft_ms']:7.0f} ms  prompt {turn['prompt_tokens']}"
            f"  cached {turn['cached_tokens']}  background {active}/{args.background}",
            flush=True,
        )
        time.sleep(args.think)
    if is_sluice:
        out["prompt_cache_after_turns"] = prompt_cache_stats(srv)
    if is_sluice:  # the history as the store keeps it (the last answer is stored as it ends)
        deadline = time.monotonic() + 10
        while len(msgs := srv.get(f"/c1/conversations/{conv_id}")["messages"]) < 2 * args.turns:
            if time.monotonic() > deadline:
                sys.exit(f"conversation: the store holds {len(msgs)} messages")
            time.sleep(0.02)
        history = [{"role": m["role"], "content": m["content"]} for m in msgs]
    out["conversation_id"] = conv_id

    # 2. the cold reference: the last turn's whole prompt, one word added at the start
    last = [dict(m) for m in history[:-1]]  # up to the last user message
    assert last[-1]["role"] == "user" and last[0]["role"] == "user"
    last[0]["content"] = "Copy. " + last[0]["content"]
    res = stream(srv.port, "/v1/chat/completions", chat_body(last, 4))
    out["cold_last_turn"] = usage_of(res) | {"background_active": bg.active()}
    print(
        f"    cold prefill of the last turn's prompt: TTFT {res.ttft * 1000:7.0f} ms "
        f"prompt {out['cold_last_turn']['prompt_tokens']} "
        f"cached {out['cold_last_turn']['cached_tokens']}",
        flush=True,
    )
    bg.stop()
    out["background_streams"] = bg.started
    srv.wait_idle(settle=0.1)

    # 3. the long prompt, 8 other requests, the long prompt again
    res = stream(srv.port, "/v1/chat/completions", chat_body(long_prompt(args.long_words), 16))
    out["long_first"] = usage_of(res)
    srv.wait_idle(settle=0.1)
    others = streams_at_once(
        srv.port, [chat_body(other_prompt(k, args.other_words), 16) for k in range(8)]
    )
    out["others"] = [usage_of(r) for r in others]
    srv.wait_idle(settle=0.1)
    res = stream(srv.port, "/v1/chat/completions", chat_body(long_prompt(args.long_words), 16))
    out["long_resent"] = usage_of(res)
    print(
        f"    long prompt ({out['long_first']['prompt_tokens']} tokens): first "
        f"{out['long_first']['ttft_ms']:.0f} ms, re-sent after 8 others "
        f"{out['long_resent']['ttft_ms']:.0f} ms (cached {out['long_resent']['cached_tokens']})",
        flush=True,
    )
    out["foreign_cores"] = noise.stop()
    if is_sluice:
        out["prompt_cache_end"] = prompt_cache_stats(srv)
    return out


# --- summary and report --------------------------------------------------------------------


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    s, ls = runs["sluice"], runs["llama-server"]
    n_turns = len(s[0]["turns"])
    rows = []
    for t in range(n_turns):
        a = [r["turns"][t]["ttft_ms"] for r in s]
        b = [r["turns"][t]["ttft_ms"] for r in ls]
        rows.append(
            {
                "what": f"turn {t + 1}",
                "prompt_tokens": [
                    s[0]["turns"][t]["prompt_tokens"],
                    ls[0]["turns"][t]["prompt_tokens"],
                ],
                "cached_tokens": [
                    med([r["turns"][t]["cached_tokens"] or 0 for r in s]),
                    med([r["turns"][t]["cached_tokens"] or 0 for r in ls]),
                ],
                "sluice_ms": med(a),
                "llama_ms": med(b),
                "rounds_le": sum(x <= y for x, y in zip(a, b)),
            }
        )
    for key, what in (
        ("cold_last_turn", f"cold: turn {n_turns}'s whole prompt"),
        ("long_first", "long prompt, first"),
        ("long_resent", "long prompt, re-sent after 8"),
    ):
        a, b = [r[key]["ttft_ms"] for r in s], [r[key]["ttft_ms"] for r in ls]
        rows.append(
            {
                "what": what,
                "prompt_tokens": [s[0][key]["prompt_tokens"], ls[0][key]["prompt_tokens"]],
                "cached_tokens": [
                    med([r[key]["cached_tokens"] or 0 for r in s]),
                    med([r[key]["cached_tokens"] or 0 for r in ls]),
                ],
                "sluice_ms": med(a),
                "llama_ms": med(b),
                "rounds_le": sum(x <= y for x, y in zip(a, b)),
            }
        )
    for r in rows:
        r["ratio"] = r["sluice_ms"] / r["llama_ms"]
    last, cold = rows[n_turns - 1], rows[n_turns]
    return {
        "rows": rows,
        "rounds": len(s),
        "last_vs_cold": {
            "sluice": last["sluice_ms"] / cold["sluice_ms"],
            "llama-server": last["llama_ms"] / cold["llama_ms"],
        },
        "same_answers": [
            sum(x["text"] == y["text"] for x, y in zip(a["turns"], b["turns"]))
            for a, b in zip(s, ls)
        ],
    }


def checks(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    """What makes a figure suspect: turns whose prompt differs in length between the
    servers (one history lacks something), background streams not all generating when a
    turn was sent or ending during it, others' CPU over the threshold, answers cut short."""
    out = []
    for rnd, (s, ls) in enumerate(zip(runs["sluice"], runs["llama-server"]), 1):
        for t, (a, b) in enumerate(zip(s["turns"], ls["turns"]), 1):
            if a["prompt_tokens"] != b["prompt_tokens"]:
                out.append(
                    f"round {rnd} turn {t}: prompt tokens sluice {a['prompt_tokens']} vs "
                    f"llama-server {b['prompt_tokens']}"
                )
    for name, rs in runs.items():
        for r in rs:
            idle = [
                t
                for t, x in enumerate(r["turns"], 1)
                if x["background_active"][0] < args.background or x.get("background_restarts")
            ]
            if idle:
                out.append(
                    f"{name} round {r['round']}: background not all generating during turns {idle}"
                )
            short = [
                t for t, x in enumerate(r["turns"], 1) if x["completion_tokens"] != args.tokens
            ]
            if short:
                out.append(f"{name} round {r['round']}: answers of another length at turns {short}")
            if r["foreign_cores"] > args.quiet:
                out.append(
                    f"{name} round {r['round']}: other processes used {r['foreign_cores']:.2f} cores"
                )
    return out


def targets(summary: dict[str, Any]) -> dict[str, bool]:
    rows = summary["rows"]
    turns = [r for r in rows if r["what"].startswith("turn ")]
    resent = next(r for r in rows if r["what"].startswith("long prompt, re-sent"))
    return {
        "every_turn_ttft_le_llama_server": all(
            r["ratio"] <= TARGETS["turn_ttft_ratio_max"] for r in turns
        ),
        "resent_ttft_le_llama_server": resent["ratio"] <= TARGETS["resent_ttft_ratio_max"],
        "last_turn_le_0.25x_cold": summary["last_vs_cold"]["sluice"]
        <= TARGETS["last_turn_vs_cold_max"],
    }


def table(summary: dict[str, Any], markdown: bool) -> str:
    head = ["", "prompt tok (sluice/llama)", "cached tok (sluice/llama)", "sluice TTFT ms"]
    head += ["llama-server TTFT ms", "sluice/llama", "rounds sluice <="]
    rows = []
    for r in summary["rows"]:
        rows.append(
            [
                r["what"],
                "/".join(str(x) for x in r["prompt_tokens"]),
                "/".join(f"{x:.0f}" for x in r["cached_tokens"]),
                f"{r['sluice_ms']:.0f}",
                f"{r['llama_ms']:.0f}",
                f"{r['ratio']:.2f}",
                f"{r['rounds_le']}/{summary['rounds']}",
            ]
        )
    return report.render_table(head, rows, markdown)


def write_report(res: dict[str, Any], out_dir: Path) -> None:
    summary, met, mach, st = res["summary"], res["met"], res["machine"], res["settings"]
    load = res["load_average"]
    lvc = summary["last_vs_cold"]
    n = st["turns"]
    lines = [
        (
            f"turn {n} / cold prefill of its whole prompt: sluice {lvc['sluice']:.3f}, "
            f"llama-server {lvc['llama-server']:.3f} (target for sluice <= 0.25)"
        ),
        "answers with the same text on both servers, per round: "
        + ", ".join(f"{k}/{n}" for k in summary["same_answers"])
        + " (greedy on both, the same token counts; the texts part after a few dozen tokens "
        "since the servers batch the sequences differently and llama.cpp's rounding depends "
        "on the batch shape)",
        "others' CPU during a round (cores): "
        + "; ".join(
            name + " " + ", ".join(f"{r['foreign_cores']:.2f}" for r in runs)
            for name, runs in res["runs"].items()
        ),
    ]
    print(f"\n{table(summary, markdown=False)}\n")
    for line in lines:
        print(line)
    report.print_outcome(met, res["checks"], load)
    bi = res["llama_server_build"]
    md = (
        f"# Conversations and the prompt cache {res['date']}\n\n"
        f"SmolLM2-135M Q4_1, one conversation of {n} turns (~{st['words']} words each, "
        f"{st['tokens']} tokens per answer, temperature 0, `ignore_eos`) while "
        f"{st['background']} background streams keep the other slots generating "
        f"({st.get('background_tokens', '192-383')} tokens each); then a "
        f"~{st['long_words']}-word prompt sent, 8 other requests, the prompt again (no "
        f"background). {st['rounds']} rounds, a fresh server each time, the order swapped "
        "every round; one server running at a time.\n\n"
        f"- sluice: `{' '.join(st['cmds']['sluice'])}` (the turns through `POST /c1/chat`, "
        "only the new message)\n"
        f"- llama-server: `{' '.join(st['cmds']['llama-server'])}` (the whole history "
        "through `/v1/chat/completions`, `cache_prompt: true`), built from llama-cpp-python "
        f"{bi.get('llama_cpp_python')}'s vendored llama.cpp with "
        f"`{' '.join(bi.get('cmake_flags', []))}`\n\n"
        f"{report.machine_line(mach, load)}.\n\n"
        + (f"Note: {st['note']}\n\n" if st["note"] else "")
        + table(summary, markdown=True)
        + "\n\nTTFT = request sent -> first chunk with content (client side), median over "
        "rounds; rounds sluice <= = rounds where sluice's TTFT was at or below llama-server's "
        "in the same round. cold = the last turn's whole prompt with one word added at the "
        "start of the first user message (nothing cached beyond the template's system part), "
        "under the same background load. Prompt tokens as each server reports them (round "
        "1).\n\n"
        + "".join(f"- {line}\n" for line in lines)
        + "\nTargets: "
        + report.targets_and_checks(met, res["checks"], st["reproduce"])
    )
    report.save_report(out_dir, f"conversation-{res['stamp']}", res, md)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="1 round, 4 turns, shorter prompts")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 2, --quick 1)")
    ap.add_argument("--turns", type=int, default=None, help="turns (default 10, --quick 4)")
    ap.add_argument("--words", type=int, default=150, help="words per user message")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per answer (default 64)")
    ap.add_argument(
        "--long-words",
        type=int,
        default=None,
        help="the long prompt, words (default 1700: ~2000 tokens)",
    )
    ap.add_argument("--other-words", type=int, default=150, help="the 8 other prompts")
    ap.add_argument("--background", type=int, default=PARALLEL - 1, help="background streams")
    ap.add_argument(
        "--background-tokens",
        type=int,
        default=4000,
        help="tokens per background stream (default 4000: they outlast the turns)",
    )
    ap.add_argument("--think", type=float, default=0.0, help="seconds between turns")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--quiet", type=float, default=0.3, help="noise threshold, in cores")
    ap.add_argument("--quiet-timeout", type=float, default=30.0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", default="", help="a note stored with the results")
    ap.add_argument("--report", type=Path, help="rewrite the .md of a results .json, no run")
    args = ap.parse_args()
    if args.report:
        res = json.loads(args.report.read_text())
        write_report(res, args.report.parent)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers closed on the way out
    reproduce = ".venv/bin/python benchmarks/conversation.py" + " --quick" * args.quick
    reproduce += f" --rounds {args.rounds}" * bool(args.rounds)
    reproduce += f" --think {args.think:g}" * bool(args.think)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.turns = args.turns or (4 if args.quick else 10)
    args.tokens = args.tokens or (32 if args.quick else 64)
    args.long_words = args.long_words or (500 if args.quick else 1700)
    servers = tuple(s for s in SERVERS if s in args.servers.split(","))
    binary = ensure_llama_server()  # built (once) before anything is timed
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started, load_start = report.now(), loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-conversation-"))
    (tmp / "models").mkdir()
    print(f"conversation: rounds={args.rounds} turns={args.turns} servers={servers}; logs in {tmp}")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in servers}
    cmds: dict[str, list[str]] = {}
    for rnd in range(args.rounds):
        for name in rotated(servers, rnd):
            print(f"  round {rnd + 1}/{args.rounds}: {name}", flush=True)
            srv = start_server(name, tmp, rnd + 1)
            cmds[name] = srv.cmd
            try:
                runs[name].append(run_server(srv, args) | {"round": rnd + 1})
            finally:
                srv.close()
    if set(servers) != set(SERVERS):
        print(json.dumps(runs, indent=1)[:4000])
        return
    summary = summarize(runs)
    res = {
        "date": started.isoformat(timespec="seconds"),
        "stamp": report.stamp(started),
        "machine": machine_info(),
        "llama_server_build": build_info(binary),
        "load_average": {"start": load_start, "end": loadavg()},
        "settings": {
            "rounds": args.rounds,
            "turns": args.turns,
            "words": args.words,
            "tokens": args.tokens,
            "long_words": args.long_words,
            "other_words": args.other_words,
            "background": args.background,
            "background_tokens": args.background_tokens,
            "think_s": args.think,
            "cmds": {
                k: [str(Path(a).name) if a.startswith(str(tmp)) else a for a in v]
                for k, v in cmds.items()
            },
            "note": args.note,
            "reproduce": reproduce,
        },
        "targets": TARGETS,
        "met": {},
        "summary": summary,
        "runs": runs,
    }
    res["met"] = targets(summary)
    res["checks"] = checks(runs, args)
    write_report(res, args.out_dir)


if __name__ == "__main__":
    main()
