#!/usr/bin/env python
"""What an extra row of a sequence costs in one ``llama_decode``: the constants of
sluice's draft policy (``sluice.engine.speculate``: ``ROW_FIXED``, ``ROW_COST``,
``GRAPH_FIXED``).

SmolLM2-135M-Instruct through sluice's own ``LlamaRunner`` (``--threads`` 2), 8
sequences each holding a ~400-token prompt. For B = 1, 4 and 8 generating sequences,
the median time of a decode of one token each (the step), then of the same step with
k more rows on one sequence, and on every sequence, logits on the extra rows (as a
draft's verification has them), k = 1, 2, 4, 8, 16. Each decode's rows are dropped
again after it (``keep_prefix``), so every step sees the same cache. Printed as
ratios to the plain step: "one +k 1.56" means one sequence with k more rows made the
step 1.56 times as long.

Usage: ``.venv/bin/python benchmarks/draft_rows.py [--reps 15]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import model_path

from sluice.engine.llama_runner import LlamaRunner, LlamaRunnerConfig
from sluice.engine.runner import BatchEntry


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runner = LlamaRunner.load(
        LlamaRunnerConfig(
            model_path=str(model_path()), n_parallel=8, n_ctx=2048, n_threads=args.threads
        )
    )
    prompt = runner.tokenize("The quick brown fox jumps over the lazy dog. " * 40, add_special=True)
    for seq in range(8):
        runner.decode([BatchEntry(seq, prompt, 0, True)])
    base = len(prompt)

    def step(extra: list[int]) -> float:
        times = []
        for _ in range(args.reps):
            entries = [
                BatchEntry(s, [100] * (1 + k), base, True, n_logits=1 + k)
                for s, k in enumerate(extra)
            ]
            t = time.perf_counter()
            runner.decode(entries)
            times.append(time.perf_counter() - t)
            for s in range(len(extra)):
                runner.keep_prefix(s, base)
        return statistics.median(times)

    for b in (1, 4, 8):
        plain = step([0] * b)
        cells = [f"B={b}: step {plain * 1000:.1f} ms"]
        for k in (1, 2, 4, 8, 16):
            one = step([k] + [0] * (b - 1))
            every = step([k] * b)
            cells.append(f"+{k}: one {one / plain:.2f} every {every / plain:.2f}")
        print(" | ".join(cells), flush=True)
    runner.close()


if __name__ == "__main__":
    main()
