#!/usr/bin/env python
"""Grammar-constrained decoding speed: sluice against llama.cpp's own ``llama-server``.

Both serve the packaged SmolLM2-135M-Instruct Q4_1 (``--model gemma3-270m``: Gemma 3
270M, a 262k vocabulary, with Gemma 2's vendored chat template on both sides) with
``--threads T`` (default 2) each, 4 slots of 4,096 tokens of context, side by side for
the whole run (the one not measured idles):

* sluice: ``python -m sluice serve --threads T --parallel 4 --ctx 4096`` (an empty
  models folder), its ``POST /v1/chat/completions``: a ``response_format`` JSON schema
  or the tools of a request become a grammar that constrains sampling;
* llama-server (``harness/llama_build.py``: built from the llama.cpp that the pinned
  llama-cpp-python vendors, cached): ``-t T -np 4 -c 16384 --jinja`` (``--jinja`` so
  that it takes ``tools``), its OpenAI-compatible ``POST /v1/chat/completions``; its own
  JSON-schema-to-grammar converter. Its tool-call grammar never engages on this model:
  its chat parser derives the tool-call format from the chat template and finds none in
  SmolLM2's, nor (tried) with the vendored Qwen 2.5, Qwen 3 or Hermes 2 Pro templates
  given by ``--chat-template-file``: it drops ``tools`` and ``tool_choice`` and answers
  in plain text. So for the ``tool`` workload llama-server gets the same call as a
  ``response_format`` schema (``{"name": "get_weather", "arguments": {...}}``, the
  constraint its tool grammar would apply to the call's JSON), and its answer's JSON
  is read as the call (``--llama-tools`` sends the tools as they are instead).
  ``--template F`` gives both servers a chat template of the vendored llama.cpp's
  ``models/templates`` (llama-server's ``--chat-template-file``, sluice's
  ``--chat-template``); by default each uses its model's own.

Workloads (``--workloads``), each a streaming chat request with ``max_tokens`` =
``--tokens`` (128), ``stream_options.include_usage``, a ``seed`` per request (the same
on both sides), no ``ignore_eos`` and no sampling fields: both sides sample with
llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), on purpose,
since that is what a client that sets nothing gets. Every request of a round has a
user prompt of its own, the same on both sides:

* ``free``: "Write a long story about ...", no constraint: the ceiling;
* ``json``: ``response_format: {"type": "json_schema", ...}`` with a schema that forces
  a long answer: ``{"people": [...]}``, at least 20 items of ``name`` (string, at most
  24 characters), ``age`` (integer), ``city`` (string, at most 24), nothing else
  anywhere; "List twenty people as JSON ...";
* ``tool``: one function, ``get_weather(city: string, unit: celsius|fahrenheit)``,
  ``tool_choice: "required"``; "What's the weather in <city>?" (a short answer: a few
  dozen tokens, counted from the usage).

The same schema and tools go with every request of a workload (as an application
sends them), so a server may keep a grammar it built once.

Levels (``--levels``, default 1,4): N concurrent streams (connections opened before the
clock, ``harness.client.run_streams``). Per measurement: completion tokens per stream
(the usage), agg tok/s = completion tokens / wall time (first request sent -> last
``[DONE]``), decode tok/s = per stream (tokens - 1) / (last ``[DONE]`` - first output)
summed over the streams, TTFT (request sent -> the first frame with content or a tool
call, client side), finish reasons, HTTP statuses. For ``tool`` the first output is the
first ``tool_calls`` frame, which a server sends once it has parsed the call's name: the
tokens before it count in decode tok/s but not its time, differently on each side
(agg tok/s has no such bias).

Method: after a warm-up of each workload on both sides, in every round, level and
workload the two servers take turns, the order rotated (``harness.stats.rotated``),
each measurement after waiting (up to ``--quiet-timeout`` s) until other processes use
less than ``--quiet`` cores over one second (``harness.machine.Noise``, which also
records what they used during it). Per round the paired ratios: sluice / llama-server
of agg and decode tok/s, and sluice's constrained / sluice's free decode tok/s at the
same level in the same round (the "ceiling" ratio, for json and tool). The report gives
medians over rounds and the median [range] of the paired ratios.

Targets: json and tool decode sluice / llama-server >= 1.30 at every level (paired);
sluice json and tool decode >= 0.90x sluice free decode at every level (paired); free
decode sluice / llama-server >= 1.05 at every level (paired).

``--ttft-schema`` (on; ``--no-ttft-schema`` skips it): time to first token for a large
schema, 1 stream, ``max_tokens`` 8, 3 requests in a row per side per round: (a) an object
whose one property is a string enum of 5,000 values, (b) an object of 100 required
properties (strings, integers, booleans). One value or property name of each request's
schema carries a serial, so no grammar cache holds it: the cost of a new schema. The
report gives each side's median TTFT, the paired ratio sluice / llama-server (lower is
better) and the HTTP statuses (a server may refuse a schema with 400: recorded, not
fatal).

The two sides' JSON answers need not spend their tokens alike: a grammar that allows
whitespace around keys and values (llama.cpp's) lets the model indent, one that does not
packs more items into ``--tokens``; tok/s counts tokens either way.

Checks: statuses and finish reasons per side; ``json``: every answer that stopped on
its own parses and matches the schema (``jsonschema`` if installed, else by hand);
answers cut by ``max_tokens`` are counted apart, their complete items checked;
``tool``: every answer carries a ``get_weather`` call whose arguments parse as JSON
with a string ``city`` (a cut one: the name); measurements disturbed by other processes.

Usage: ``.venv/bin/python benchmarks/constrained.py [--rounds 3] [--levels 1,4]``;
writes ``benchmarks/results/constrained-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

from harness import RESULTS
from harness.client import CHAT, Stream, body_of, http_post, parse_sse, run_streams
from harness.llama_build import build_info, ensure_llama_server, vendored_file
from harness.machine import Noise, loadavg, machine_info, proc_cpu_seconds
from harness.prompts import ADJS, PEOPLE, PLACES, THINGS
from harness.report import (
    machine_line,
    now,
    print_outcome,
    render_table,
    save_report,
    stamp,
    targets_and_checks,
)
from harness.servers import SLUICE, LlamaServer, Server, free_port, llama_server_cmd, models_env
from harness.stats import med, rotated

try:
    import jsonschema
except ImportError:  # checked by hand then
    jsonschema = None

SIDES = ("sluice", "llama-server")
WORKLOADS = ("free", "json", "tool")
PARALLEL = 4
CTX = 4096  # per slot
# The first output: a content frame with text, or a tool call (both sides' SSE).
FIRST = re.compile(rb'"content":"[^"]|"tool_calls":\[')
TARGET_VS_LLAMA = 1.30  # json and tool decode, sluice / llama-server
TARGET_CEILING = 0.90  # sluice's json and tool decode / its free decode
TARGET_FREE = 1.05  # free decode, sluice / llama-server
TTFT_REPS = 3
TTFT_TOKENS = 8
ENUM_VALUES = 5000
WIDE_PROPERTIES = 100

NAME_LEN = 24
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": NAME_LEN},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": NAME_LEN},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 20, "items": ITEM}},
    "required": ["people"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. Lisbon"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
# fmt: off
CITIES = [
    "Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Hanoi", "Quito", "Tunis", "Perth",
    "Dublin", "Krakow", "Seville", "Bergen", "Porto", "Leeds", "Turin", "Ghent", "Riga",
    "Tallinn", "Vilnius", "Cork", "Graz", "Basel", "Lyon", "Bilbao", "Malmo", "Aarhus",
    "Tampere", "Split", "Varna", "Izmir", "Cusco", "Recife", "Denver", "Austin", "Halifax",
    "Hobart", "Dunedin", "Cebu", "Penang", "Kyoto", "Busan", "Pune", "Agra", "Fez", "Accra",
]
# fmt: on


# -- prompts and requests ---------------------------------------------------------------


class Prompts:
    """User prompts of a workload, deterministic, never repeated in a run (``tool`` goes
    round the list of cities)."""

    def __init__(self, seed: str = "sluice-constrained") -> None:
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.city = 0

    def take(self, workload: str) -> str:
        if workload == "tool":
            self.city += 1
            return f"What's the weather in {CITIES[(self.city - 1) % len(CITIES)]}?"
        for attempt in range(1000):
            rng = self.rng
            person, place = rng.choice(PEOPLE), rng.choice(PLACES)
            if workload == "free":
                text = (
                    f"Write a long story about {person}, {rng.choice(THINGS)} and "
                    f"{place} on a {rng.choice(ADJS)} day, in many paragraphs."
                )
            else:
                text = (
                    f"List twenty people as JSON, each with a name, an age and a city: "
                    f"the people who met {person} at {place}."
                )
            if attempt > 100:
                text += f" ({attempt})"
            if text not in self.seen:
                self.seen.add(text)
                return text
        raise SystemExit("constrained: out of prompts")


def call_schema() -> dict[str, Any]:
    """The ``get_weather`` call as a JSON schema: what a tool-call grammar constrains."""
    fn = TOOLS[0]["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def for_side(body: dict[str, Any], side: str, llama_tools: bool) -> dict[str, Any]:
    """``body`` as sent to ``side``: llama-server gets a tool call as a schema."""
    if side != "llama-server" or llama_tools or "tools" not in body:
        return body
    out = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
    out["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "call", "schema": call_schema()},
    }
    return out


def calls_in_text(text: str) -> list[dict[str, str]]:
    """A call answered as ``{"name": ..., "arguments": {...}}`` text (``for_side``)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    if not isinstance(doc, dict) or "name" not in doc:
        return []
    return [{"name": str(doc["name"]), "arguments": json.dumps(doc.get("arguments"))}]


