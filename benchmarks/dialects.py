#!/usr/bin/env python
"""What a dialect costs per token: the same generation streamed as OpenAI chat, as
Anthropic's Messages and as OpenAI's Responses, side by side on one server; and how
long a Responses stream takes to resume.

One ``sluice serve`` (``--threads T --parallel 8``, the embedded SmolLM2, a store of its
own in a temporary folder) answers N concurrent streams (N = each of ``--levels``) of
the same distinct conversations (``make_messages``), greedy, ``ignore_eos``, the token
count as the limit, once per dialect:

* openai: ``POST /v1/chat/completions`` (``max_tokens``, with the usage chunk);
* anthropic: ``POST /v1/messages`` (``max_tokens``, the system message as ``system``);
* gemini: ``POST /v1beta/models/smollm2:streamGenerateContent?alt=sse``
  (``generationConfig.maxOutputTokens``, the system message as ``systemInstruction``, the
  rest as ``contents``); its output tokens are the last record's
  ``usageMetadata.candidatesTokenCount``;
* responses: ``POST /v1/responses`` (``max_output_tokens``, ``store: false``, the system
  message as ``instructions``, the rest as ``input`` messages); its output tokens are
  the terminal event's ``response.usage.output_tokens`` (``response.incomplete`` with
  reason ``max_output_tokens``: the limit is always reached under ``ignore_eos``).

The dialects take turns, the order rotated round by round, each after a warm-up; every
measurement waits for a quiet machine (``harness.machine.Noise``).

Per measurement: aggregate tok/s (completion tokens / first request sent -> last byte of
the last stream), and the CPU time per token of the server's main thread: the event
loop, where the dialect's work is done (formatting, encoding, HTTP); the engine's
decode runs on its own thread and is the same for every dialect. (All threads' CPU is
recorded too, but llama.cpp's spinning threads make it track the wall time.) The report
gives, per level and dialect, the median of the per-round ratios dialect / openai
("paired") and their range: 1.00 is "costs the same".

Resume (``--resume-tries`` pairs per case, 0: skipped): a background response
(``background: true, store: true, stream: false``: answered at once with its id) is
resumed with ``GET /v1/responses/{id}?stream=true&starting_after=N`` (``--resume-after``),
timed from sending the GET to the first ``data:`` line of the replayed events, (a)
while it generates (a 1,000-token response, resumed once its text has 200 characters,
so that event N+1 exists; cancelled after the pair) and (b) once it ended (64 tokens),
well within ``--resume-grace``. The anchor, measured right before or after each resume
(the order alternating): a fresh ``POST /v1/responses`` stream (``store: false``, 16
tokens) -> its first ``data:`` line, while the same background response generates in
(a), on an idle server in (b). The report gives the milliseconds of each (median,
range) and the paired ratio resume / fresh.

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
from functools import partial
from pathlib import Path
from typing import Any

from harness import RESULTS
from harness.client import body_of, connect, http_post, run_streams
from harness.machine import Noise, loadavg, machine_info, proc_cpu_seconds
from harness.prompts import make_messages
from harness.servers import SLUICE, Server, free_port
from harness.stats import med, rotated

DIALECTS = ("openai", "anthropic", "responses", "gemini")
PATHS = {
    "openai": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
    "gemini": "/v1beta/models/smollm2:streamGenerateContent?alt=sse",
}
# A content frame of each dialect: each is counted.
MARKS = {
    "openai": b'"delta":{"content"',
    "anthropic": b'"text_delta"',
    "responses": b'"type":"response.output_text.delta"',
    "gemini": b'"parts":[{"text"',
}
# The Responses terminal events that carry the usage (the limit reached: incomplete).
TERMINAL = ("response.completed", "response.incomplete")
LIVE_TOKENS = 1000  # the background response resumed while it generates (then cancelled)
LIVE_CHARS = 200  # its text when resumed: past event N for any N a few tokens in
DONE_TOKENS = 64  # the background response resumed once it ended
FRESH_TOKENS = 16  # the anchor: a fresh stream's first event


def body(dialect: str, conversation: list[dict[str, str]], tokens: int) -> bytes:
    return json.dumps(request(dialect, conversation, tokens)).encode()


def request(dialect: str, conversation: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    """The streaming request of ``dialect``: greedy, ``ignore_eos``, ``tokens`` at most."""
    system = [m["content"] for m in conversation if m["role"] == "system"]
    rest = [m for m in conversation if m["role"] != "system"]
    if dialect == "gemini":
        data: dict[str, Any] = {
            "contents": [
                {
                    "role": "model" if m["role"] == "assistant" else "user",
                    "parts": [{"text": m["content"]}],
                }
                for m in rest
            ],
            "generationConfig": {"temperature": 0, "maxOutputTokens": tokens},
            "ignore_eos": True,
        }
        if system:
            data["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
        return data
    if dialect == "responses":
        data = {
            "model": "smollm2",
            "input": [{"role": m["role"], "content": m["content"]} for m in rest],
            "stream": True,
            "temperature": 0,
            "max_output_tokens": tokens,
            "ignore_eos": True,
            "store": False,
        }
        if system:
            data["instructions"] = "\n\n".join(system)
        return data
    data = {
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
        data["messages"] = rest
        if system:
            data["system"] = "\n\n".join(system)
    return data


def output_tokens(dialect: str, raw: bytes) -> int:
    """The completion tokens the stream's own usage reports."""
    try:
        data = body_of(raw)
    except ValueError:  # a cut chunked body: whatever came
        data = raw.partition(b"\r\n\r\n")[2]
    found = 0
    for line in data.decode("utf-8", "replace").split("\n"):
        if not line.startswith("data: {"):
            continue
        try:
            obj = json.loads(line[6:])
        except ValueError:
            continue
        kind = obj.get("type")
        usage = None
        if dialect == "openai" or (dialect == "anthropic" and kind == "message_delta"):
            usage = obj.get("usage")
        elif dialect == "responses" and kind in TERMINAL:
            usage = (obj.get("response") or {}).get("usage")
        elif dialect == "gemini" and "usageMetadata" in obj:
            usage = {"output_tokens": obj["usageMetadata"].get("candidatesTokenCount", 0)}
        if usage:
            found = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return int(found)


