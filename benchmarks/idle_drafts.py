#!/usr/bin/env python
"""What the drafting machinery costs a step when it finds no draft: free prose.

Prompt-lookup speculation keeps an n-gram index of every sequence's text and asks it
for a draft before each step (``sluice.engine.speculate``). On free prose sampled at
temperature 0.8 it rarely finds one, and the draft policy declines the few it finds
beside other sequences: what is left is the bookkeeping. This script measures it
apart from the decode, whose time on this shared machine varies by more than the
bookkeeping could cost.

SmolLM2-135M-Instruct through sluice's own engine and ``LlamaRunner`` (no server, no
HTTP; ``--threads`` 2), N streams of "Write a long story about ...", temperature 0.8,
a seed per stream, 128 tokens each. Two engines on one model file, one with
``max_draft`` 16 (on) and one with 0 (off), measured in alternating rounds in a
rotating order. Per step: the whole step (``Engine._step``) and the time inside
``llama_decode``; the rest is the engine's own work (planning, sampling, drafting,
delivery). Reported per level: the engine's own milliseconds a step on and off, the
drafted and accepted tokens, and the paired ratio of tok/s on / off (noisy: the
decode dominates).

Usage: ``.venv/bin/python benchmarks/idle_drafts.py [--rounds 4] [--levels 1,4,8]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import model_path

from sluice.core.events import Event, Finish
from sluice.core.request import SamplingParams
from sluice.engine.engine import Engine
from sluice.engine.llama_runner import LlamaRunner, LlamaRunnerConfig
from sluice.engine.types import EngineRequest
from sluice.engine.work import EngineConfig

TOPICS = ["a dragon", "the sea", "a lost key", "a robot", "winter", "a city", "two friends"]


class Sink:
    def __init__(self) -> None:
        self.done: Finish | None = None

    def put_many(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Finish):
                self.done = e

    def backlog(self) -> int:
        return 0

    def pause(self, resume_at: int, wake: Any) -> None:
        pass


def measure(runner: LlamaRunner, max_draft: int, streams: int, round_no: int) -> dict[str, float]:
    """One round on a fresh engine (its steps and decodes timed)."""
    engine = Engine(runner, EngineConfig(n_parallel=streams, max_draft=max_draft))
    spent = {"step": 0.0, "decode": 0.0, "steps": 0.0}
    step, decode = engine._step, runner.decode

    def timed_step() -> bool:
        t = time.perf_counter()
        ran = step()
        spent["step"] += time.perf_counter() - t
        spent["steps"] += ran
        return ran

    def timed_decode(entries: Any) -> None:
        t = time.perf_counter()
        decode(entries)
        spent["decode"] += time.perf_counter() - t

    engine._step = timed_step  # type: ignore[method-assign]
    runner.decode = timed_decode  # type: ignore[method-assign]
    engine.start()
    sinks = [Sink() for _ in range(streams)]
    start = time.perf_counter()
    try:
        for i, sink in enumerate(sinks):
            text = (
                f"<|im_start|>user\nWrite a long story about {TOPICS[i % len(TOPICS)]} "
                f"({round_no}).<|im_end|>\n<|im_start|>assistant\n"
            )
            tokens = runner.tokenize(text, add_special=False)
            sampling = SamplingParams(temperature=0.8, seed=round_no * 100 + i)
            engine.submit(
                [EngineRequest(prompt_tokens=tokens, max_tokens=128, sampling=sampling)], sink
            )
        while not all(s.done for s in sinks):
            time.sleep(0.002)
        wall = time.perf_counter() - start
    finally:
        engine.stop()
        del runner.decode  # the class's own again
    for seq in range(streams):
        runner.keep_prefix(seq, 0)
    steps = max(1.0, spent["steps"])
    made = sum(s.done.usage.completion_tokens for s in sinks if s.done and s.done.usage)
    stats = engine.stats
    return {
        "tok_s": made / wall,
        "own_ms": (spent["step"] - spent["decode"]) / steps * 1000,
        "step_ms": spent["step"] / steps * 1000,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for level in (int(x) for x in args.levels.split(",")):
        runner = LlamaRunner.load(
            LlamaRunnerConfig(
                model_path=str(model_path()), n_parallel=level, n_ctx=1024, n_threads=args.threads
            )
        )
        got: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                got[side].append(measure(runner, 16 if side == "on" else 0, level, r))
        runner.close()
        on, off = got["on"], got["off"]
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(on, off)]

        def med(rows: list[dict[str, float]], key: str) -> float:
            return statistics.median(row[key] for row in rows)

        print(
            f"{level} streams: engine's own ms/step on {med(on, 'own_ms'):.3f} "
            f"off {med(off, 'own_ms'):.3f}; step ms on {med(on, 'step_ms'):.2f} "
            f"off {med(off, 'step_ms'):.2f}; drafted {sum(x['drafted'] for x in on):.0f} "
            f"accepted {sum(x['accepted'] for x in on):.0f}; tok/s on/off paired "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
