#!/usr/bin/env python
"""Images on a local model: sluice against llama.cpp's llama-server ``--mmproj``.

The same files on both: SmolLM2-135M-Instruct and the colour projector the test suite
makes (``tests/support/projector.py``: 16 image tokens, a one-block encoder), one
thread each, the servers measured in turn (the other idle), rounds alternating which
goes first. Three measures:

* **first token of an image request**: a chat with a new image (a colour neither
  server has seen) under a new system prompt of ~300 words (an agent's is longer;
  nothing of it cached), streamed, request sent -> first content token; target:
  sluice's median <= 1.0x llama-server's;
* **the same image and prompt again**: the request repeated at once; target: sluice's
  repeat <= 0.1x its own first time (the prompt cache knows the image);
* **streams beside images**: four text streams decoding (200 tokens each) while image
  requests arrive one after another, against the same four while text requests of the
  same prompt token count arrive; the gaps between the four streams' tokens, p95;
  target: with images no worse than with text (<= 1.1x, the machine's noise).

Usage: ``.venv/bin/python benchmarks/vision.py [--rounds N]``; writes
``benchmarks/results/vision-<stamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from harness import REPO, RESULTS, report
from harness.llama_build import ensure_llama_server
from harness.machine import loadavg, machine_info
from harness.prompts import paragraph
from harness.servers import SLUICE, Server, free_port, llama_server_cmd, models_env
from harness.stats import med, pct, ratio

sys.path.insert(0, str(REPO))
from tests.support.projector import colour_projector, solid_png

ASK = "Name the colour of this image in one word."
STREAMS = 4


def image_uri(rgb: tuple[int, int, int]) -> str:
    return "data:image/png;base64," + base64.b64encode(solid_png(rgb)).decode()


def chat(
    content: Any, max_tokens: int, stream: bool = True, system: str | None = None
) -> dict[str, Any]:
    head = [{"role": "system", "content": system}] if system else []
    return {
        "model": "smollm2",
        "messages": [*head, {"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    }


def system_prompt(rng: random.Random) -> str:
    """~300 words of instructions and background, different for each ``rng``."""
    return "You are a careful assistant. Background: " + paragraph(rng, 300)


def image_content(rgb: tuple[int, int, int]) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": ASK},
        {"type": "image_url", "image_url": {"url": image_uri(rgb)}},
    ]


def first_token(base: str, body: dict[str, Any]) -> float:
    """Seconds from sending ``body`` to its first content token (the stream read whole)."""
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line:
                data = json.loads(line[6:])
                delta = data["choices"][0]["delta"] if data.get("choices") else {}
                if delta.get("content"):
                    first = time.perf_counter() - started
    assert first is not None, "no content token"
    return first


def token_times(base: str, body: dict[str, Any], out: list[float]) -> None:
    """Each content token's arrival time of one stream, into ``out``."""
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                out.append(time.perf_counter())


def prompt_tokens(base: str, content: Any, system: str | None = None) -> int:
    r = httpx.post(base + "/v1/chat/completions", json=chat(content, 1, False, system), timeout=120)
    r.raise_for_status()
    return int(r.json()["usage"]["prompt_tokens"])


def same_length_text(base: str, n: int, system: str) -> str:
    """A text question whose prompt is ``n`` tokens on this server (as an image request's)."""
    words = ["colour"] * 8
    for _ in range(200):
        got = prompt_tokens(base, " ".join([ASK, *words]), system)
        if got == n:
            return " ".join([ASK, *words])
        words = words[: len(words) - 1] if got > n else [*words, "colour"]
    sys.exit("could not match the image request's prompt length with text")


def gaps_beside(base: str, arrivals: list[tuple[Any, str]], seed: int) -> list[float]:
    """The gaps between tokens of four decoding streams while ``arrivals`` (chat
    contents) are sent one after another, from when the first arrives to the last's end."""
    rng = random.Random(seed)
    streams: list[list[float]] = [[] for _ in range(STREAMS)]
    long = "Write a long story about a lighthouse keeper and the sea."
    threads = [
        threading.Thread(
            target=token_times,
            args=(base, {**chat(f"{long} ({rng.random():.6f})", 200)}, streams[i]),
        )
        for i in range(STREAMS)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)  # all four decoding
    start = time.perf_counter()
    for content, system in arrivals:
        first_token(base, chat(content, 4, system=system))
    end = time.perf_counter()
    for t in threads:
        t.join()
    gaps = []
    for times in streams:
        gaps += [b - a for a, b in itertools.pairwise(times) if start <= b <= end]
    return gaps