def measure(
    server: Server, dialect: str, convs: list[list[dict[str, str]]], tokens: int
) -> dict[str, Any]:
    path = PATHS[dialect]
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


# -- resume ----------------------------------------------------------------------------


def http_get(port: int, path: str) -> bytes:
    """A GET of an SSE stream (``Connection: close``; no key: the server has none)."""
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Accept: text/event-stream\r\nConnection: close\r\n\r\n"
    ).encode()


def first_event(port: int, req: bytes, *, to_end: bool = False) -> tuple[float, dict[str, Any]]:
    """Seconds from sending ``req`` (connected before the clock) to the first ``data:``
    line of the answer, and that event; read to the end if ``to_end``, else hang up."""
    sock = connect(port)
    buf = bytearray()
    t_first = 0.0
    try:
        t0 = time.perf_counter()
        sock.sendall(req)
        while data := sock.recv(65536):
            now = time.perf_counter()
            buf += data
            at = buf.find(b"data: ")
            if at >= 0 and not t_first:
                t_first = now - t0
            if at >= 0 and b"\n" in buf[at:] and not to_end:
                break
    finally:
        sock.close()
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    if not t_first or not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"dialects: no event in {bytes(buf[:400])!r}")
    line = rest[rest.find(b"data: ") + 6 :].split(b"\n", 1)[0]
    return t_first, json.loads(line)


def background(server: Server, conversation: list[dict[str, str]], tokens: int) -> str:
    """A stored background response (answered at once): its id."""
    data = request("responses", conversation, tokens)
    data |= {"stream": False, "background": True, "store": True}
    started = server.post(PATHS["responses"], data)
    if started.get("status") != "queued":
        raise SystemExit(f"dialects: a background response was not queued: {started}")
    return str(started["id"])


