"""The anchor without a server: llama.cpp through llama-cpp-python's low-level API.

The same bindings sluice uses, no server, no HTTP, in a worker process of its own (two
llama.cpp contexts driven from two threads of one process get two OpenMP teams that slow
each other down ~3x). The context is set up exactly like ``sluice.engine.llama_runner``
does (``n_ctx = ctx * parallel``, ``n_seq_max = parallel``, ``kv_unified = False``,
``n_batch = n_ubatch = batch``, the same thread count) and each sequence gets sluice's
greedy chain (``logit_bias`` with -inf on every EOG token, as ``ignore_eos`` does, then
``greedy``) sampled with ``llama_sampler_sample``. N sequences are prefilled in one
``llama_decode`` and then decoded together, one ``llama_decode`` per step, N tokens per
step.

``RawWorker`` starts ``python -m harness.raw --threads T --parallel P --ctx C --batch B``
in ``benchmarks/`` and speaks a line protocol with it on stdin/stdout: one JSON command
in, one JSON answer out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from harness import BENCH, model_path, prog
from harness.machine import proc_cpu_seconds

_LOG_CALLBACKS: list[Any] = []  # ctypes callbacks must outlive their registration


def quiet_llama_log(L: Any) -> None:
    """llama.cpp's log off (``L`` is the ``llama_cpp`` module)."""
    cb = L.llama_log_callback(lambda level, text, user: None)
    _LOG_CALLBACKS.append(cb)
    L.llama_log_set(cb, ctypes.c_void_p(0))


def context_params(L: Any, threads: int, parallel: int, ctx: int, batch: int) -> Any:
    """The context parameters ``LlamaRunner.load`` uses: ``ctx`` tokens per sequence."""
    cparams = L.llama_context_default_params()
    cparams.n_ctx = ctx * parallel
    cparams.n_seq_max = parallel
    cparams.n_batch = batch
    cparams.n_ubatch = batch
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.kv_unified = False
    cparams.no_perf = True
    return cparams