# The model both serve (--model): sluice's name for it, the GGUF, the report's words,
# and the chat template to give both when its GGUF has none (Gemma 3 270M is a base
# model: Gemma 2's template has the same turns, over tokens Gemma 3 has).
MODELS = {
    "smollm2": {"label": "SmolLM2-135M-Instruct Q4_1", "template": ""},
    "gemma3-270m": {"label": "Gemma 3 270M Q4_K_M", "template": "google-gemma-2-2b-it.jinja"},
}
MODEL: dict[str, str] = {"name": "smollm2"}


def request_body(workload: str, prompt: str, seed: int, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL["name"],
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": tokens,
        "seed": seed,
        "stream_options": {"include_usage": True},
    }
    if workload == "json":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "people", "schema": SCHEMA},
        }
    elif workload == "tool":
        body["tools"] = TOOLS
        body["tool_choice"] = "required"
    return body


def enum_schema(serial: int) -> dict[str, Any]:
    """An object whose one property is a string enum of 5,000 values (the first one
    names ``serial``: no two requests send the same schema)."""
    values = [f"code-{serial}"] + [f"code-{i:04d}" for i in range(1, ENUM_VALUES)]
    return {
        "type": "object",
        "properties": {"code": {"type": "string", "enum": values}},
        "required": ["code"],
        "additionalProperties": False,
    }


