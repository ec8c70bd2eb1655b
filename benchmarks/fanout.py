#!/usr/bin/env python
"""Gateway fan-out: many streams at once through a gateway, against the upstream direct.

The shape of the published gateway benchmarks: an upstream that streams 64 OpenAI chat
deltas 20 ms apart (then the finish chunk with usage, and ``[DONE]``), every stream of
a level started at once, one raw HTTP/1.1 connection per stream.

* **upstream**: this script's own stdlib-asyncio server (``--serve-upstream``), chunked
  SSE as vLLM and llama-server send it; the frames of a stream are due at fixed times
  from its request (``call_at``), so a late frame does not push the next ones.
* **load**: this script too (``--load``), stdlib asyncio, one connection per stream,
  all connections opened before the clock, then every request written at once.
* **paths**: ``direct`` (the load at the upstream), ``sluice`` (``sluice serve`` with
  the upstream as an ``[[upstreams]]`` slot, API key on, strict model names) and
  ``litellm`` (LiteLLM's proxy, pinned in ``harness/litellm.py``, one uvicorn worker on
  uvloop + httptools, no database, logs off, the same key).
* **warm**: the load's connections are opened before the clock, and so are a
  gateway's to the upstream: each gateway's measured run of a level follows an
  unmeasured run of the same level (``--cold``: not), as a gateway that holds that
  many streams has its connections. A burst of new ones costs the upstream its
  accepts inside the clock (measured: ~50-100 ms more to the heads of 256 new
  connections at 512 streams), which the direct path never pays.
* **cores**: the gateway pinned to core 0, the upstream and the load to core 1
  (``sched_setaffinity``); direct leaves core 0 idle. Each gateway is measured alone
  on its core: the other is stopped (SIGSTOP) once it has gone quiet, and continued
  for its own turn.

Per level and path: frames a second (all frames received / wall time from the first
request to the last stream's end) and its share of the ideal (each stream's frames in
its scheduled 1.26 s); time to first frame (request written -> first ``data:`` event)
p50 / p99, and added over direct (gateway percentile minus direct's, same round);
stalled streams (a gap over ``--stall`` s between two frames, or not finished within
``--deadline`` s). Rounds alternate the order of the paths. The gateway's CPU seconds
per 1000 frames tell what each frame costs it.

Usage: ``.venv/bin/python benchmarks/fanout.py [--quick] [--rounds N] [--levels ...]
[--paths direct,sluice,litellm]``; writes ``benchmarks/results/fanout-<stamp>.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import RESULTS, report
from harness.litellm import LITELLM_ENV, LITELLM_PACKAGES, LITELLM_VERSION, ensure_litellm
from harness.machine import loadavg, machine_info, proc_cpu_seconds
from harness.servers import SLUICE, Server, free_port, models_env
from harness.stats import med, pct, ratio, rotated

DELTAS = 64  # content deltas a stream
INTERVAL = 0.020  # seconds between deltas
FRAMES = DELTAS + 2  # + the finish chunk (with usage) + [DONE]
IDEAL_S = (DELTAS - 1) * INTERVAL  # a stream's scheduled length, first frame to last
LEVELS = (1, 128, 256, 512, 1024)
PATHS = ("direct", "sluice", "litellm")
MODEL = "fan-model"
GATEWAY_CORE, LOAD_CORE = 0, 1
TARGETS = {
    "x_direct_at_512": 0.9,  # sluice frames/s over direct's at 512 streams
    "added_ttff_p50_ms_at_1": 2.0,
    "added_ttff_p99_ms_at_512": 20.0,
}

GW_TOML = """\
[[upstreams]]
name = "fan"
url = "http://127.0.0.1:{up}"
models = ["{model}"]
"""
LITELLM_YAML = """\
model_list:
  - model_name: {model}
    litellm_params: {{model: openai/{model}, api_base: "http://127.0.0.1:{up}/v1", api_key: none}}