def wait_for(server: Server, rid: str, done: bool, timeout: float = 120.0) -> dict[str, Any]:
    """The response once it ended (``done``), or once its text has ``LIVE_CHARS``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = server.get(f"{PATHS['responses']}/{rid}")
        if got["status"] not in ("queued", "in_progress"):  # ended
            return dict(got)
        text = "".join(
            part.get("text", "")
            for item in got.get("output") or ()
            for part in item.get("content") or ()
        )
        if not done and len(text) >= LIVE_CHARS:
            return dict(got)
        time.sleep(0.02)
    raise SystemExit(f"dialects: response {rid} did not get there in {timeout:g} s")


def resume_pair(server: Server, case: str, serial: int, after: int, k: int) -> dict[str, Any]:
    """One resume of a background response and one fresh stream, in the order of ``k``."""
    live = case == "generating"
    rid = background(server, make_messages(serial, 0), LIVE_TOKENS if live else DONE_TOKENS)
    before = wait_for(server, rid, done=not live)
    resume_req = http_get(
        server.port, f"{PATHS['responses']}/{rid}?stream=true&starting_after={after}"
    )
    fresh_req = http_post(
        server.port, PATHS["responses"], body("responses", make_messages(serial, 1), FRESH_TOKENS)
    )
    out: dict[str, Any] = {"id": rid, "starting_after": after}
    for side in rotated(("resume", "fresh"), k):
        if side == "resume":
            secs, event = first_event(server.port, resume_req)
            if event.get("sequence_number") != after + 1:
                raise SystemExit(f"dialects: resumed at the wrong event: {event}")
            out["resume_ms"] = 1e3 * secs
        else:
            secs, event = first_event(server.port, fresh_req, to_end=True)
            out["fresh_ms"] = 1e3 * secs
            out["fresh_first_event"] = event.get("type")
    out["status_before"] = before["status"]
    if live:
        after_state = server.get(f"{PATHS['responses']}/{rid}")
        out["status_after"] = after_state["status"]  # in_progress: it generated throughout
        server.post(f"{PATHS['responses']}/{rid}/cancel", {})
    out["ratio"] = out["resume_ms"] / out["fresh_ms"]
    return out


def measure_resume(
    server: Server, noise: Noise, args: argparse.Namespace, serial: int
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"generating": [], "finished": []}
    for case, pairs in out.items():
        for k in range(args.resume_tries):
            serial += 1
            server.wait_idle()
            time.sleep(0.3)
            res, foreign, _ = noise.run(
                partial(resume_pair, server, case, serial, args.resume_after, k),
                args.quiet,
                args.quiet_timeout,
            )
            res["foreign_cores"] = foreign
            pairs.append(res)
            print(
                f"  resume {case:10s} {k + 1}/{args.resume_tries}: resume "
                f"{res['resume_ms']:6.1f} ms, fresh first event {res['fresh_ms']:6.1f} ms, "
                f"ratio {res['ratio']:.2f}  (others used {foreign:.2f} cores)",
                flush=True,
            )
    return out


# -- report ----------------------------------------------------------------------------


def span(xs: list[float], fmt: str = ".3f") -> str:
    """``median [min-max]``."""
    return f"{med(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]" if xs else "-"


def report(
    args: argparse.Namespace,
    started: _dt.datetime,
    levels: list[int],
    results: dict[int, dict[str, list[dict[str, Any]]]],
    resume: dict[str, list[dict[str, Any]]],
) -> tuple[str, dict[str, Any]]:
    summary: dict[str, Any] = {}
    lines = [
        (
            "# Dialect overhead: Anthropic Messages, OpenAI Responses and Gemini vs OpenAI chat "
            f"({started:%Y-%m-%d %H:%M})"
        ),
        "",
        (
            f"SmolLM2-135M Q4_1, {args.threads} threads, {args.tokens} tokens per stream, "
            f"greedy, ignore_eos, {args.rounds} rounds alternating (order rotated). Ratios "
            "are dialect / openai per round; 'paired' is their median."
        ),
        "",
        (
            "| streams | dialect | tok/s (median) | tok/s ratio paired [range] "
            "| event-loop CPU/token (us, median) | event-loop CPU/token ratio paired [range] |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for n in levels:
        o = results[n]["openai"]
        summary[str(n)] = {}
        for dialect in DIALECTS:
            d = results[n][dialect]
            speed = [x["agg_tok_s"] / y["agg_tok_s"] for x, y in zip(d, o)]
            cpu = [x["loop_cpu_us_per_token"] / y["loop_cpu_us_per_token"] for x, y in zip(d, o)]
            if dialect != "openai":
                summary[str(n)][dialect] = {"tok_s_ratio": speed, "cpu_ratio": cpu}
            lines.append(
                f"| {n} | {dialect} | {med([x['agg_tok_s'] for x in d]):.1f} "
                f"| {'(anchor)' if dialect == 'openai' else span(speed)} "
                f"| {med([x['loop_cpu_us_per_token'] for x in d]):.0f} "
                f"| {'(anchor)' if dialect == 'openai' else span(cpu)} |"
            )
    if any(resume.values()):
        lines += [
            "",
            "## Resuming a Responses stream",
            "",
            (
                "A background response (`background: true, store: true`) resumed with "
                f"`GET /v1/responses/{{id}}?stream=true&starting_after={args.resume_after}`: "
                "GET sent -> first replayed `data:` line; while it generates "
                f"({LIVE_TOKENS} tokens, resumed once its text has {LIVE_CHARS} characters) "
                f"and once it ended ({DONE_TOKENS} tokens). Anchor: a fresh `POST "
                f"/v1/responses` stream (store: false, {FRESH_TOKENS} tokens) -> its first "
                "`data:` line, right before or after each resume (order alternating), while "
                "the same response generates / on an idle server."
            ),
            "",
            (
                "| case | pairs | resume: first event ms, median [range] "
                "| fresh POST: first event ms, median [range] | resume / fresh paired [range] |"
            ),
            "|---|---|---|---|---|",
        ]
        for case, pairs in resume.items():
            if not pairs:
                continue
            ratios = [p["ratio"] for p in pairs]
            summary[f"resume_{case}"] = {
                "resume_ms": [p["resume_ms"] for p in pairs],
                "fresh_ms": [p["fresh_ms"] for p in pairs],
                "ratio": ratios,
            }
            lines.append(
                f"| {case} | {len(pairs)} | {span([p['resume_ms'] for p in pairs], '.1f')} "
                f"| {span([p['fresh_ms'] for p in pairs], '.1f')} | {span(ratios, '.2f')} |"
            )
        live = resume.get("generating") or []
        if live:
            still = sum(p.get("status_after") == "in_progress" for p in live)
            lines += ["", f"- generating: still generating after the pair in {still}/{len(live)}"]
    return "\n".join(lines) + "\n", summary


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
        "--resume-tries", type=int, default=10, help="pairs per resume case (0: no resume)"
    )
    ap.add_argument(
        "--resume-after",
        type=int,
        default=8,
        help="the resume's starting_after: a few tokens in (default 8; the generating "
        f"response is resumed once its text has {LIVE_CHARS} characters)",
    )
    ap.add_argument(
        "--quiet", type=float, default=0.3, help="max cores others may use (default 0.3)"
    )
    ap.add_argument("--quiet-timeout", type=float, default=60.0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    started = _dt.datetime.now()
    print(
        f"dialects: threads={args.threads} tokens={args.tokens} rounds={args.rounds} "
        f"levels={levels} resume_tries={args.resume_tries} load={loadavg()}",
        flush=True,
    )
    port = free_port()
    tmp = tempfile.TemporaryDirectory(prefix="sluice-dialects-")  # the server's store
    log = Path(tempfile.gettempdir()) / f"sluice-dialects-{port}.log"
    ctx = max(args.tokens, LIVE_TOKENS if args.resume_tries else 0) + 256
    cmd = [*SLUICE, "--port", str(port), "--parallel", "8", "--threads", str(args.threads)]
    cmd += ["--ctx", str(ctx), "--log-level", "warning"]
    cmd += ["--store", str(Path(tmp.name) / "sluice.db")]
    results: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {d: [] for d in DIALECTS} for n in levels
    }
    resume: dict[str, list[dict[str, Any]]] = {}
    with tmp, Server("sluice", cmd, port, log) as server:
        noise = Noise([server.pid])
        serial = int(time.time()) % 900
        for n in levels:  # warm-up: every dialect, every level
            for dialect in DIALECTS:
                serial += 1
                measure(server, dialect, [make_messages(serial, i) for i in range(n)], 16)
        for rnd in range(args.rounds):
            for li, n in enumerate(levels):
                serial += 1
                convs = [make_messages(serial, i) for i in range(n)]
                for dialect in rotated(DIALECTS, rnd + li):
                    server.wait_idle()
                    time.sleep(0.3)
                    res, foreign, _ = noise.run(
                        partial(measure, server, dialect, convs, args.tokens),
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
        if args.resume_tries > 0:
            resume = measure_resume(server, noise, args, serial)
    md, summary = report(args, started, levels, results, resume)
    print(md)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"dialects-{started:%Y-%m-%d-%H%M%S}"
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "args": vars(args) | {"out_dir": str(args.out_dir)},
                "machine": machine_info(),
                "results": results,
                "resume": resume,
                "summary": summary,
            },
            indent=1,
        )
    )
    stem.with_suffix(".md").write_text(md)
    print(f"dialects: wrote {stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