class RawEngine:
    """One llama.cpp context with ``parallel`` sequences (the worker's): templates,
    tokenizes and generates like sluice does, with no server around it."""

    def __init__(self, path: str, threads: int, parallel: int, ctx: int, batch: int) -> None:
        import llama_cpp as L

        self.L = L
        quiet_llama_log(L)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"raw: cannot load {path}")
        cparams = context_params(L, threads, parallel, ctx, batch)
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("raw: cannot create the context")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_batch = int(L.llama_n_batch(self.ctx))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.eog = [t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t)]
        raw = L.llama_model_chat_template(self.model, None)
        self.template_src = raw.decode() if raw else None
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos_text = self._piece(L.llama_vocab_bos(self.vocab), special=True)
        self.eos_text = self._piece(L.llama_vocab_eos(self.vocab), special=True)
        self._template = None
        if self.template_src:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True
            )
            env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
                v, indent=indent, ensure_ascii=ensure_ascii
            )
            self._template = env.from_string(self.template_src)
        self.info = {
            "n_ctx": int(L.llama_n_ctx(self.ctx)),
            "n_ctx_seq": int(L.llama_n_ctx_seq(self.ctx)),
            "n_seq_max": int(L.llama_n_seq_max(self.ctx)),
            "n_batch": self.n_batch,
            "n_ubatch": int(L.llama_n_ubatch(self.ctx)),
            "n_vocab": self.n_vocab,
            "eog_tokens": self.eog,
            "system_info": L.llama_print_system_info().decode(errors="replace"),
        }

    def _piece(self, token: int, *, special: bool = False) -> str:
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = self.L.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def render(self, messages: list[dict[str, str]]) -> str:
        assert self._template is not None, "the model has no chat template"
        return self._template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_text,
            eos_token=self.eos_text,
        )

    def tokenize(self, text: str) -> list[int]:
        L = self.L
        add_bos = self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        data = text.encode()
        cap = len(data) + 8
        arr = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), arr, cap, add_bos, True)
        if n < 0:
            raise SystemExit("raw: tokenize buffer too small")
        return list(arr[:n])

    def new_chain(self) -> Any:
        """sluice's chain for temperature 0 + ignore_eos: logit_bias(EOG=-inf), greedy."""
        L = self.L
        cp = L.llama_sampler_chain_default_params()
        cp.no_perf = True
        chain = L.llama_sampler_chain_init(cp)
        arr = (L.llama_logit_bias * len(self.eog))()
        for i, t in enumerate(self.eog):
            arr[i].token = t
            arr[i].bias = float("-inf")
        L.llama_sampler_chain_add(
            chain, L.llama_sampler_init_logit_bias(self.n_vocab, len(self.eog), arr)
        )
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        return chain

    def run(self, conversations: list[list[dict[str, str]]], n_tokens: int) -> dict[str, Any]:
        """Prefill every sequence in one decode, then decode them together."""
        L = self.L
        ctx, batch = self.ctx, self.batch
        n = len(conversations)
        L.llama_memory_clear(self.mem, True)
        prompts_text = [self.render(c) for c in conversations]
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        chains = [self.new_chain() for _ in range(n)]
        prompts = [self.tokenize(p) for p in prompts_text]
        tok, pos, nsid, sid, lg = batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        # 1. prefill: all prompts, one decode (sum of lengths <= n_batch)
        i = 0
        rows: list[int] = []
        for s, prompt in enumerate(prompts):
            last = len(prompt) - 1
            for j, t in enumerate(prompt):
                tok[i] = t
                pos[i] = j
                nsid[i] = 1
                sid[i][0] = s
                lg[i] = j == last
                i += 1
            rows.append(i - 1)
        if i > self.n_batch:
            raise SystemExit(f"raw: prompts ({i} tokens) exceed n_batch {self.n_batch}")
        batch.n_tokens = i
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("raw: prefill decode failed")
        out: list[list[int]] = [
            [int(L.llama_sampler_sample(chains[s], ctx, rows[s]))] for s in range(n)
        ]
        t_first = time.perf_counter()
        # 2. decode: one token per sequence per step
        t_dec = 0.0
        t_smp = 0.0
        steps: list[float] = []
        p0 = [len(p) for p in prompts]
        for step in range(1, n_tokens):
            a = time.perf_counter()
            for s in range(n):
                tok[s] = out[s][-1]
                pos[s] = p0[s] + step - 1
                nsid[s] = 1
                sid[s][0] = s
                lg[s] = True
            batch.n_tokens = n
            b = time.perf_counter()
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("raw: decode failed")
            c = time.perf_counter()
            for s in range(n):
                out[s].append(int(L.llama_sampler_sample(chains[s], ctx, s)))
            d = time.perf_counter()
            t_dec += c - b
            t_smp += d - c
            steps.append(d - a)
        t_end = time.perf_counter()
        cpu = time.process_time() - cpu0
        for chain in chains:
            L.llama_sampler_free(chain)
        total = t_end - t0
        decode = t_end - t_first
        texts = ["".join(self._piece(t) for t in seq) for seq in out]
        return {
            "n": n,
            "tokens_per_seq": n_tokens,
            "prompt_tokens": [len(p) for p in prompts],
            "ttft_s": t_first - t0,
            "total_s": total,
            "decode_s": decode,
            "agg_tok_s": n * n_tokens / total,
            "decode_tok_s": n * (n_tokens - 1) / decode if n_tokens > 1 else float("nan"),
            "step_ms_median": statistics.median(steps) * 1000 if steps else float("nan"),
            "llama_decode_s": t_dec,
            "sample_s": t_smp,
            "cpu_s": cpu,
            "texts": texts,
        }


def worker_main(argv: list[str] | None = None) -> None:
    """The worker process: line protocol on stdin/stdout."""
    ap = argparse.ArgumentParser(description="the raw worker (started by RawWorker)")
    for flag in ("--threads", "--parallel", "--ctx", "--batch"):
        ap.add_argument(flag, type=int, required=True)
    args = ap.parse_args(argv)
    eng = RawEngine(str(model_path()), args.threads, args.parallel, args.ctx, args.batch)
    print(json.dumps({"ready": True, "info": eng.info}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "tokens":
            counts = [len(eng.tokenize(eng.render(c))) for c in cmd["conversations"]]
            print(json.dumps({"counts": counts}), flush=True)
        elif cmd["cmd"] == "run":
            print(json.dumps(eng.run(cmd["conversations"], cmd["tokens"])), flush=True)


class RawWorker:
    """The worker process, ready once it answered; ``run`` measures one batch of
    sequences (and the worker's CPU time during it)."""

    def __init__(self, threads: int, parallel: int, ctx: int, batch: int) -> None:
        flags = ["--threads", str(threads), "--parallel", str(parallel)]
        flags += ["--ctx", str(ctx), "--batch", str(batch)]
        self.cmd = ["python -m harness.raw", *flags]  # as the reports show it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.raw", *flags],
            cwd=BENCH,  # where -m finds the harness
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        hello = self._read()
        self.info = hello["info"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{prog()}: the raw worker died (rc {self.proc.poll()})")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, conversations: list[list[dict[str, str]]], tokens: int) -> dict[str, Any]:
        cpu0 = proc_cpu_seconds(self.pid)
        res = self.call(cmd="run", conversations=conversations, tokens=tokens)
        res["proc_cpu_s"] = proc_cpu_seconds(self.pid) - cpu0
        return res

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


if __name__ == "__main__":
    worker_main()
