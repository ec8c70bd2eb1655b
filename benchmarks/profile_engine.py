#!/usr/bin/env python
"""Where sluice's time goes, without HTTP: per engine step and per SSE frame.

A diagnostic companion to ``bench.py`` (it does not change ``src/``):

1. **engine step**: the real :class:`sluice.engine.engine.Engine` on the real
   :class:`LlamaRunner` (same context as ``sluice serve --parallel P``), N
   sequences, events into a plain thread-safe sink. ``runner.decode`` and
   ``runner.sample`` are timed, so each step splits into llama_decode /
   sampling / Python bookkeeping. The same N sequences then run through
   the harness's raw worker (its own process: two llama.cpp contexts driven
   from two threads of one process slow each other down ~3x through their
   OpenMP thread teams) for the anchor.
   ``--cprofile`` also profiles the engine thread with cProfile.
2. **SSE frame**: the serving path for one content token with no engine and no
   socket: ``ChatStreamFormatter.frames`` + ``sse.encode``, ``sse_stream``, and
   ``SSEResponse._produce`` against a no-op ``send``; microseconds per frame.

Usage::

    python benchmarks/profile_engine.py --n 8 --tokens 128 [--cprofile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from harness import model_path
from harness.machine import Noise
from harness.prompts import make_messages
from harness.raw import RawWorker


def engine_profile(args: argparse.Namespace) -> None:
    from sluice.core.events import Event, Finish
    from sluice.core.request import SamplingParams
    from sluice.engine.engine import Engine
    from sluice.engine.llama_runner import LlamaRunner, LlamaRunnerConfig
    from sluice.engine.runner import BatchEntry
    from sluice.engine.types import EngineRequest
    from sluice.engine.work import EngineConfig

    runner = LlamaRunner.load(
        LlamaRunnerConfig(
            model_path=str(model_path()),
            n_parallel=args.parallel,
            n_ctx=args.ctx,
            n_batch=512,
            n_threads=args.threads,
        )
    )
    timers = {"decode": 0.0, "sample": 0.0, "n_decode": 0, "n_sample": 0}
    orig_decode, orig_sample = runner.decode, runner.sample
    layouts: list[tuple[int, ...]] = []

    def decode(entries: list[BatchEntry]) -> None:
        layouts.append(tuple(e.seq for e in entries))
        t = time.perf_counter()
        try:
            return orig_decode(entries)
        finally:
            timers["decode"] += time.perf_counter() - t
            timers["n_decode"] += 1

    def sample(sampler: Any, row: int) -> int:  # LlamaRunner.sample's signature
        t = time.perf_counter()
        try:
            return orig_sample(sampler, row)
        finally:
            timers["sample"] += time.perf_counter() - t
            timers["n_sample"] += 1

    # The timed wrappers in place of the methods (mypy rejects assigning to a method).
    runner.decode = decode  # type: ignore[method-assign]
    runner.sample = sample  # type: ignore[method-assign]

    prof = cProfile.Profile() if args.cprofile else None
    step_times: list[float] = []

    class ProfiledEngine(Engine):
        def _step(self) -> bool:
            t = time.perf_counter()
            ran = super()._step()  # False: nothing ran, the engine waits for a command
            step_times.append(time.perf_counter() - t)
            return ran

        def _run(self) -> None:
            if prof is not None:
                prof.enable()
            try:
                super()._run()
            finally:
                if prof is not None:
                    prof.disable()

    class Sink:
        def __init__(self, n: int) -> None:
            self.left = n
            self.done = threading.Event()
            self.calls = 0

        def backlog(self) -> int:
            return 0  # always read at once: never paused

        def pause(self, resume_at: int, wake: Callable[[], None]) -> None:
            wake()

        def put_many(self, events: list[Event]) -> None:
            self.calls += 1
            for e in events:
                if isinstance(e, Finish):
                    self.left -= 1
                    if self.left == 0:
                        self.done.set()

    # The anchor runs in its own process: two llama.cpp contexts driven from two
    # threads of one process get two OpenMP teams that slow each other down ~3x.
    raw = RawWorker(args.threads, args.parallel, args.ctx, 512)
    from sluice.local.templates import ChatTemplate

    info = runner.info
    template = ChatTemplate(
        info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token, model_id=info.id
    )

    def render(conv: list[dict[str, str]]) -> str:
        return template.render(conv)

    engine = ProfiledEngine(runner, EngineConfig(n_parallel=args.parallel, max_queue=16))
    engine.start()
    noise = Noise([raw.pid])
    try:
        results: list[tuple[dict[str, float], dict[str, Any]]] = []
        serial = 500
        while len(results) < args.repeats and serial < 500 + 4 * args.repeats:
            serial += 1
            convs = [make_messages(serial, i) for i in range(args.n)]
            # sluice engine (no HTTP)
            prompts = [runner.tokenize(render(c), add_special=False) for c in convs]
            reqs = [
                EngineRequest(
                    prompt_tokens=p,
                    max_tokens=args.tokens,
                    sampling=SamplingParams(temperature=0.0, ignore_eos=True),
                )
                for p in prompts
            ]
            for k in timers:
                timers[k] = 0 if k.startswith("n_") else 0.0
            step_times.clear()
            layouts.clear()
            sink = Sink(args.n)
            time.sleep(0.3)
            noise.wait_quiet(0.15, 60)
            noise.start()
            t0 = time.perf_counter()
            engine.submit(reqs, sink)
            sink.done.wait()
            wall = time.perf_counter() - t0
            f_eng = noise.stop()
            eng = {
                "wall_s": wall,
                "steps": len(step_times),
                "step_ms_median": statistics.median(step_times) * 1000,
                "decode_s": timers["decode"],
                "sample_s": timers["sample"],
                "other_s": sum(step_times) - timers["decode"] - timers["sample"],
                "outside_step_s": wall - sum(step_times),
                "agg_tok_s": args.n * args.tokens / wall,
            }
            steady = layouts[len(layouts) // 2]
            time.sleep(0.3)
            r, f_raw, _ = noise.run(partial(raw.run, convs, args.tokens), 0.15, 60)
            clean = max(f_eng, f_raw) <= 0.15
            print(
                f"rep {serial - 500}: engine {eng['agg_tok_s']:.1f} tok/s, raw {r['agg_tok_s']:.1f} tok/s "
                f"(ratio {eng['agg_tok_s'] / r['agg_tok_s']:.3f}; others used {f_eng:.2f} / "
                f"{f_raw:.2f} cores{'' if clean else ': discarded'}); engine batch seqs "
                f"mid-run {list(steady)}",
                flush=True,
            )
            if clean:
                results.append((eng, r))
        if not results:
            sys.exit("profile: the machine never got quiet")
        eng_med = {k: statistics.median(e[k] for e, _ in results) for k in results[0][0]}
        raw_med = {
            k: statistics.median(r[k] for _, r in results)
            for k in ("total_s", "agg_tok_s", "llama_decode_s", "sample_s", "step_ms_median")
        }
        n_steps = eng_med["steps"]
        print(f"\nengine-only, n={args.n}, {args.tokens} tokens, median of {args.repeats}:")
        print(
            f"  sluice engine: {eng_med['agg_tok_s']:.1f} tok/s, wall {eng_med['wall_s']:.3f} s, "
            f"{n_steps:.0f} steps, step median {eng_med['step_ms_median']:.2f} ms"
        )
        print(
            f"    per step: llama_decode {eng_med['decode_s'] / n_steps * 1000:.3f} ms, "
            f"sample {eng_med['sample_s'] / n_steps * 1000:.3f} ms, "
            f"python in _step {eng_med['other_s'] / n_steps * 1e6:.0f} us, "
            f"outside _step (loop, drain, snapshot, admit) {eng_med['outside_step_s'] / n_steps * 1e6:.0f} us"
        )
        rs = args.tokens - 1
        print(
            f"  raw loop:      {raw_med['agg_tok_s']:.1f} tok/s, wall {raw_med['total_s']:.3f} s, "
            f"step median {raw_med['step_ms_median']:.2f} ms; per decode step: llama_decode "
            f"{raw_med['llama_decode_s'] / rs * 1000:.3f} ms, sample {raw_med['sample_s'] / rs * 1000:.3f} ms"
        )
        print(f"  ratio engine/raw: {eng_med['agg_tok_s'] / raw_med['agg_tok_s']:.3f}")
    finally:
        engine.stop()
        runner.close()
        raw.close()
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print("\ncProfile of the engine thread (all repeats), by tottime:")
        print(s.getvalue())


def frame_profile(n_frames: int) -> None:
    from starlette.types import Message

    from sluice.core.events import TextDelta
    from sluice.dialects.openai.format import ChatStreamFormatter, ResponseMeta
    from sluice.server.sse import SSEResponse, encode, sse_stream

    meta = ResponseMeta(
        id="chatcmpl-" + "0" * 32,
        created=int(time.time()),
        model="smollm2-135m-instruct",
        prompt_owners=frozenset({0}),
        include_usage=True,
    )
    fmt = ChatStreamFormatter(meta)
    ev = TextDelta(0, " word", 1, None)
    t = time.perf_counter()
    for _ in range(n_frames):
        for f in fmt.frames(ev):
            encode(f)
    per_fmt = (time.perf_counter() - t) / n_frames

    async def events() -> AsyncIterator[TextDelta]:
        for _ in range(n_frames):
            yield ev

    async def run_stream() -> float:
        t = time.perf_counter()
        async for _ in sse_stream(events(), ChatStreamFormatter(meta)):
            pass
        return (time.perf_counter() - t) / n_frames

    async def run_response() -> float:
        async def body() -> AsyncIterator[bytes]:
            chunk = b'data: {"x":1}\n\n'
            for _ in range(n_frames):
                yield chunk

        async def send(msg: Message) -> None:
            return None

        async def receive() -> Message:
            await asyncio.Event().wait()  # the client never disconnects
            raise AssertionError("unreachable: the event is never set")

        resp = SSEResponse(body(), on_close=lambda: None)
        t = time.perf_counter()
        await resp({"type": "http"}, receive, send)
        return (time.perf_counter() - t) / n_frames

    async def run_threadsafe() -> float:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[list[TextDelta]] = asyncio.Queue()
        done = asyncio.Event()

        def producer() -> None:
            for _ in range(n_frames):
                loop.call_soon_threadsafe(q.put_nowait, [ev])

        t = time.perf_counter()
        th = threading.Thread(target=producer)
        th.start()
        for _ in range(n_frames):
            await q.get()
        th.join()
        done.set()
        return (time.perf_counter() - t) / n_frames

    per_stream = asyncio.run(run_stream())
    per_resp = asyncio.run(run_response())
    per_ts = asyncio.run(run_threadsafe())
    print(f"\nper SSE frame (one content token), {n_frames} frames, no socket:")
    print(f"  ChatStreamFormatter.frames + encode: {per_fmt * 1e6:.1f} us")
    print(f"  sse_stream (async gen + formatter + encode): {per_stream * 1e6:.1f} us")
    print(f"  SSEResponse per chunk (whole ASGI response, no-op send): {per_resp * 1e6:.1f} us")
    print(f"  engine->loop hand-off (call_soon_threadsafe + Queue.get): {per_ts * 1e6:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--cprofile", action="store_true", help="cProfile the engine thread")
    ap.add_argument("--frames-only", action="store_true", help="only the SSE frame micro-benchmark")
    args = ap.parse_args()
    if not args.frames_only:
        engine_profile(args)
    frame_profile(20000)


if __name__ == "__main__":
    main()