def wide_schema(serial: int) -> dict[str, Any]:
    """An object of 100 required properties: strings, integers, booleans (the first
    property's name carries ``serial``)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 16},
        {"type": "integer"},
        {"type": "boolean"},
    ]
    names = [f"field_{serial}"] + [f"field_{i:03d}" for i in range(1, WIDE_PROPERTIES)]
    return {
        "type": "object",
        "properties": {n: kinds[i % 3] for i, n in enumerate(names)},
        "required": names,
        "additionalProperties": False,
    }


TTFT_SCHEMAS = {"enum5000": enum_schema, "props100": wide_schema}


def ttft_body(name: str, serial: int) -> dict[str, Any]:
    person = PEOPLE[serial % len(PEOPLE)]
    if name == "enum5000":
        prompt = f"Pick the code for {person}'s parcel."
    else:
        prompt = f"Fill in the form for {person}."
    return {
        "model": MODEL["name"],
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": TTFT_TOKENS,
        "seed": serial,
        "stream_options": {"include_usage": True},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": TTFT_SCHEMAS[name](serial)},
        },
    }


# -- answers -----------------------------------------------------------------------------


def tool_calls_of(raw: bytes) -> list[dict[str, str]]:
    """The streamed tool calls of an answer: name and arguments, joined by index."""
    calls: dict[int, dict[str, str]] = {}
    for line in body_of(raw).split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            obj = json.loads(line[6:])
        except ValueError:
            continue
        for ch in obj.get("choices") or ():
            for tc in (ch.get("delta") or {}).get("tool_calls") or ():
                call = calls.setdefault(int(tc.get("index") or 0), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
    return [calls[k] for k in sorted(calls)]


def parsed(stream: Stream) -> dict[str, Any]:
    try:
        return parse_sse(bytes(stream.raw))
    except (ValueError, IndexError):
        return {"status": stream.status, "text": "", "usage": None, "finish": None}


def measure(server: Server, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """``bodies`` as concurrent streams: throughput, TTFT, what was answered. A stream
    that failed (a status other than 200, no usage, no output) leaves the tok/s None."""
    port = server.port
    reqs = [http_post(port, CHAT, json.dumps(b).encode()) for b in bodies]
    cpu0 = proc_cpu_seconds(server.pid)
    streams = run_streams(port, reqs, first=FIRST)
    cpu = proc_cpu_seconds(server.pid) - cpu0
    answers = [parsed(s) for s in streams]
    tokens: list[int | None] = []
    decode: list[float | None] = []
    errors: list[str] = []
    for s, a in zip(streams, answers):
        usage = a.get("usage") or {}
        c = usage.get("completion_tokens")
        tokens.append(c)
        ok = a["status"] == 200 and s.t_first and s.t_done and c is not None
        if not ok:
            errors.append(f"{a['status']}: {s.body()[:300].decode('utf-8', 'replace')}")
        span_s = s.t_done - s.t_first if ok else 0.0
        decode.append((c - 1) / span_s if ok and c is not None and span_s > 0 else None)
    complete = not errors and all(d is not None for d in decode)
    wall = max(s.t_done or s.t_send for s in streams) - min(s.t_send for s in streams)
    return {
        "n": len(streams),
        "status": [a["status"] for a in answers],
        "completion_tokens": tokens,
        "finish": [a.get("finish") for a in answers],
        "wall_s": wall,
        "agg_tok_s": sum(t or 0 for t in tokens) / wall if complete and wall > 0 else None,
        "decode_tok_s": sum(d or 0.0 for d in decode) if complete else None,
        "decode_tok_s_each": decode,
        "ttft_s": [s.ttft if s.t_first else None for s in streams],
        "server_cpu_s": cpu,
        "texts": [a.get("text", "") for a in answers],
        "tool_calls": [
            tool_calls_of(bytes(s.raw)) or calls_in_text(a.get("text", ""))
            for s, a in zip(streams, answers)
        ],
        "errors": errors,
    }


def ttft_once(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """One request (connected before the clock): status, TTFT (None without output)."""
    (s,) = run_streams(server.port, [http_post(server.port, CHAT, json.dumps(body).encode())])
    a = parsed(s)
    return {
        "status": a["status"],
        "ttft_s": s.ttft if s.t_first and a["status"] == 200 else None,
        "answer_s": (s.t_done or time.perf_counter()) - s.t_send,
        "finish": a.get("finish"),
        "error": None if a["status"] == 200 else s.body()[:300].decode("utf-8", "replace"),
    }


def ttft_reps(server: Server, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ttft_once`` for each of ``bodies``, one after the other."""
    return [ttft_once(server, b) for b in bodies]