def run(args: argparse.Namespace) -> dict[str, Any]:
    projector = colour_projector("smollm2")
    binary = ensure_llama_server()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="sluice-vision-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "models").mkdir()
        port = free_port()
        sluice = Server(
            "sluice",
            [*SLUICE, "--port", str(port), "--threads", "1", "--parallel", "8", "--ctx", "1024"]
            + ["--mmproj", str(projector), "--log-level", "warning"],
            port,
            tmp / "sluice.log",
            env=models_env(tmp / "models"),
        )
        port = free_port()
        llama = Server(
            "llama-server",
            llama_server_cmd(binary, port, 1, 8, 1024, "--mmproj", str(projector)),
            port,
            tmp / "llama-server.log",
        )
        servers = {"sluice": sluice, "llama-server": llama}
        rows: dict[str, dict[str, list[float]]] = {
            name: {"first": [], "again": [], "image_gaps": [], "text_gaps": []} for name in servers
        }
        try:
            for name, srv in servers.items():  # warm-up: first-request code paths
                first_token(srv.base, chat(image_content((1, 2, 3)), 4))
            probe = system_prompt(random.Random(999_999))  # (no round draws this seed)
            n_image = {
                n: prompt_tokens(s.base, image_content((9, 9, 9)), probe)
                for n, s in servers.items()
            }
            texts = {n: same_length_text(s.base, n_image[n], probe) for n, s in servers.items()}
            for rnd in range(args.rounds):
                order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
                colours = [tuple(rng.randrange(256) for _ in range(3)) for _ in range(5)]
                # Each arrival its own system prompt, the same on both servers: nothing cached.
                systems = [system_prompt(random.Random(1000 * rnd + k)) for k in range(9)]
                for name in order:
                    base = servers[name].base
                    body = chat(image_content(colours[0]), 8, system=systems[0])  # type: ignore[arg-type]
                    rows[name]["first"].append(first_token(base, body))
                    rows[name]["again"].append(first_token(base, body))
                    images = [
                        (image_content(c), s)  # type: ignore[arg-type]
                        for c, s in zip(colours[1:], systems[1:5])
                    ]
                    texts_in = [(texts[name], s) for s in systems[5:9]]
                    rows[name]["image_gaps"] += gaps_beside(base, images, rnd)
                    rows[name]["text_gaps"] += gaps_beside(base, texts_in, rnd)
                    print(
                        f"  round {rnd + 1} {name:12s} first {1000 * rows[name]['first'][-1]:7.1f} ms,"
                        f" again {1000 * rows[name]['again'][-1]:6.1f} ms",
                        flush=True,
                    )
        finally:
            sluice.close()
            llama.close()
    summary = {
        name: {
            "first_ms": 1000 * med(r["first"]),
            "again_ms": 1000 * med(r["again"]),
            "again_over_first": ratio(med(r["again"]), med(r["first"])),
            "gap_p95_image_ms": 1000 * pct(r["image_gaps"], 95),
            "gap_p95_text_ms": 1000 * pct(r["text_gaps"], 95),
            "image_prompt_tokens": n_image[name],
        }
        for name, r in rows.items()
    }
    return {"rows": rows, "summary": summary}


def targets(summary: dict[str, Any]) -> dict[str, bool]:
    s, ls = summary["sluice"], summary["llama-server"]
    return {
        "first token of an image request <= 1.0x llama-server's": s["first_ms"] <= ls["first_ms"],
        "the same image again <= 0.1x its first time": s["again_over_first"] <= 0.1,
        "stream gaps p95 beside images <= 1.1x beside text": (
            s["gap_p95_image_ms"] <= 1.1 * s["gap_p95_text_ms"]
        ),
    }


def markdown(doc: dict[str, Any]) -> str:
    head = [
        "server",
        "image prompt tokens",
        "first token ms",
        "again ms",
        "again / first",
        "gap p95 beside images ms",
        "beside text ms",
    ]
    body = [
        [
            name,
            str(s["image_prompt_tokens"]),
            f"{s['first_ms']:.1f}",
            f"{s['again_ms']:.1f}",
            f"{s['again_over_first']:.3f}",
            f"{s['gap_p95_image_ms']:.1f}",
            f"{s['gap_p95_text_ms']:.1f}",
        ]
        for name, s in doc["summary"].items()
    ]
    s, ls = doc["summary"]["sluice"], doc["summary"]["llama-server"]
    return (
        f"# Images on a local model, {doc['when']}\n\n"
        + report.machine_line(doc["machine"], doc["load"])
        + f". {doc['rounds']} rounds; SmolLM2-135M + the colour projector, one thread each. "
        + f"{doc['note']}\n\n"
        + report.render_table(head, body, markdown=True)
        + "\n\nsluice / llama-server, first token of an image request: "
        + f"{ratio(s['first_ms'], ls['first_ms']):.2f}x.\n\n"
        + report.targets_and_checks(doc["targets"], [], doc["reproduce"])
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    when = report.now()
    load0 = loadavg()
    result = run(args)
    doc = {
        "when": when.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load": {"start": load0, "end": loadavg()},
        "rounds": args.rounds,
        "note": args.note,
        "reproduce": "python benchmarks/vision.py " + " ".join(sys.argv[1:]),
        **result,
    }
    doc["targets"] = targets(doc["summary"])
    md = markdown(doc)
    print(md)
    path = report.save_report(args.out_dir, f"vision-{report.stamp(when)}", doc, md)
    print(f"vision: wrote {path}")


if __name__ == "__main__":
    main()