litellm_settings: {{set_verbose: false, turn_off_message_logging: true}}
general_settings: {{disable_spend_logs: true, disable_error_logs: true}}
"""


# --- the upstream ------------------------------------------------------------------------


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of the chunked transfer coding."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _frames(n: int) -> list[bytes]:
    """A stream's SSE events, each already chunked: the deltas, the finish, [DONE]."""
    head = f'{{"id":"chatcmpl-fan{n}","object":"chat.completion.chunk","created":1700000000,'
    head += f'"model":"{MODEL}","system_fingerprint":"fan","choices":[{{"index":0,'
    out = []
    for i in range(DELTAS):
        delta = '"role":"assistant","content":""' if i == 0 else f'"content":" word{i}"'
        out.append(f'data: {head}"delta":{{{delta}}},"logprobs":null,"finish_reason":null}}]}}\n\n')
    usage = (
        f'"usage":{{"prompt_tokens":12,"completion_tokens":{DELTAS},"total_tokens":{DELTAS + 12}}}'
    )
    out.append(
        f'data: {head}"delta":{{}},"logprobs":null,"finish_reason":"length"}}],{usage}}}\n\n'
    )
    out.append("data: [DONE]\n\n")
    return [_chunk(f.encode()) for f in out]


class _Upstream(asyncio.Protocol):
    """One client connection: requests in turn (keep-alive), each answered on schedule."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.handles: list[asyncio.Handle] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for h in self.handles:
            h.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            self.answer(head.split(" ", 2)[:2])

    def answer(self, request_line: list[str]) -> None:
        assert self.transport is not None
        method, path = request_line
        if method == "GET" and path.endswith("/models"):
            body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body.encode())
            )
            return
        if method == "GET":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            return
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        frames = _frames(id(self) % 100000)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.handles = [loop.call_soon(self.send, frames[0])]
        for i in range(1, DELTAS - 1):
            self.handles.append(loop.call_at(t0 + i * INTERVAL, self.send, frames[i]))
        last = frames[DELTAS - 1] + frames[DELTAS] + frames[DELTAS + 1] + b"0\r\n\r\n"
        self.handles.append(loop.call_at(t0 + (DELTAS - 1) * INTERVAL, self.send, last))

    def send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


async def serve_upstream(port: int, deltas: int) -> None:
    global DELTAS
    DELTAS = deltas  # (a shorter stream: to profile what a request costs)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Upstream, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# --- the load ----------------------------------------------------------------------------


class _Stream(asyncio.Protocol):
    """One stream's connection: writes its request when told, counts the frames back."""

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.t_send = self.t_first = self.t_last = 0.0
        self.frames = 0
        self.max_gap = 0.0
        self.status = b""
        self.tail = b""
        self.finished = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.status:
            self.status = data[9:12]
        # "data: " at a line start, counted across reads (chunk-size lines are hex).
        text = self.tail + data
        n = text.count(b"\ndata: ") + (text.startswith(b"data: ") and not self.tail)
        self.tail = text[-8:]
        if n:
            if self.frames == 0:
                self.t_first = now
            elif now - self.t_last > self.max_gap:
                self.max_gap = now - self.t_last
            self.t_last = now
            self.frames += n
        if b"data: [DONE]" in text:
            self.finished = True
            if self.transport is not None:
                self.transport.close()


async def run_load(port: int, streams: int, key: str, deadline: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say many words."}],
            "stream": True,
            "max_tokens": DELTAS,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
        f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    protos: list[_Stream] = []
    for _ in range(streams):  # connections first, outside the clock
        proto = _Stream(loop.create_future())
        await loop.create_connection(lambda p=proto: p, "127.0.0.1", port)  # type: ignore[misc]
        protos.append(proto)
    await asyncio.sleep(0.2)  # the gateway has accepted them all
    t0 = time.perf_counter()
    for proto in protos:
        proto.t_send = time.perf_counter()
        assert proto.transport is not None
        proto.transport.write(request)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.done for p in protos)), deadline)
    except TimeoutError:
        pass
    for proto in protos:
        if proto.transport is not None:
            proto.transport.abort()
    return {
        "t0": t0,
        "streams": [
            {
                "ttff": p.t_first - p.t_send if p.frames else None,
                "end": p.t_last - t0 if p.frames else None,
                "frames": p.frames,
                "max_gap": p.max_gap,
                "finished": p.finished,
                "status": p.status.decode("latin-1"),
            }
            for p in protos
        ],
    }


def load_main(args: argparse.Namespace) -> None:
    result = asyncio.run(run_load(args.port, args.streams, args.key, args.deadline))
    json.dump(result, sys.stdout)


# --- the measurement ---------------------------------------------------------------------


def pinned(core: int) -> list[str]:
    """The command prefix that runs a child on ``core`` alone."""
    return ["taskset", "-c", str(core)]