# -- validation ----------------------------------------------------------------------------


def item_problem(item: Any) -> str | None:
    if jsonschema is not None:
        try:
            jsonschema.validate(item, ITEM)
        except jsonschema.ValidationError as e:
            return str(e.message)[:160]
        return None
    if not isinstance(item, dict) or set(item) != {"name", "age", "city"}:
        return f"item keys {sorted(item) if isinstance(item, dict) else type(item).__name__}"
    if not isinstance(item["age"], int) or isinstance(item["age"], bool):
        return "age is not an integer"
    for key in ("name", "city"):
        if not isinstance(item[key], str) or len(item[key]) > NAME_LEN:
            return f"{key} is not a string of at most {NAME_LEN} characters"
    return None


def people_problem(text: str) -> str | None:
    """Why a complete answer does not match ``SCHEMA`` (None: it does)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e})"
    if jsonschema is not None:
        try:
            jsonschema.validate(doc, SCHEMA)
        except jsonschema.ValidationError as e:
            return str(e.message)[:160]
        return None
    if not isinstance(doc, dict) or set(doc) != {"people"}:
        return "not an object of 'people' alone"
    if not isinstance(doc["people"], list) or len(doc["people"]) < 20:
        return "'people' is not an array of at least 20 items"
    return next(filter(None, map(item_problem, doc["people"])), None)


def cut_items(text: str) -> tuple[bool, list[Any]]:
    """An answer cut by ``max_tokens``: whether it opens as ``{"people": [`` and its
    complete items."""
    m = re.match(r'\s*\{\s*"people"\s*:\s*\[', text)
    if not m:
        return False, []
    dec, i = json.JSONDecoder(), m.end()
    items: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            item, i = dec.raw_decode(text, i)
        except ValueError:
            return True, items
        items.append(item)


def tool_problem(calls: list[dict[str, str]]) -> str | None:
    """Why an answer is not a ``get_weather`` call with a string ``city``."""
    if not calls:
        return "no tool call"
    call = calls[0]
    if call["name"] != "get_weather":
        return f"called {call['name']!r}"
    try:
        args = json.loads(call["arguments"] or "null")
    except ValueError:
        return f"arguments not JSON: {call['arguments'][:80]!r}"
    if not isinstance(args, dict) or not isinstance(args.get("city"), str):
        return f"no string 'city' in {call['arguments'][:80]!r}"
    return None


# -- servers ---------------------------------------------------------------------------


def start_servers(args: argparse.Namespace, tmp: Path) -> dict[str, Server]:
    servers: dict[str, Server] = {}
    template: list[str] = []
    if args.template:
        template = [str(vendored_file(f"models/templates/{args.template}"))]
    port = free_port()
    cmd = [*SLUICE, "--port", str(port), "--threads", str(args.threads)]
    cmd += ["--parallel", str(PARALLEL), "--ctx", str(CTX), "--log-level", "warning"]
    cmd += ["--model", MODEL["name"]]
    cmd += ["--chat-template", *template] if template else []
    (tmp / "models").mkdir(exist_ok=True)
    servers["sluice"] = Server(
        "sluice", cmd, port, tmp / "sluice.log", env=models_env(tmp / "models")
    )
    try:
        port = free_port()
        extra = ["--jinja", *shlex.split(args.llama_args)]
        extra += ["--chat-template-file", *template] if template else []
        gguf = Path(MODEL["path"])
        cmd = llama_server_cmd(
            args.llama_server, port, args.threads, PARALLEL, CTX, *extra, model=gguf
        )
        servers["llama-server"] = LlamaServer("llama-server", cmd, port, tmp / "llama.log")
    except BaseException:
        servers["sluice"].close()
        raise
    return servers


# -- report ----------------------------------------------------------------------------


def vals(xs: list[float | None]) -> list[float]:
    return [x for x in xs if x is not None]


def mid(xs: list[float], scale: float = 1.0) -> float | None:
    """The median times ``scale``, None for no values (kept out of the JSON as NaN)."""
    return scale * med(xs) if xs else None


def at_least(x: float | None, target: float) -> bool:
    return x is not None and x >= target


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def span(xs: list[float], fmt: str = ".3f") -> str:
    """``median [min-max]``."""
    return f"{med(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]" if xs else "-"


def fmt(x: float | None, f: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else f"{x:{f}}"


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    results = res["results"]
    for wl, by_level in results.items():
        for level, rounds in by_level.items():
            s = {
                side: {
                    key: vals([r[side][key] for r in rounds])
                    for key in ("agg_tok_s", "decode_tok_s")
                }
                for side in SIDES
            }
            row: dict[str, Any] = {
                "workload": wl,
                "level": int(level),
                "sluice_agg": mid(s["sluice"]["agg_tok_s"]),
                "sluice_decode": mid(s["sluice"]["decode_tok_s"]),
                "llama_agg": mid(s["llama-server"]["agg_tok_s"]),
                "llama_decode": mid(s["llama-server"]["decode_tok_s"]),
                "paired_agg_all": vals([r["ratio_agg"] for r in rounds]),
                "paired_decode_all": vals([r["ratio_decode"] for r in rounds]),
                "tokens": {
                    side: mid([t for r in rounds for t in vals(r[side]["completion_tokens"])])
                    for side in SIDES
                },
                "ttft_ms": {
                    side: mid([t for r in rounds for t in vals(r[side]["ttft_s"])], 1000)
                    for side in SIDES
                },
            }
            row["paired_agg"] = mid(row["paired_agg_all"])
            row["paired_decode"] = mid(row["paired_decode_all"])
            if wl != "free" and "free" in results:
                free = {r["round"]: r["sluice"]["decode_tok_s"] for r in results["free"][level]}
                row["ceiling_all"] = vals(
                    [div(r["sluice"]["decode_tok_s"], free.get(r["round"])) for r in rounds]
                )
                row["ceiling"] = mid(row["ceiling_all"])
            out[f"{wl} x{level}"] = row
    if res.get("ttft"):
        for name, rounds in res["ttft"].items():
            ttft = {
                side: [t for r in rounds for t in vals([x["ttft_s"] for x in r[side]])]
                for side in SIDES
            }
            out[f"ttft {name}"] = {
                "sluice_ttft_ms": mid(ttft["sluice"], 1000),
                "llama_ttft_ms": mid(ttft["llama-server"], 1000),
                "paired_all": vals([r["ratio"] for r in rounds]),
                "paired": mid(vals([r["ratio"] for r in rounds])),
                "status": {
                    side: dict(Counter(str(x["status"]) for r in rounds for x in r[side]))
                    for side in SIDES
                },
            }
    return out


def targets(summary: dict[str, Any]) -> dict[str, bool]:
    met: dict[str, bool] = {}
    for label, row in summary.items():
        wl = row.get("workload")
        if wl in ("json", "tool"):
            met[f"{label} decode sluice/llama >= {TARGET_VS_LLAMA:.2f}"] = at_least(
                row["paired_decode"], TARGET_VS_LLAMA
            )
            if "ceiling" in row:
                met[f"{label} decode sluice {wl}/free >= {TARGET_CEILING:.2f}"] = at_least(
                    row["ceiling"], TARGET_CEILING
                )
        elif wl == "free":
            met[f"{label} decode sluice/llama >= {TARGET_FREE:.2f}"] = at_least(
                row["paired_decode"], TARGET_FREE
            )
    return met


def checks(res: dict[str, Any], quiet: float) -> list[str]:
    out: list[str] = []
    out.append(
        "JSON answers checked with "
        + ("jsonschema" if jsonschema is not None else "a hand check of keys and types")
    )
    for wl, by_level in res["results"].items():
        for side in SIDES:
            ms = [r[side] for rounds in by_level.values() for r in rounds]
            status = Counter(s for m in ms for s in m["status"])
            finish = Counter(str(f) for m in ms for f in m["finish"])
            toks = [t for m in ms for t in vals(m["completion_tokens"])]
            line = (
                f"{wl} {side}: {sum(status.values())} answers, HTTP "
                + ", ".join(f"{k} x{v}" for k, v in sorted(status.items()))
                + "; finish "
                + ", ".join(f"{k} x{v}" for k, v in sorted(finish.items()))
                + (f"; completion tokens {min(toks)}-{max(toks)}" if toks else "")
            )
            out.append(line)
            errors = [e for m in ms for e in m["errors"]]
            if errors:
                out.append(f"{wl} {side}: {len(errors)} failed streams, e.g. {errors[0]!r}")
            answers = [
                (text, fin, calls)
                for m in ms
                for text, fin, calls, st in zip(
                    m["texts"], m["finish"], m["tool_calls"], m["status"]
                )
                if st == 200
            ]
            if wl == "json":
                whole = [a for a in answers if a[1] != "length"]
                cut = [a for a in answers if a[1] == "length"]
                bad = [(p, t) for t, _, _ in whole if (p := people_problem(t))]
                line = f"json {side}: {len(whole) - len(bad)}/{len(whole)} complete answers valid"
                if bad:
                    line += f" (INVALID, e.g. {bad[0][0]}: {bad[0][1][:120]!r})"
                opened = [cut_items(t) for t, _, _ in cut]
                items = [i for _, its in opened for i in its]
                bad_items = [p for i in items if (p := item_problem(i))]
                line += (
                    f"; {len(cut)} cut by max_tokens: {sum(ok for ok, _ in opened)} open as "
                    f'{{"people": [, their {len(items)} complete items '
                    f"{len(items) - len(bad_items)} valid"
                )
                if bad_items:
                    line += f" (e.g. {bad_items[0]})"
                if len(opened) > sum(ok for ok, _ in opened):
                    t = next(t for (t, _, _), (ok, _) in zip(cut, opened) if not ok)
                    line += f"; NOT opening as an object of people, e.g. {t[:120]!r}"
                out.append(line)
            elif wl == "tool":
                whole = [a for a in answers if a[1] != "length"]
                cut = [a for a in answers if a[1] == "length"]
                bad = [(p, t) for t, _, calls in whole if (p := tool_problem(calls))]
                line = f"tool {side}: {len(whole) - len(bad)}/{len(whole)} complete answers "
                line += "call get_weather with a string city"
                if bad:
                    line += f" (NOT: e.g. {bad[0][0]}; content {bad[0][1][:120]!r})"
                named = sum(bool(c) and c[0]["name"] == "get_weather" for _, _, c in cut)
                line += f"; {len(cut)} cut by max_tokens, {named} of them naming get_weather"
                out.append(line)
                if answers and not any(calls for _, _, calls in answers):
                    out.append(
                        f"tool {side}: NO answer has a tool call: the tools were ignored (for "
                        "llama-server: its chat parser finds no tool format in this model's "
                        "template and drops them), so the tool ratios compare constrained "
                        "decoding with plain text"
                    )
    for name, rounds in (res.get("ttft") or {}).items():
        for side in SIDES:
            st = Counter(str(x["status"]) for r in rounds for x in r[side])
            line = f"ttft {name} {side}: HTTP " + ", ".join(f"{k} x{v}" for k, v in st.items())
            err = next((x["error"] for r in rounds for x in r[side] if x["error"]), None)
            if err:
                line += f"; e.g. {err!r}"
            out.append(line)
    for wl, by_level in res["results"].items():
        for level, rounds in by_level.items():
            for r in rounds:
                for side in SIDES:
                    if r[side]["foreign_cores"] > quiet:
                        out.append(
                            f"{wl} x{level} round {r['round']} {side}: others used "
                            f"{r[side]['foreign_cores']:.2f} cores during it (kept)"
                        )
    for name, rounds in (res.get("ttft") or {}).items():
        for r in rounds:
            for side in SIDES:
                if r["foreign_cores"][side] > quiet:
                    out.append(
                        f"ttft {name} round {r['round']} {side}: others used "
                        f"{r['foreign_cores'][side]:.2f} cores during it (kept)"
                    )
    return out


def main_table(summary: dict[str, Any], markdown: bool) -> str:
    head = [
        "workload",
        "streams",
        "sluice agg",
        "sluice decode",
        "llama agg",
        "llama decode",
        "agg sluice/llama paired [range]",
        "decode sluice/llama paired [range]",
        "sluice decode / its free paired [range]",
        "tokens/stream (sluice/llama)",
        "TTFT ms (sluice/llama)",
    ]
    rows = []
    for row in summary.values():
        if "workload" not in row:
            continue
        rows.append(
            [
                row["workload"],
                str(row["level"]),
                fmt(row["sluice_agg"]),
                fmt(row["sluice_decode"]),
                fmt(row["llama_agg"]),
                fmt(row["llama_decode"]),
                span(row["paired_agg_all"]),
                span(row["paired_decode_all"]),
                span(row["ceiling_all"]) if "ceiling_all" in row else "(ceiling)",
                f"{fmt(row['tokens']['sluice'], '.0f')}/{fmt(row['tokens']['llama-server'], '.0f')}",
                f"{fmt(row['ttft_ms']['sluice'], '.0f')}/{fmt(row['ttft_ms']['llama-server'], '.0f')}",
            ]
        )
    return render_table(head, rows, markdown)


def ttft_table(summary: dict[str, Any], markdown: bool) -> str:
    head = [
        "schema",
        "sluice TTFT ms",
        "llama-server TTFT ms",
        "sluice/llama paired [range]",
        "HTTP sluice",
        "HTTP llama-server",
    ]
    rows = []
    for label, row in summary.items():
        if not label.startswith("ttft "):
            continue
        rows.append(
            [
                label.removeprefix("ttft "),
                fmt(row["sluice_ttft_ms"], ".0f"),
                fmt(row["llama_ttft_ms"], ".0f"),
                span(row["paired_all"]),
                ", ".join(f"{k} x{v}" for k, v in row["status"]["sluice"].items()),
                ", ".join(f"{k} x{v}" for k, v in row["status"]["llama-server"].items()),
            ]
        )
    return render_table(head, rows, markdown) if rows else ""


def write_report(res: dict[str, Any], out_dir: Path) -> Path:
    st, summary = res["settings"], res["summary"]
    ttft = ttft_table(summary, markdown=True)
    md = (
        f"# Constrained decoding: sluice vs llama-server ({res['date']})\n\n"
        f"{MODELS[st.get('model', 'smollm2')]['label']}, {st['threads']} threads each, {PARALLEL} slots of "
        f"{CTX} tokens; {st['rounds']} rounds, the two sides alternating (order rotated), "
        f"streaming chat, `max_tokens` {st['tokens']}, a seed per request, no "
        "`ignore_eos`, llama.cpp's default sampling (no sampling fields). Workloads: free "
        "(a long story), json (a `json_schema` of at least 20 people), tool (`get_weather`, "
        "`tool_choice: required`). agg = completion tokens / wall; decode = per stream "
        "(tokens - 1) / (last frame - first output), summed; tok/s are medians over "
        "rounds; 'paired' = median [range] of the per-round ratios.\n\n"
        f"{machine_line(res['machine'], res['load_average'])}.\n\n"
        f"sluice: `{' '.join(st['cmds']['sluice'])}`; llama-server: "
        f"`{' '.join(st['cmds']['llama-server'])}`.\n\n"
        + main_table(summary, markdown=True)
        + "\n\n"
        + (
            f"Time to first token of a new large schema (1 stream, `max_tokens` "
            f"{TTFT_TOKENS}, {TTFT_REPS} requests per side per round; lower is better):\n\n"
            + ttft
            + "\n\n"
            if ttft
            else ""
        )
        + targets_and_checks(res["met"], res["checks"], st["reproduce"])
    )
    return save_report(out_dir, f"constrained-{res['stamp']}", res, md)


# -- main ------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levels", default="1,4", help="concurrent streams (1,4)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="free,json,tool")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens per stream (128)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument(
        "--template",
        default=None,
        help="a chat template both servers use, from the vendored llama.cpp's "
        "models/templates (default: each its model's own)",
    )
    ap.add_argument(
        "--llama-tools",
        action="store_true",
        help="send llama-server the tools as they are (default: the call as a schema)",
    )
    ap.add_argument(
        "--llama-args",
        default="",
        help="more arguments for llama-server (e.g. '--chat-template-file F': a template "
        "with tool support)",
    )
    ap.add_argument(
        "--ttft-schema",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TTFT of a 5,000-value enum and a 100-property schema (on)",
    )
    ap.add_argument(
        "--quiet", type=float, default=0.3, help="max cores others may use (default 0.3)"
    )
    ap.add_argument("--quiet-timeout", type=float, default=60.0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    workloads = args.workloads.split(",")
    if bad := [w for w in workloads if w not in WORKLOADS]:
        raise SystemExit(f"constrained: unknown workloads {bad} (free, json, tool)")
    if any(n < 1 or n > PARALLEL for n in levels):
        raise SystemExit(f"constrained: levels go from 1 to {PARALLEL} (the slots)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers closed on the way out
    reproduce = ".venv/bin/python benchmarks/constrained.py " + shlex.join(sys.argv[1:])
    args.llama_server = ensure_llama_server()  # built (once) before anything is timed
    from sluice.models.catalog import resolve_model

    MODEL.update(name=args.model, path=str(resolve_model(args.model).path))
    if args.template is None:
        args.template = MODELS[args.model]["template"]
    started, load_start = now(), loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-constrained-"))
    print(
        f"constrained: threads={args.threads} rounds={args.rounds} levels={levels} "
        f"workloads={workloads} tokens={args.tokens} ttft-schema={args.ttft_schema} "
        f"load={load_start}; logs in {tmp}",
        flush=True,
    )
    prompts = Prompts()
    serial = 0
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        wl: {str(n): [] for n in levels} for wl in workloads
    }
    ttft: dict[str, list[dict[str, Any]]] = {name: [] for name in TTFT_SCHEMAS}
    servers = start_servers(args, tmp)
    try:
        noise = Noise([s.pid for s in servers.values()])
        for wl in workloads:  # warm-up: both sides, every workload, one short stream
            body = request_body(wl, prompts.take(wl), 0, 16)
            for side in SIDES:
                measure(servers[side], [for_side(body, side, args.llama_tools)])
        for rnd in range(args.rounds):
            for li, n in enumerate(levels):
                for wi, wl in enumerate(workloads):
                    bodies = []
                    for _ in range(n):
                        serial += 1
                        bodies.append(request_body(wl, prompts.take(wl), serial, args.tokens))
                    entry: dict[str, Any] = {
                        "round": rnd + 1,
                        "prompts": [b["messages"][0]["content"] for b in bodies],
                        "seeds": [b["seed"] for b in bodies],
                    }
                    for side in rotated(SIDES, rnd + li + wi):
                        srv = servers[side]
                        srv.wait_idle()
                        time.sleep(0.3)
                        sent = [for_side(x, side, args.llama_tools) for x in bodies]
                        m, foreign, before = noise.run(
                            partial(measure, srv, sent),
                            args.quiet,
                            args.quiet_timeout,
                        )
                        m |= {"foreign_cores": foreign, "foreign_cores_before": before}
                        entry[side] = m
                        print(
                            f"  round {rnd + 1}/{args.rounds} {wl:4s} x{n} {side:12s} agg "
                            f"{fmt(m['agg_tok_s']):>6s} decode {fmt(m['decode_tok_s']):>6s} "
                            f"tok/s; tokens {m['completion_tokens']} finish {m['finish']} "
                            f"HTTP {sorted(set(m['status']))} (others used {foreign:.2f} "
                            "cores)",
                            flush=True,
                        )
                    s, ll = entry["sluice"], entry["llama-server"]
                    entry["ratio_agg"] = div(s["agg_tok_s"], ll["agg_tok_s"])
                    entry["ratio_decode"] = div(s["decode_tok_s"], ll["decode_tok_s"])
                    results[wl][str(n)].append(entry)
                    print(
                        f"  round {rnd + 1}/{args.rounds} {wl:4s} x{n} sluice/llama-server "
                        f"agg {fmt(entry['ratio_agg'], '.3f')} decode "
                        f"{fmt(entry['ratio_decode'], '.3f')}",
                        flush=True,
                    )
            if not args.ttft_schema:
                continue
            for ki, name in enumerate(TTFT_SCHEMAS):
                tentry: dict[str, Any] = {"round": rnd + 1, "foreign_cores": {}}
                for side in rotated(SIDES, rnd + ki):
                    srv = servers[side]
                    srv.wait_idle()
                    time.sleep(0.3)
                    tbodies = []
                    for _ in range(TTFT_REPS):
                        serial += 1
                        tbodies.append(ttft_body(name, serial))
                    reps, foreign, _ = noise.run(
                        partial(ttft_reps, srv, tbodies),
                        args.quiet,
                        args.quiet_timeout,
                    )
                    tentry[side] = reps
                    tentry["foreign_cores"][side] = foreign
                    print(
                        f"  round {rnd + 1}/{args.rounds} ttft {name} {side:12s} "
                        + ", ".join(
                            f"{x['status']}:{fmt(x['ttft_s'] and 1000 * x['ttft_s'], '.0f')}"
                            for x in reps
                        )
                        + f" ms (others used {foreign:.2f} cores)",
                        flush=True,
                    )
                tentry["ratio"] = div(
                    mid(vals([x["ttft_s"] for x in tentry["sluice"]])),
                    mid(vals([x["ttft_s"] for x in tentry["llama-server"]])),
                )
                ttft[name].append(tentry)
        cmds = {side: s.cmd for side, s in servers.items()}
    finally:
        for s in servers.values():
            s.close()
    res: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "stamp": stamp(started),
        "machine": machine_info(),
        "llama_server_build": build_info(args.llama_server),
        "load_average": {"start": load_start, "end": loadavg()},
        "settings": {
            "model": args.model,
            "template": args.template,
            "rounds": args.rounds,
            "levels": levels,
            "workloads": workloads,
            "tokens": args.tokens,
            "threads": args.threads,
            "parallel": PARALLEL,
            "ctx": CTX,
            "ttft_schema": args.ttft_schema,
            "quiet": args.quiet,
            "schema": SCHEMA,
            "tools": TOOLS,
            "cmds": {
                side: [Path(a).name if a.startswith("/") else a for a in cmd]
                for side, cmd in cmds.items()
            },
            "note": args.note,
            "reproduce": reproduce.strip(),
        },
        "results": results,
        "ttft": ttft if args.ttft_schema else {},
    }
    res["summary"] = summarize(res)
    res["met"] = targets(res["summary"])
    res["checks"] = checks(res, args.quiet)
    print()
    print(main_table(res["summary"], markdown=False))
    if table := ttft_table(res["summary"], markdown=False):
        print()
        print(table)
    print()
    print_outcome(res["met"], res["checks"], res["load_average"])
    write_report(res, args.out_dir)


if __name__ == "__main__":
    main()
