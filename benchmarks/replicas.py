#!/usr/bin/env python
"""Real replicas behind sluice: llama.cpp's ``llama-server`` x2 and x3; cache affinity,
and answers continued when a replica dies in mid-stream.

Each replica keeps its own prompt cache; a gateway that sends a conversation's turns to
whichever replica is free makes them prefill their history again. Per replica count:

* **conversation**: a 20-turn chat with a ~3,000-token system prompt (``max_tokens``
  16, temperature 0, the answers appended as the assistant's turns), through a sluice
  gateway with affinity on, and a second one with ``affinity = false`` (the old choice,
  fewest in flight, ties in turn) on another conversation of the same shape. Per turn:
  the replica (``x-sluice-slot``), prompt and cached tokens (the upstream's own
  ``usage.prompt_tokens_details.cached_tokens``), the turn's time.
* **failover**: the replica that holds the conversation is sent SIGKILL after turn 10;
  turns 11-20 must answer (no 5xx) on another replica, and be warm again from turn 12.
* **spread**: 30 conversations sent at once (short prompts, ``max_tokens`` 8, a
  thread each): how many each replica answered.
* **mid-stream**: a 200-token answer (temperature 0) streamed through the ``openai``
  SDK, the ``anthropic`` SDK (``/v1/messages``, translated; and through a gateway with
  ``native_apis = ["anthropic"]``, passed through to llama-server's own
  ``/v1/messages``) and the ``ollama`` SDK (``/api/chat``), the replica serving it
  sent SIGKILL after its tenth chunk (then started again): the text read must be one of the answers the replicas gave
  uninterrupted in the phase (each request asked twice first; llama-server's greedy
  answer varies at near ties with its batches and cache), with one finish and usage.

Replicas: ``llama-server -t 1 -np 2`` on SmolLM2, ``-c`` 2 x 4,608 (built once from the
vendored llama.cpp, see ``harness/llama_build.py``); the gateway ``sluice serve --threads
1``. Usage: ``.venv/bin/python benchmarks/replicas.py [--replicas 2,3] [--turns 20]``;
writes ``benchmarks/results/replicas-<stamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import RESULTS, report
from harness.llama_build import ensure_llama_server
from harness.machine import loadavg, machine_info
from harness.prompts import sentence
from harness.servers import SLUICE, LlamaServer, Server, free_port, llama_server_cmd, models_env
from harness.stats import med

TARGETS = {"cached_share_from_turn_2": 0.90, "spread": 0.20}
# The replicas' model as the gateway names it: not a name of its own local models
# (local names win), so every request goes up.
MODEL = "up-smollm2"
KILL_AFTER = 10  # turns before the pinned replica is killed


def system_prompt(seed: int, words: int = 2300) -> str:
    """About 3,000 SmolLM2 tokens of plain prose, different for each seed from its start."""
    rng = random.Random(seed)
    parts = [f"Conversation {seed}. You are a patient tutor. Here are your notes:"]
    while sum(len(p.split()) for p in parts) < words:
        parts.append(sentence(rng))
    return " ".join(parts)


def chat(port: int, messages: list[dict[str, str]], tokens: int) -> tuple[int, dict[str, Any], str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": 0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("x-sluice-slot", "")
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode("utf-8", "replace")}, ""


def replica_of(slot_header: str) -> str:
    return slot_header.split("replica=")[-1]


def conversation(
    port: int, seed: int, turns: int, kill: dict[str, LlamaServer] | None = None
) -> list[dict[str, Any]]:
    """``turns`` turns of one conversation; with ``kill`` (url -> server), the replica that
    answered turn KILL_AFTER is killed (SIGKILL) before the next."""
    messages = [{"role": "system", "content": system_prompt(seed)}]
    out: list[dict[str, Any]] = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Question {turn}: what comes next?"})
        t0 = time.perf_counter()
        status, body, slot = chat(port, messages, 16)
        took = time.perf_counter() - t0
        usage = body.get("usage") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        out.append(
            {
                "turn": turn,
                "status": status,
                "replica": replica_of(slot),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "cached_share": cached / prompt if prompt else 0.0,
                "seconds": took,
            }
        )
        print(
            f"    turn {turn:2d}: {status} {replica_of(slot)[-5:]} prompt {prompt:5d} "
            f"cached {cached:5d} ({100 * out[-1]['cached_share']:5.1f}%) {took:6.2f} s",
            flush=True,
        )
        if status != 200:
            messages.append({"role": "assistant", "content": "(no answer)"})
            continue
        messages.append(
            {"role": "assistant", "content": body["choices"][0]["message"]["content"] or "."}
        )
        if kill is not None and turn == KILL_AFTER:
            victim = kill[replica_of(slot)]
            victim.proc.kill()
            victim.proc.wait()
            print(f"    (killed {replica_of(slot)})", flush=True)
    return out


def spread(port: int, replicas: list[str], n: int = 30) -> dict[str, int]:
    counts = dict.fromkeys(replicas, 0)
    lock = threading.Lock()

    def one(i: int) -> None:
        messages = [
            {"role": "system", "content": f"Conversation {i}: you are brief."},
            {"role": "user", "content": f"Name a colour, {i}."},
        ]
        status, _, slot = chat(port, messages, 8)
        with lock:
            if status == 200:
                counts[replica_of(slot)] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join()
    return counts


MIDSTREAM_PROMPT: Any = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def midstream(
    gw: Server, replicas: list[LlamaServer], tmp: Path, only: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Per SDK (``only``: those SDKs): the answer read while its replica is killed after
    ten chunks, against the same request's answer uninterrupted (each dialect samples
    with its own defaults: the reference is the dialect's own)."""
    import anthropic
    import ollama
    import openai

    base = gw.base
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    llama = ollama.Client(host=base)

    def with_openai(at: Callable[[int], None]) -> dict[str, Any]:
        stream = oai.chat.completions.create(
            model=MODEL,
            messages=MIDSTREAM_PROMPT,
            max_tokens=200,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finishes, usage = [], [], None
        for n, chunk in enumerate(stream, 1):
            at(n)
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason:
                    finishes.append(chunk.choices[0].finish_reason)
            if chunk.usage:
                usage = chunk.usage.model_dump()
        return {"text": "".join(text), "finishes": finishes, "usage": usage}

    def with_anthropic(at: Callable[[int], None]) -> dict[str, Any]:
        text = []
        with claude.messages.stream(
            model=MODEL,
            max_tokens=200,
            messages=MIDSTREAM_PROMPT,
            extra_body={"temperature": 0},
        ) as stream:
            for n, piece in enumerate(stream.text_stream, 1):
                at(n)
                text.append(piece)
            final = stream.get_final_message()
        usage = {
            "input_tokens": final.usage.input_tokens,
            "output_tokens": final.usage.output_tokens,
        }
        return {"text": "".join(text), "finishes": [final.stop_reason], "usage": usage}

    def with_ollama(at: Callable[[int], None]) -> dict[str, Any]:
        text, last = [], None
        parts = llama.chat(
            model=MODEL,
            messages=MIDSTREAM_PROMPT,
            stream=True,
            options={"temperature": 0, "num_predict": 200},
        )
        for n, part in enumerate(parts, 1):
            at(n)
            text.append(part.message.content or "")
            last = part
        assert last is not None
        return {
            "text": "".join(text),
            "finishes": [last.done_reason],
            "usage": {"prompt_eval_count": last.prompt_eval_count, "eval_count": last.eval_count},
        }

    def kill_serving() -> str:
        """SIGKILL the replica serving the request in flight (the gateway's list)."""
        (flight,) = gw.get("/v1/requests")["data"]
        victim = next(r for r in replicas if r.base == flight["replica"])
        victim.proc.kill()
        victim.proc.wait()
        return str(flight["replica"])

    out: dict[str, Any] = {}
    for name, run in (
        ("openai", with_openai),
        ("anthropic", with_anthropic),
        ("ollama", with_ollama),
    ):
        if only and name not in only:
            continue
        # Twice: llama-server's greedy answer is not always the same (its batches and
        # prompt cache change the arithmetic), so an interrupted answer is checked
        # against every uninterrupted one seen.
        expected = [run(lambda n: None)["text"] for _ in range(2)]
        killed: list[str] = []

        def at(n: int, killed: list[str] = killed) -> None:
            if n == 10:
                killed.append(kill_serving())

        try:
            got = run(at)
        except Exception as exc:  # noqa: BLE001 (the stream broke: what the client saw)
            got = {"text": "", "finishes": [], "usage": None, "error": repr(exc)}
        got["killed"] = killed[0] if killed else None
        got["same_as_uninterrupted"] = got["text"] in expected
        # Where it parts from the uninterrupted answers (None: it does not): a near tie
        # after the splice can go the other way, since the continuing replica prefills
        # the partial answer in one batch where the first decoded it token by token.
        points = [diverges_at(got["text"], e) for e in expected]
        got["diverges_at"] = None if None in points else max(p for p in points if p is not None)
        got["uninterrupted"] = expected
        got["control_equal"] = expected[0] == expected[1]
        out[name] = got
        print(
            f"    {name}: {len(got['text'])} chars, same as an uninterrupted answer "
            f"({[len(e) for e in expected]}): {got['same_as_uninterrupted']}, "
            f"finishes {got['finishes']}, "
            f"usage {got['usage']}" + (f", {got['error']}" if "error" in got else ""),
            flush=True,
        )
        if killed:
            restart(replicas, killed[0], tmp, gw)
    return out


def diverges_at(a: str, b: str) -> int | None:
    """The first character where ``a`` and ``b`` differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def restart(replicas: list[LlamaServer], url: str, tmp: Path, gw: Server) -> None:
    """Start the killed replica at ``url`` again (same port, same flags), and wait until
    the gateway's health checks take it back (its backoff may be at 30 s)."""
    for i, r in enumerate(replicas):
        if r.base == url:
            replicas[i] = LlamaServer(r.name, r.cmd, r.port, tmp / f"{r.name}-again.log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        slots = gw.health()["upstreams"]
        if all(
            s["state"] == "healthy" for slot in slots.values() for s in slot["replicas"].values()
        ):
            return
        time.sleep(0.5)


def gateway(tmp: Path, name: str, urls: list[str], affinity: bool, native: bool = False) -> Server:
    """A sluice gateway over ``urls``; ``native``: Messages passed through as they are
    (``native_apis = ["anthropic"]``), not translated to OpenAI chat."""
    port = free_port()
    config = tmp / f"{name}.toml"
    config.write_text(
        "[[upstreams]]\n"
        f'name = "{name}"\nurls = {json.dumps(urls)}\nmodels = ["smollm2"]\n'
        f'aliases = {{ "{MODEL}" = "smollm2" }}\n'
        f"affinity = {'true' if affinity else 'false'}\nhealth_interval = 2\n"
        + ('native_apis = ["anthropic"]\n' if native else "")
    )
    (tmp / "models").mkdir(exist_ok=True)
    cmd = [*SLUICE, "--threads", "1", "--log-level", "warning", "--config", str(config)]
    cmd += ["--strict-model-names", "--port", str(port)]
    return Server(name, cmd, port, tmp / f"{name}.log", env=models_env(tmp / "models"))


def run_replicas(n: int, args: argparse.Namespace, binary: Path, tmp: Path) -> dict[str, Any]:
    replicas: list[LlamaServer] = []
    try:
        for i in range(n):
            port = free_port()
            cmd = llama_server_cmd(binary, port, 1, 2, 4608)
            replicas.append(LlamaServer(f"replica{i}", cmd, port, tmp / f"r{n}-{i}.log"))
        urls = [r.base for r in replicas]
        by_url = dict(zip(urls, replicas))
        result: dict[str, Any] = {"replicas": n}
        with gateway(tmp, f"off{n}", urls, affinity=False) as off:
            print(f"  {n} replicas, affinity off:", flush=True)
            result["affinity_off"] = conversation(off.port, 1000 + n, args.turns)
        with gateway(tmp, f"on{n}", urls, affinity=True) as on:
            print(f"  {n} replicas, affinity on:", flush=True)
            result["affinity_on"] = conversation(on.port, 2000 + n, args.turns)
            print(f"  {n} replicas, 30 conversations at once:", flush=True)
            result["spread"] = spread(on.port, urls)
            print(f"    {result['spread']}", flush=True)
            print(f"  {n} replicas, the pinned replica killed after turn {KILL_AFTER}:")
            result["failover"] = conversation(on.port, 3000 + n, args.turns, kill=by_url)
            if len(result["failover"]) > KILL_AFTER:
                restart(replicas, result["failover"][KILL_AFTER - 1]["replica"], tmp, on)
            print(f"  {n} replicas, a replica killed in mid-stream:", flush=True)
            result["midstream"] = midstream(on, replicas, tmp)
            result["gateway_info"] = on.get("/v1/info")
        with gateway(tmp, f"native{n}", urls, affinity=True, native=True) as native:
            print(f"  {n} replicas, Messages passed through, killed in mid-stream:", flush=True)
            passed = midstream(native, replicas, tmp, only=("anthropic",))
            result["midstream"]["anthropic native"] = passed["anthropic"]
        return result
    finally:
        for r in replicas:
            r.close()


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    def after_first(turns: list[dict[str, Any]], skip: int = 1) -> list[float]:
        return [t["cached_share"] for t in turns[skip:] if t["status"] == 200]

    on, off, fail = run["affinity_on"], run["affinity_off"], run["failover"]
    answers = {t for m in run["midstream"].values() for t in m["uninterrupted"]}
    counts = list(run["spread"].values())
    mean = sum(counts) / len(counts)
    moved = fail[KILL_AFTER:] or fail[-1:]
    return {
        "replicas": run["replicas"],
        "on_min_cached_from_turn_2": min(after_first(on)),
        "on_median_cached_from_turn_2": med(after_first(on)),
        "off_min_cached_from_turn_2": min(after_first(off)),
        "off_median_cached_from_turn_2": med(after_first(off)),
        "off_cold_turns": sum(1 for t in off[1:] if t["cached_share"] < 0.5),
        "on_median_turn_s": med([t["seconds"] for t in on[1:]]),
        "off_median_turn_s": med([t["seconds"] for t in off[1:]]),
        "failover_statuses": sorted({t["status"] for t in fail}),
        "failover_moved_to": sorted({t["replica"] for t in moved}),
        "failover_min_cached_after_move": min(after_first(moved)) if len(moved) > 1 else None,
        "spread": run["spread"],
        "spread_max_deviation": max(abs(c - mean) / mean for c in counts),
        # Every uninterrupted answer of the phase: llama-server's greedy answer to one
        # request changes with its batches and cache at near ties, whatever the dialect.
        "midstream_answers": len(answers),
        "midstream": {
            name: {
                "same_as_uninterrupted": m["same_as_uninterrupted"],
                "one_of_the_answers": m["text"] in answers,
                "control_equal": m["control_equal"],
                "diverges_at": m.get("diverges_at"),
                "finishes": m["finishes"],
                "usage": m["usage"],
            }
            for name, m in run["midstream"].items()
        },
    }


def markdown(doc: dict[str, Any]) -> str:
    head = [
        "replicas",
        "cached from turn 2, on: min / median",
        "off: min / median (cold turns)",
        "turn s on / off",
        "killed: statuses, warm again",
        "30 at once",
        "killed mid-stream: text as an uninterrupted answer (openai / anthropic / ollama / anthropic passed through; *: another request's)",
    ]
    rows = []
    for s in doc["summary"]:
        rows.append(
            [
                str(s["replicas"]),
                (
                    f"{100 * s['on_min_cached_from_turn_2']:.1f}% / "
                    f"{100 * s['on_median_cached_from_turn_2']:.1f}%"
                ),
                (
                    f"{100 * s['off_min_cached_from_turn_2']:.1f}% / "
                    f"{100 * s['off_median_cached_from_turn_2']:.1f}% ({s['off_cold_turns']})"
                ),
                f"{s['on_median_turn_s']:.2f} / {s['off_median_turn_s']:.2f}",
                f"{s['failover_statuses']}, min "
                + (
                    "-"
                    if s["failover_min_cached_after_move"] is None
                    else f"{100 * s['failover_min_cached_after_move']:.1f}%"
                ),
                " / ".join(str(c) for c in s["spread"].values())
                + f" (max {100 * s['spread_max_deviation']:.0f}% off)",
                " / ".join(
                    ("yes" if m["one_of_the_answers"] else "no")
                    + ("" if m["same_as_uninterrupted"] else "*")
                    + f" ({m['finishes']})"
                    for m in s["midstream"].values()
                ),
            ]
        )
    return (
        f"# llama-server replicas behind sluice, {doc['date']}\n\n"
        f"{report.machine_line(doc['machine'], doc['load_average'])}. {doc['turns']} turns, "
        f"~3,000-token system prompt, max_tokens 16; the pinned replica killed after turn "
        f"{KILL_AFTER}. {doc['note']}\n\n"
        + report.render_table(head, rows, markdown=True)
        + "\n\n"
        + report.targets_and_checks(doc["targets"], [], doc["reproduce"])
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replicas", default="2,3", help="replica counts to run")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", default="", help="a note stored with the results")
    args = ap.parse_args()
    binary = ensure_llama_server()
    when = report.now()
    load0 = loadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="sluice-replicas-") as tmp:
        for n in (int(x) for x in args.replicas.split(",")):
            runs.append(run_replicas(n, args, binary, Path(tmp)))
    summary = [summarize(r) for r in runs]
    met = {
        "cached >= 90% from turn 2 (affinity on)": all(
            s["on_min_cached_from_turn_2"] >= TARGETS["cached_share_from_turn_2"] for s in summary
        ),
        "pinned replica killed: no 5xx": all(
            all(st < 500 for st in s["failover_statuses"]) for s in summary
        ),
        "30 at once within +-20%": all(
            s["spread_max_deviation"] <= TARGETS["spread"] for s in summary
        ),
        "killed mid-stream: an uninterrupted answer, one finish, on every SDK": all(
            m["one_of_the_answers"] and len(m["finishes"]) == 1
            for s in summary
            for m in s["midstream"].values()
        ),
    }
    doc = {
        "date": when.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load_average": {"start": load0, "end": loadavg()},
        "turns": args.turns,
        "note": args.note,
        "runs": runs,
        "summary": summary,
        "targets": met,
        "reproduce": "python benchmarks/replicas.py " + " ".join(sys.argv[1:]),
    }
    md = markdown(doc)
    stem = f"replicas-{report.stamp(when)}"
    report.save_report(args.out_dir, stem, doc, md)
    print(md)
    print(f"replicas: wrote {args.out_dir / stem}.md")


if __name__ == "__main__":
    main()