def start_servers(
    tmp: Path, key: str, paths: tuple[str, ...], deltas: int = DELTAS
) -> tuple[subprocess.Popen[bytes], int, dict[str, Server]]:
    up = free_port()
    with open(tmp / "upstream.log", "wb") as log:  # the child writes to its own copy
        upstream = subprocess.Popen(
            [*pinned(LOAD_CORE), sys.executable, __file__, "--serve-upstream", str(up)]
            + ["--deltas", str(deltas)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    (tmp / "models").mkdir()
    env = models_env(tmp / "models")
    (tmp / "gw.toml").write_text(GW_TOML.format(up=up, model=MODEL))
    (tmp / "litellm.yaml").write_text(LITELLM_YAML.format(up=up, model=MODEL))
    servers: dict[str, Server] = {}
    taskset = pinned(GATEWAY_CORE)
    try:
        if "sluice" in paths:
            port = free_port()
            cmd = [*taskset, *SLUICE, "--threads", "1", "--log-level", "warning"]
            cmd += ["--config", str(tmp / "gw.toml"), "--strict-model-names", "--api-key", key]
            servers["sluice"] = Server(
                "sluice", [*cmd, "--port", str(port)], port, tmp / "sluice.log", env=env
            )
        if "litellm" in paths:
            port = free_port()
            cmd = [*taskset, str(ensure_litellm()), "--config", str(tmp / "litellm.yaml")]
            cmd += ["--host", "127.0.0.1", "--num_workers", "1", "--port", str(port)]
            servers["litellm"] = Server(
                "litellm",
                cmd,
                port,
                tmp / "litellm.log",
                health="/health/liveliness",
                cwd=tmp,
                env={**env, **LITELLM_ENV, "LITELLM_MASTER_KEY": key},
            )
    except BaseException:
        upstream.kill()
        for srv in servers.values():
            srv.close()
        raise
    return upstream, up, servers


def load(port: int, streams: int, key: str, deadline: float) -> dict[str, Any]:
    out = subprocess.run(
        [*pinned(LOAD_CORE), sys.executable, __file__, "--load", "--port", str(port)]
        + ["--streams", str(streams), "--key", key, "--deadline", str(deadline)],
        capture_output=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def measure(
    port: int, streams: int, key: str, args: argparse.Namespace, pid: int | None
) -> dict[str, Any]:
    cpu0 = proc_cpu_seconds(pid) if pid else 0.0
    got = load(port, streams, key, args.deadline)
    cpu = proc_cpu_seconds(pid) - cpu0 if pid else None
    ss = got["streams"]
    frames = sum(s["frames"] for s in ss)
    ends = [s["end"] for s in ss if s["end"] is not None]
    wall = max(ends) if ends else float("nan")
    ttff = [s["ttff"] for s in ss if s["ttff"] is not None]
    stalled = sum(1 for s in ss if not s["finished"] or s["max_gap"] > args.stall)
    return {
        "frames": frames,
        "complete_frames": streams * FRAMES,
        "wall_s": wall,
        "frames_s": frames / wall,
        "ideal_share": (frames / wall) / (streams * FRAMES / IDEAL_S),
        "ttff_ms": [1000 * t for t in ttff],
        "stalled": stalled,
        "unfinished": sum(1 for s in ss if not s["finished"]),
        "max_gap_s": max((s["max_gap"] for s in ss), default=0.0),
        "statuses": sorted({s["status"] for s in ss}),
        "gateway_cpu_s": cpu,
        "cpu_ms_per_1k_frames": None if cpu is None or not frames else 1e6 * cpu / frames,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    key = "sk-fan-" + secrets.token_hex(8)
    paths = tuple(p for p in args.paths.split(",") if p)
    with tempfile.TemporaryDirectory(prefix="sluice-fanout-") as tmp_name:
        upstream, up, servers = start_servers(Path(tmp_name), key, paths)
        # The gateway's own pid (taskset execs it: the same process).
        pids = {p: s.pid for p, s in servers.items()}
        try:
            ports = {"direct": up, **{p: s.port for p, s in servers.items()}}
            for p in paths:  # warm-up: first-request code paths, connection pools
                measure(ports[p], 8, key, args, None)
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {
                str(n): {p: [] for p in paths} for n in args.levels
            }
            for rnd in range(args.rounds):
                for n in args.levels:
                    for p in rotated(paths, rnd + n):
                        time.sleep(0.5)  # the last level's connections closed everywhere
                        alone(p, pids)
                        if not args.cold and p != "direct":
                            measure(ports[p], n, key, args, None)  # its upstream connections
                            if p in pids:
                                quiet(pids[p])
                        m = measure(ports[p], n, key, args, pids.get(p))
                        m["round"] = rnd + 1
                        runs[str(n)][p].append(m)
                        print(
                            f"  round {rnd + 1} streams={n:5d} {p:8s} {m['frames_s']:8.0f} "
                            f"frames/s ({100 * m['ideal_share']:5.1f}%) first frame p50 "
                            f"{med(m['ttff_ms']):8.1f} ms p99 {pct(m['ttff_ms'], 99):8.1f} ms, "
                            f"{m['stalled']} stalled"
                            + (
                                f", {m['cpu_ms_per_1k_frames']:.0f} CPU ms/1k frames"
                                if m["gateway_cpu_s"] is not None
                                else ""
                            ),
                            flush=True,
                        )
        finally:
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
            upstream.kill()
            upstream.wait()
            for srv in servers.values():
                srv.close()
    return runs


def alone(path: str, pids: dict[str, int]) -> None:
    """Leave the gateway of ``path`` alone on its core: every other gateway is stopped
    (SIGSTOP) once it has gone quiet, and continued (SIGCONT) when its turn comes.
    Both gateways share core 0; a proxy still working off a level's stalled streams,
    or ticking its background tasks, would otherwise be measured as the other's cost."""
    for p, pid in pids.items():
        if p == path:
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)  # its timers and pending work caught up first
            continue
        quiet(pid)
        os.kill(pid, signal.SIGSTOP)


def quiet(pid: int) -> None:
    """Wait (30 s at most) until process ``pid`` has finished its work: under 10% of a
    core over 0.2 s."""
    quiet_until = time.monotonic() + 30.0
    while time.monotonic() < quiet_until:
        cpu = proc_cpu_seconds(pid)
        time.sleep(0.2)
        if proc_cpu_seconds(pid) - cpu < 0.02:
            break


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, by_path in runs.items():
        out[n] = {}
        direct = by_path.get("direct", [])
        for p, ms in by_path.items():
            s: dict[str, Any] = {
                "frames_s": med([m["frames_s"] for m in ms]),
                "frames_s_range": [min(m["frames_s"] for m in ms), max(m["frames_s"] for m in ms)],
                "ideal_share": med([m["ideal_share"] for m in ms]),
                "ttff_p50_ms": med([med(m["ttff_ms"]) for m in ms]),
                "ttff_p99_ms": med([pct(m["ttff_ms"], 99) for m in ms]),
                "stalled": max(m["stalled"] for m in ms),
                "cpu_ms_per_1k_frames": med(
                    [m["cpu_ms_per_1k_frames"] for m in ms if m["cpu_ms_per_1k_frames"] is not None]
                )
                if p != "direct"
                else None,
            }
            if p != "direct" and direct:
                pairs = list(zip(ms, direct))
                s["x_direct"] = med([ratio(a["frames_s"], b["frames_s"]) for a, b in pairs])
                s["added_ttff_p50_ms"] = med(
                    [med(a["ttff_ms"]) - med(b["ttff_ms"]) for a, b in pairs]
                )
                s["added_ttff_p99_ms"] = med(
                    [pct(a["ttff_ms"], 99) - pct(b["ttff_ms"], 99) for a, b in pairs]
                )
            out[n][p] = s
    return out


def targets(summary: dict[str, Any]) -> dict[str, bool]:
    met: dict[str, bool] = {}
    s = summary
    if "512" in s and "sluice" in s["512"]:
        met["sluice >= 0.9x direct at 512 streams"] = (
            s["512"]["sluice"]["x_direct"] >= TARGETS["x_direct_at_512"]
        )
        met["added first frame p99 <= 20 ms at 512"] = (
            s["512"]["sluice"]["added_ttff_p99_ms"] <= TARGETS["added_ttff_p99_ms_at_512"]
        )
    if "1" in s and "sluice" in s["1"]:
        met["added first frame p50 <= 2 ms at 1"] = (
            s["1"]["sluice"]["added_ttff_p50_ms"] <= TARGETS["added_ttff_p50_ms_at_1"]
        )
    if any("sluice" in by for by in s.values()):
        met["no stalled streams through sluice"] = all(
            by["sluice"]["stalled"] == 0 for by in s.values() if "sluice" in by
        )
    if any("litellm" in by and "sluice" in by for by in s.values()):
        met["ahead of LiteLLM at every level"] = all(
            by["sluice"]["frames_s"] > by["litellm"]["frames_s"]
            for by in s.values()
            if "litellm" in by
        )
    return met


def markdown(doc: dict[str, Any]) -> str:
    summary = doc["summary"]
    head = [
        "streams",
        "path",
        "frames/s",
        "share of ideal",
        "x direct",
        "first frame p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
        "stalled",
        "gateway CPU ms/1k frames",
    ]
    rows = []
    for n, by_path in summary.items():
        for p, s in by_path.items():
            rows.append(
                [
                    n,
                    p,
                    f"{s['frames_s']:.0f} ({s['frames_s_range'][0]:.0f}-{s['frames_s_range'][1]:.0f})",
                    f"{100 * s['ideal_share']:.0f}%",
                    f"{s['x_direct']:.2f}" if "x_direct" in s else "",
                    f"{s['ttff_p50_ms']:.1f}",
                    f"{s['ttff_p99_ms']:.1f}",
                    f"{s['added_ttff_p50_ms']:+.1f}" if "added_ttff_p50_ms" in s else "",
                    f"{s['added_ttff_p99_ms']:+.1f}" if "added_ttff_p99_ms" in s else "",
                    str(s["stalled"]),
                    "" if s["cpu_ms_per_1k_frames"] is None else f"{s['cpu_ms_per_1k_frames']:.0f}",
                ]
            )
    mach = doc["machine"]
    return (
        f"# Gateway fan-out, {doc['date']}\n\n"
        f"{report.machine_line(mach, doc['load_average'])}. {doc['rounds']} rounds; an upstream "
        f"streaming {DELTAS} deltas {INTERVAL * 1000:.0f} ms apart; gateway on core {GATEWAY_CORE}, "
        f"upstream and load on core {LOAD_CORE}; LiteLLM {LITELLM_VERSION}. "
        + (
            "Cold: a gateway's upstream connections opened inside the clock. "
            if doc.get("cold")
            else "Each gateway's level after an unmeasured run of the same level (its upstream "
            "connections opened outside the clock, as the load's are). "
        )
        + "Medians over rounds "
        f"(frames/s: range). {doc['note']}\n\n"
        + report.render_table(head, rows, markdown=True)
        + "\n\n"
        + report.targets_and_checks(doc["targets"], [], doc["reproduce"])
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deltas", type=int, default=DELTAS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--key", default="", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="1 round, levels 1, 128, 512")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 2, --quick 1)")
    ap.add_argument("--levels", default=None, help="comma-separated stream counts")
    ap.add_argument("--paths", default=",".join(PATHS), help="direct and which gateways")
    ap.add_argument(
        "--stall", type=float, default=1.0, help="a gap between frames that counts as a stall, s"
    )
    ap.add_argument("--deadline", type=float, default=120.0, help="a run's time limit, s")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="no unmeasured run of each level before a gateway's measured one: its upstream "
        "connections are opened inside the clock",
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", default="", help="a note stored with the results")
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 4 sockets a stream
    if args.serve_upstream:
        asyncio.run(serve_upstream(args.serve_upstream, args.deltas))
        return
    if args.load:
        load_main(args)
        return
    args.rounds = args.rounds or (1 if args.quick else 2)
    levels = args.levels or ("1,128,512" if args.quick else ",".join(map(str, LEVELS)))
    args.levels = [int(x) for x in levels.split(",")]
    if "litellm" in args.paths:
        ensure_litellm()
    when = report.now()
    load0 = loadavg()
    runs = run(args)
    summary = summarize(runs)
    doc = {
        "date": when.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load_average": {"start": load0, "end": loadavg()},
        "rounds": args.rounds,
        "levels": args.levels,
        "litellm": LITELLM_PACKAGES,
        "note": args.note,
        "cold": args.cold,
        "runs": runs,
        "summary": summary,
        "targets": targets(summary),
        "reproduce": "python benchmarks/fanout.py " + " ".join(sys.argv[1:]),
    }
    md = markdown(doc)
    stem = f"fanout-{report.stamp(when)}"
    report.save_report(args.out_dir, stem, doc, md)
    print(md)
    print(f"fanout: wrote {args.out_dir / stem}.md")


if __name__ == "__main__":
    main()
