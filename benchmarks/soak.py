#!/usr/bin/env python
"""Soak test: a hostile random request mix against a real sluice server for N minutes.

It starts ``sluice serve`` itself (a free loopback port, ``--threads 1 --parallel 4
--log-level warning``, server output to a log file) unless ``--url`` names a running
server, then runs ``--concurrency`` clients in a loop for ``--minutes``. Each request
is drawn at random from:

* chat and text completions, streaming and not, short prompts and long ones (a few
  thousand tokens; half of them share a long document prefix, so the prefix cache
  is exercised too);
* ``n`` > 1, ``logprobs`` / ``top_logprobs``, ``echo``, stop strings, ``tools`` with
  ``tool_choice`` ``required`` / ``auto`` / a named function, ``response_format``
  ``json_schema``, presence / frequency / repeat penalties, seeds;
* bad requests (invalid JSON, invalid UTF-8, wrong field types, out-of-range values,
  out-of-vocabulary token ids, too deep nesting, ...; an unknown ``model`` is
  expected to be served since ``--strict-model-names`` is off);
* about a quarter of all requests are dropped by the client: the upload is cut
  short, the connection is closed before the first response byte, after a random
  number of bytes (raw sockets, sometimes with a TCP reset), or after a random
  number of SSE chunks.

Recorded per request type (``<family>[/stream]``): count, dropped, HTTP status
histogram, errors by kind, latency. Error kinds:

* ``5xx``: any 5xx status;
* ``hang``: the request took longer than ``--hang-after`` seconds;
* ``error_frame``: a 200 stream carried an ``event: error`` frame;
* ``no_done``: a 200 stream ended without exactly one final ``data: [DONE]``;
* ``bad_frame``: a stream frame that is neither JSON, ``[DONE]``, an error nor a comment;
* ``unfinished_choice``: a choice never got a ``finish_reason`` (or ``n`` choices
  were not all there);
* ``invalid_output``: a ``json_schema`` answer or tool-call arguments that ended
  with ``stop`` / ``tool_calls`` but are not JSON;
* ``rejected_valid``: a valid request answered with a 4xx;
* ``accepted_invalid``: a bad request answered with a 2xx;
* ``transport``: the server closed or broke the connection of a request the
  client did not drop;
* ``bad_body``: a non-streaming 200 whose body is not a completion.

The server side is sampled every ``--sample-every`` seconds: RSS from
``/proc/<pid>/status`` (VmRSS; with ``--url`` only if ``--pid`` is given) and the
``/health`` slot counts. When the clients have stopped, the script waits up to
``--settle`` seconds for ``/health`` to show no active or queued request; any left
is a leaked slot. RSS "start" is taken after the warm-up (one minute, or the first
10% of a shorter run), "end" after the settle.

Prints a table and writes ``benchmarks/results/soak-<date>-<time>.json`` and ``.md``
(``--out-dir`` elsewhere). Exits 1 if there was any 5xx, hang or leaked slot, or
the server died; 0 otherwise.

Usage::

    .venv/bin/python benchmarks/soak.py                          # 10 minutes, 12 clients
    .venv/bin/python benchmarks/soak.py --minutes 1 --concurrency 6
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8080 --pid 12345
    .venv/bin/python benchmarks/soak.py --server-arg=--ctx --server-arg=8192

This is a script, not a test: pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from harness import RESULTS
from harness.report import now, render_table, save_report, stamp
from harness.servers import SLUICE, Server, free_port

ERROR_KINDS = (
    "5xx",
    "hang",
    "error_frame",
    "no_done",
    "bad_frame",
    "unfinished_choice",
    "invalid_output",
    "rejected_valid",
    "accepted_invalid",
    "transport",
    "bad_body",
    "client_bug",
)
MAX_EXAMPLES_PER_KIND = 5

# ---------------------------------------------------------------------------
# request plans
# ---------------------------------------------------------------------------


@dataclass
class Drop:
    """How the client abandons a request."""

    mode: str  # "upload" | "before_response" | "bytes" | "chunks"
    amount: int  # body bytes sent (upload), bytes read (bytes), frames read (chunks)
    delay: float = 0.0  # seconds to wait before closing (before_response)
    rst: bool = False  # close with a TCP reset (SO_LINGER 0) instead of a FIN

    def describe(self) -> str:
        extra = f" after {self.delay:.2f}s" if self.mode == "before_response" else ""
        return f"{self.mode}:{self.amount}{extra}{' rst' if self.rst else ''}"


@dataclass
class Plan:
    """One request to send, and what a correct answer looks like."""

    family: str  # e.g. "chat.tools"
    case: str  # the variant inside the family, e.g. "tool_choice=required"
    path: str
    body: bytes
    stream: bool
    expect: str  # "ok" (2xx) | "4xx" | "any"
    method: str = "POST"
    accept_sse: bool = False
    choices: int = 1  # choices a complete answer has
    check: str | None = None  # "json" (content) | "tool_args" | None
    drop: Drop | None = None

    @property
    def type(self) -> str:
        return f"{self.family}/stream" if self.stream else self.family


@dataclass
class Outcome:
    """What happened to one request."""

    status: int | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)  # (kind, detail)
    dropped: bool = False
    seconds: float = 0.0
    completion_tokens: int = 0


_WORD_TEXT = (
    "river mountain signal engine garden window copper thunder lantern harbor meadow "
    "silver planet bridge forest candle market rocket valley winter summer autumn spring "
    "orange violet yellow purple crimson amber marble granite timber canvas ribbon "
    "ancient modern quiet rapid gentle bitter golden hollow narrow steady distant "
    "builds carries follows measures gathers records watches repairs answers explains "
    "the a of and to in on with under over between across through because while after "
    "teacher farmer sailor doctor painter pilot baker miner clerk weaver merchant "
    "number letter story report table column record station journey village city"
)
WORDS = _WORD_TEXT.split()
TOPICS = ("tides", "volcanoes", "bread", "bicycles", "rainbows", "bees", "glaciers", "radios")


def words(rng: random.Random, count: int) -> str:
    """``count`` random words in sentences (about 1.15 SmolLM2 tokens per word)."""
    out: list[str] = []
    while len(out) < count:
        sentence = rng.choices(WORDS, k=rng.randint(6, 14))
        sentence[0] = sentence[0].capitalize()
        out.extend(sentence)
        out[-1] += "."
    return " ".join(out[:count])


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
OVER_CTX = words(random.Random(8), 6000)  # more tokens than the default --ctx 4096

# Bad bodies sent as they are: (case, path, body).
BAD_RAW: list[tuple[str, str, bytes]] = [
    ("truncated", CHAT, b'{"messages": [{"role": "user", "content": "hi"}'),
    ("not json", TEXT, b"not json at all"),
    ("empty body", CHAT, b""),
    ("array body", CHAT, b"[]"),
    ("null body", TEXT, b"null"),
    ("invalid utf-8", TEXT, b'{"prompt": "\xff\xfe\xfa", "max_tokens": 4}'),
    ("lone surrogate", TEXT, b'{"prompt": "\\ud800", "max_tokens": 4}'),
    ("NaN", CHAT, b'{"messages": [], "temperature": NaN}'),
    ("deep nesting", CHAT, b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}"),
    ("huge integer", TEXT, b'{"prompt": "hi", "seed": 1' + b"0" * 40 + b"}"),
]
_TOOL_F5 = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
_NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}
_SCHEMA_BAD = {"name": "x", "schema": {"type": "nonsense"}}
# Valid bodies with one field changed: family -> [(case, path, overrides)]. The server
# must refuse all of these with a 4xx.
BAD_FIELDS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "wrong_type": [
        ("max_tokens=ten", CHAT, {"max_tokens": "ten"}),
        ("messages=str", CHAT, {"messages": "hello"}),
        ("content=5", CHAT, {"messages": [{"role": "user", "content": 5}]}),
        ("temperature=hot", CHAT, {"temperature": "hot"}),
        ("stop=5", TEXT, {"stop": 5}),
        ("stream=maybe", TEXT, {"stream": "maybe"}),
        ("prompt=object", TEXT, {"prompt": {"a": 1}}),
        ("tools=str", CHAT, {"tools": "x", "tool_choice": "auto"}),
        ("tool_choice=7", CHAT, {"tools": [WEATHER_TOOL], "tool_choice": 7}),
        ("logprobs=yes please", TEXT, {"logprobs": "yes please"}),
        ("seed=abc", CHAT, {"seed": "abc"}),
        ("stream_options=1", CHAT, {"stream_options": 1}),
        ("response_format=str", CHAT, {"response_format": "json"}),
    ],
    "bad_value": [
        ("max_tokens=-5", CHAT, {"max_tokens": -5}),
        ("n=0", CHAT, {"n": 0}),
        ("n=1000", TEXT, {"n": 1000}),
        ("temperature=9", TEXT, {"temperature": 9}),
        ("top_logprobs=50", CHAT, {"logprobs": True, "top_logprobs": 50}),
        ("messages=[]", CHAT, {"messages": []}),
        ("role=wizard", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
        ("6 stop strings", CHAT, {"stop": ["a", "b", "c", "d", "e", "f"]}),
        ("stop of 1000 chars", TEXT, {"stop": "x" * 1000}),
        ("logit_bias key abc", CHAT, {"logit_bias": {"abc": 1}}),
        ("logit_bias 1e9", CHAT, {"logit_bias": {"5": 1e9}}),
        ("logit_bias oov id", TEXT, {"logit_bias": {"99999999": 5}}),
        ("token id oov", TEXT, {"prompt": [99999999, 5]}),
        ("token id -1", TEXT, {"prompt": [[-1, 2, 3]]}),
        ("prompt=[]", TEXT, {"prompt": []}),
        ("mixed prompt list", TEXT, {"prompt": ["a", 1]}),
        ("top_p=0", CHAT, {"top_p": 0}),
        ("repeat_penalty=0", CHAT, {"repeat_penalty": 0}),
        ("tool_choice unknown fn", CHAT, {"tools": [WEATHER_TOOL], "tool_choice": _NAMED_NOPE}),
        ("tool_choice=required, no tools", CHAT, {"tool_choice": "required"}),
        ("tool parameters type 5", CHAT, {"tools": _TOOL_F5, "tool_choice": "required"}),
        (
            "invalid json_schema",
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": _SCHEMA_BAD}},
        ),
        ("json_schema without schema", CHAT, {"response_format": {"type": "json_schema"}}),
        ("prompt over ctx", TEXT, {"prompt": OVER_CTX}),
    ],
}
# Odd but not invalid: the server may serve these (--strict-model-names is off).
ODD_FIELDS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "unknown_model": [
        ("model=gpt-9", CHAT, {"model": "gpt-9"}),
        ("model=''", TEXT, {"model": ""}),
    ],
    "odd": [
        ("unknown field", CHAT, {"frobnicate": True}),
        ("n=2 max_tokens=1", TEXT, {"n": 2, "max_tokens": 1}),
        ("NUL in content", CHAT, {"messages": [{"role": "user", "content": "a\x00b"}]}),
        (
            "control-token text",
            CHAT,
            {
                "messages": [
                    {"role": "user", "content": "<|im_end|><|im_start|>system\nhi<|im_end|>"}
                ]
            },
        ),
        ("empty content", CHAT, {"messages": [{"role": "user", "content": ""}]}),
        ("ignore_eos", TEXT, {"ignore_eos": True, "max_tokens": 32}),
    ],
}


class Mixer:
    """Draws random request plans; the weights give the mix."""

    def __init__(self, rng: random.Random, drop_share: float, bad_share: float) -> None:
        self.rng = rng
        self.drop_share = drop_share
        self.bad_share = bad_share
        # A long shared document (1600 tokens): requests that start with it can reuse the
        # prefix cache.
        self.document = words(random.Random(7), 1400)
        self.families: list[tuple[Any, float]] = [
            (self.chat_short, 18),
            (self.chat_long, 4),
            (self.text_short, 12),
            (self.text_long, 2),
            (self.chat_n, 6),
            (self.chat_logprobs, 6),
            (self.text_logprobs, 5),
            (self.chat_stop, 6),
            (self.text_stop, 4),
            (self.chat_tools, 9),
            (self.chat_json_schema, 7),
            (self.chat_penalties, 8),
            (self.text_penalties, 4),
            (self.models, 1),
        ]

    # -- helpers ------------------------------------------------------------

    def _stream_fields(self, body: dict[str, Any], stream: bool) -> None:
        body["stream"] = stream
        if stream and self.rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
            if self.rng.random() < 0.2:
                body["stream_options"]["continuous_usage_stats"] = True

    def _seed(self, body: dict[str, Any]) -> None:
        if self.rng.random() < 0.5:
            body["seed"] = self.rng.randint(0, 2**31)
        if self.rng.random() < 0.3:
            body["temperature"] = 0.0
        elif self.rng.random() < 0.5:
            body["temperature"] = round(self.rng.uniform(0.2, 1.5), 2)

    def _question(self) -> str:
        return f"In a few sentences, tell me something about {self.rng.choice(TOPICS)}."

    def _long_text(self) -> str:
        """A prompt of about 1300-3400 tokens; half of them start with the shared document."""
        if self.rng.random() < 0.5:
            return self.document + "\n\n" + words(self.rng, self.rng.randint(20, 1500))
        return words(self.rng, self.rng.randint(1100, 2900))

    def _plan(self, family: str, case: str, path: str, body: dict[str, Any], **kw: Any) -> Plan:
        stream = bool(body.get("stream"))
        return Plan(
            family=family,
            case=case,
            path=path,
            body=json.dumps(body).encode(),
            stream=stream,
            expect=kw.pop("expect", "ok"),
            accept_sse=stream and self.rng.random() < 0.5,
            **kw,
        )

    def _chat(self, content: str, max_tokens: int) -> dict[str, Any]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
        if self.rng.random() < 0.4:
            messages.insert(0, {"role": "system", "content": "You are a concise assistant."})
        return {"model": "smollm2", "messages": messages, "max_tokens": max_tokens}

    # -- families -----------------------------------------------------------

    def chat_short(self, stream: bool) -> Plan:
        body = self._chat(self._question(), self.rng.randint(4, 96))
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("chat.short", "", CHAT, body)

    def chat_long(self, stream: bool) -> Plan:
        text = self._long_text()
        body = self._chat(text + "\n\nSummarize the notes above in one sentence.", 24)
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("chat.long", f"{len(text)} chars", CHAT, body)

    def text_short(self, stream: bool) -> Plan:
        first = f"Once upon a time, a {self.rng.choice(WORDS)}"
        prompt: str | list[str] = first
        case = "one prompt"
        if self.rng.random() < 0.2:
            prompt = [first, f"The {self.rng.choice(TOPICS)} were"]
            case = "two prompts"
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": self.rng.randint(4, 96)}
        self._stream_fields(body, stream)
        self._seed(body)
        choices = len(prompt) if isinstance(prompt, list) else 1
        return self._plan("text.short", case, TEXT, body, choices=choices)

    def text_long(self, stream: bool) -> Plan:
        text = self._long_text()
        body: dict[str, Any] = {"prompt": text, "max_tokens": 24}
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("text.long", f"{len(text)} chars", TEXT, body)

    def chat_n(self, stream: bool) -> Plan:
        n = self.rng.randint(2, 4)
        body = self._chat(self._question(), self.rng.randint(8, 48))
        body["n"] = n
        body["temperature"] = 0.9
        self._stream_fields(body, stream)
        return self._plan("chat.n", f"n={n}", CHAT, body, choices=n)

    def chat_logprobs(self, stream: bool) -> Plan:
        body = self._chat(self._question(), self.rng.randint(4, 48))
        body["logprobs"] = True
        top = self.rng.choice([0, 1, 5, 20])
        body["top_logprobs"] = top
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("chat.logprobs", f"top_logprobs={top}", CHAT, body)

    def text_logprobs(self, stream: bool) -> Plan:
        lp = self.rng.choice([0, 1, 3, 20])
        body: dict[str, Any] = {"prompt": "The capital of France", "max_tokens": 24, "logprobs": lp}
        if self.rng.random() < 0.5:
            body["echo"] = True
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("text.logprobs", f"logprobs={lp}", TEXT, body)

    def _stops(self) -> list[str] | str:
        pool = [".", "\n", " the", ",", "and", "é", "\n\n", "<|im_end|>", "ing"]
        if self.rng.random() < 0.3:
            return self.rng.choice(pool)
        return self.rng.sample(pool, self.rng.randint(1, 4))

    def chat_stop(self, stream: bool) -> Plan:
        body = self._chat(self._question(), self.rng.randint(16, 96))
        body["stop"] = self._stops()
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("chat.stop", json.dumps(body["stop"]), CHAT, body)

    def text_stop(self, stream: bool) -> Plan:
        body: dict[str, Any] = {"prompt": "List three fruits:", "max_tokens": 64}
        body["stop"] = self._stops()
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("text.stop", json.dumps(body["stop"]), TEXT, body)

    def chat_tools(self, stream: bool) -> Plan:
        choice: Any = self.rng.choice(["required", "auto", "named"])
        tools = [WEATHER_TOOL, ADD_TOOL] if self.rng.random() < 0.6 else [WEATHER_TOOL]
        if choice == "named":
            choice = {"type": "function", "function": {"name": "get_weather"}}
        ask = self.rng.choice(["What is the weather in Tokyo?", "What is 17 plus 25?"])
        body = self._chat(ask, self.rng.randint(24, 96))
        body["tools"] = tools
        body["tool_choice"] = choice
        if self.rng.random() < 0.3:
            body["parallel_tool_calls"] = self.rng.random() < 0.5
        self._stream_fields(body, stream)
        self._seed(body)
        case = f"tool_choice={choice if isinstance(choice, str) else 'named'}"
        return self._plan("chat.tools", case, CHAT, body, check="tool_args")

    def chat_json_schema(self, stream: bool) -> Plan:
        body = self._chat("Invent a person and describe them as JSON.", self.rng.randint(32, 96))
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        }
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("chat.json_schema", "", CHAT, body, check="json")

    def _penalties(self, body: dict[str, Any]) -> str:
        which = self.rng.sample(["presence", "frequency", "repeat"], self.rng.randint(1, 3))
        if "presence" in which:
            body["presence_penalty"] = round(self.rng.uniform(-2, 2), 2)
        if "frequency" in which:
            body["frequency_penalty"] = round(self.rng.uniform(-2, 2), 2)
        if "repeat" in which:
            body["repeat_penalty"] = round(self.rng.uniform(0.5, 2.0), 2)
            if self.rng.random() < 0.3:
                body["repeat_last_n"] = self.rng.choice([-1, 0, 16, 256])
        if self.rng.random() < 0.3:
            body["top_k"] = self.rng.choice([1, 5, 40])
            body["top_p"] = self.rng.choice([0.5, 0.9, 1.0])
            body["min_p"] = self.rng.choice([0.0, 0.05])
        return "+".join(sorted(which))

    def chat_penalties(self, stream: bool) -> Plan:
        body = self._chat(self._question(), self.rng.randint(16, 96))
        case = self._penalties(body)
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("chat.penalties", case, CHAT, body)

    def text_penalties(self, stream: bool) -> Plan:
        body: dict[str, Any] = {"prompt": "Write a poem about the sea.\n", "max_tokens": 64}
        case = self._penalties(body)
        self._stream_fields(body, stream)
        self._seed(body)
        return self._plan("text.penalties", case, TEXT, body)

    def models(self, stream: bool) -> Plan:
        return Plan("models", "GET /v1/models", "/v1/models", b"", False, "ok", method="GET")

    # -- bad requests -------------------------------------------------------

    def bad(self, stream: bool) -> Plan:
        """A request the server must refuse with a 4xx (or, for the odd ones, may serve)."""
        pick = self.rng.random()
        if pick < 0.25:
            case, path, raw = self.rng.choice(BAD_RAW)
            plan = Plan("bad.invalid_json", case, path, raw, False, "4xx")
        else:
            table, expect = (BAD_FIELDS, "4xx") if pick < 0.8 else (ODD_FIELDS, "any")
            family = self.rng.choice(sorted(table))
            case, path, overrides = self.rng.choice(table[family])
            if path == CHAT:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            else:
                body = {"prompt": "hi", "max_tokens": 8}
            body = {**body, "stream": stream, **overrides}
            plan = Plan(f"bad.{family}", case, path, json.dumps(body).encode(), stream, expect)
        plan.accept_sse = self.rng.random() < 0.5 if stream else False
        return plan

    # -- the draw -----------------------------------------------------------

    def draw(self) -> Plan:
        stream = self.rng.random() < 0.6
        if self.rng.random() < self.bad_share:
            plan = self.bad(stream)
        else:
            fns = [f for f, _ in self.families]
            weights = [w for _, w in self.families]
            plan = self.rng.choices(fns, weights)[0](stream)
        if plan.method == "POST" and self.rng.random() < self.drop_share:
            plan.drop = self.drop(plan)
        return plan

    def drop(self, plan: Plan) -> Drop:
        rng = self.rng
        rst = rng.random() < 0.3
        modes = ["upload", "before_response", "bytes"] + (["chunks"] * 3 if plan.stream else [])
        mode = rng.choice(modes)
        if mode == "upload":
            return Drop(mode, rng.randint(0, max(0, len(plan.body) - 1)), rst=rst)
        if mode == "before_response":
            return Drop(
                mode, 0, delay=rng.choice([0.0, rng.uniform(0, 0.5), rng.uniform(0, 4)]), rst=rst
            )
        if mode == "bytes":
            return Drop(mode, rng.randint(1, 3000), rst=rst)
        return Drop(mode, rng.choice([0, 1, 2, rng.randint(3, 40)]), rst=rst)


# ---------------------------------------------------------------------------
# judging answers
# ---------------------------------------------------------------------------


def split_frames(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE frames in ``buf`` (without their blank line) and the incomplete rest."""
    parts = buf.replace(b"\r\n", b"\n").split(b"\n\n")
    return parts[:-1], parts[-1]


def judge_status(plan: Plan, status: int, body: bytes) -> list[tuple[str, str]]:
    """Errors implied by the status alone (5xx, or a status the request does not deserve)."""
    snippet = body[:300].decode(errors="replace")
    if status >= 500:
        return [("5xx", f"{status}: {snippet}")]
    if plan.expect == "ok" and not 200 <= status < 300:
        return [("rejected_valid", f"{status}: {snippet}")]
    if plan.expect == "4xx" and 200 <= status < 300:
        return [("accepted_invalid", f"{status}: {snippet}")]
    return []


def check_output(plan: Plan, finish: dict[int, str | None], texts: dict[Any, str]) -> list[str]:
    """``invalid_output`` details: a finished JSON answer or tool call that is not JSON.

    ``texts`` maps a choice index (JSON answers) or (choice, call) (tool-call
    arguments) to the text received.
    """
    wanted = {"json": "stop", "tool_args": "tool_calls"}.get(plan.check or "")
    bad: list[str] = []
    for key, text in texts.items():
        idx = key[0] if isinstance(key, tuple) else key
        if wanted is None or finish.get(idx) != wanted:
            continue  # cut by max_tokens, or the model answered in prose
        try:
            json.loads(text)
        except ValueError:
            bad.append(f"choice {idx} ({finish.get(idx)}): {text[:200]!r}")
    return bad


def judge_stream(plan: Plan, body: bytes) -> tuple[list[tuple[str, str]], int]:
    """Errors in a complete 200 SSE body, and the completion tokens its usage reports."""
    errors: list[tuple[str, str]] = []
    frames, rest = split_frames(body)
    if rest.strip():
        errors.append(("no_done", f"stream ends inside a frame: {rest[-120:]!r}"))
    finish: dict[int, str | None] = {}
    texts: dict[Any, str] = {}
    done = 0
    tokens = 0
    error_frame = False
    last_is_done = False
    for frame in frames:
        lines = frame.split(b"\n")
        if all(line.startswith(b":") for line in lines):
            continue  # comment (ping)
        last_is_done = False
        if lines[0].startswith(b"event:"):
            name = lines[0][6:].strip().decode(errors="replace")
            if name == "error":
                error_frame = True
                errors.append(("error_frame", frame[:400].decode(errors="replace")))
                continue
            errors.append(("bad_frame", f"unknown event {name!r}"))
            continue
        data = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
        if data == b"[DONE]":
            done += 1
            last_is_done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            errors.append(("bad_frame", repr(frame[:200])))
            continue
        usage = chunk.get("usage") or {}
        tokens = max(tokens, int(usage.get("completion_tokens") or 0))
        for choice in chunk.get("choices") or []:
            idx = int(choice.get("index", 0))
            finish.setdefault(idx, None)
            if choice.get("finish_reason"):
                finish[idx] = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if plan.check == "json":
                texts[idx] = texts.get(idx, "") + (delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                key = (idx, call.get("index", 0))
                args = (call.get("function") or {}).get("arguments") or ""
                texts[key] = texts.get(key, "") + args
    if not error_frame:
        if done != 1 or not last_is_done:
            errors.append(("no_done", f"{done} [DONE] frames, last frame {frames[-1:]!r}"[:300]))
        missing = [i for i in range(plan.choices) if finish.get(i) is None]
        if missing:
            errors.append(("unfinished_choice", f"choices without finish_reason: {missing}"))
        errors += [("invalid_output", d) for d in check_output(plan, finish, texts)]
    return errors, tokens


def judge_json(plan: Plan, body: bytes) -> tuple[list[tuple[str, str]], int]:
    """Errors in a non-streaming 200 body, and its completion tokens."""
    try:
        doc = json.loads(body)
    except ValueError:
        return [("bad_body", repr(body[:200]))], 0
    if plan.path == "/v1/models":
        ok = isinstance(doc, dict) and isinstance(doc.get("data"), list)
        return ([] if ok else [("bad_body", repr(body[:200]))]), 0
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        return [("bad_body", repr(body[:200]))], 0
    finish: dict[int, str | None] = {}
    texts: dict[Any, str] = {}
    for choice in doc["choices"]:
        idx = int(choice.get("index", 0))
        finish[idx] = choice.get("finish_reason")
        message = choice.get("message") or {}
        if plan.check == "json":
            texts[idx] = message.get("content") or ""
        for j, call in enumerate(message.get("tool_calls") or []):
            texts[(idx, j)] = (call.get("function") or {}).get("arguments") or ""
    errors: list[tuple[str, str]] = []
    missing = [i for i in range(plan.choices) if finish.get(i) is None]
    if missing:
        errors.append(("unfinished_choice", f"choices without finish_reason: {missing}"))
    errors += [("invalid_output", d) for d in check_output(plan, finish, texts)]
    tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
    return errors, tokens


# ---------------------------------------------------------------------------
# sending requests
# ---------------------------------------------------------------------------


def _headers(plan: Plan) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if plan.accept_sse:
        headers["accept"] = "text/event-stream"
    return headers


async def send_httpx(client: httpx.AsyncClient, base: str, plan: Plan) -> Outcome:
    """A request through httpx; a ``chunks`` drop closes the stream after N SSE frames."""
    out = Outcome()
    if plan.method == "GET":
        resp = await client.get(base + plan.path)
        out.status = resp.status_code
        out.errors = judge_status(plan, resp.status_code, resp.content)
        if not out.errors:
            out.errors, _ = judge_json(plan, resp.content)
        return out
    if not plan.stream:
        resp = await client.post(base + plan.path, content=plan.body, headers=_headers(plan))
        out.status = resp.status_code
        out.errors = judge_status(plan, resp.status_code, resp.content)
        if resp.status_code == 200 and plan.expect != "4xx":
            errors, out.completion_tokens = judge_json(plan, resp.content)
            out.errors += errors
        return out
    request = client.build_request(
        "POST", base + plan.path, content=plan.body, headers=_headers(plan)
    )
    resp = await client.send(request, stream=True)
    try:
        out.status = resp.status_code
        if resp.status_code != 200 or plan.drop is None:
            body = await resp.aread()
            out.errors = judge_status(plan, resp.status_code, body)
            if resp.status_code == 200 and plan.expect != "4xx":
                errors, out.completion_tokens = judge_stream(plan, body)
                out.errors += errors
            return out
        # chunks drop: read N frames, then close the connection mid-stream.
        if plan.drop.amount == 0:
            out.dropped = True  # after the response head, before the first frame
            return out
        body = b""
        async for piece in resp.aiter_raw():
            body += piece
            if len(split_frames(body)[0]) >= plan.drop.amount:
                out.dropped = True
                return out
        # The stream ended before the drop point: judge it like any other.
        out.errors, out.completion_tokens = judge_stream(plan, body)
        return out
    finally:
        await resp.aclose()


async def send_raw(host: str, port: int, plan: Plan) -> Outcome:
    """A request over a raw socket, abandoned as ``plan.drop`` says (never a ``chunks`` drop)."""
    assert plan.drop is not None
    drop = plan.drop
    out = Outcome()
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"{plan.method} {plan.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(plan.body)}\r\n"
        + ("Accept: text/event-stream\r\n" if plan.accept_sse else "")
        + "Connection: close\r\n\r\n"
    ).encode()
    try:
        if drop.mode == "upload":
            writer.write(head + plan.body[: drop.amount])
            await writer.drain()
            await asyncio.sleep(random.uniform(0, 0.2))
            out.dropped = True
            return out
        writer.write(head + plan.body)
        await writer.drain()
        if drop.mode == "before_response":
            await asyncio.sleep(drop.delay)
            out.dropped = True
            return out
        data = b""
        while len(data) < drop.amount:
            piece = await reader.read(4096)
            if not piece:
                break
            data += piece
        out.dropped = len(data) >= drop.amount
        match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
        if match:
            out.status = int(match.group(1))
            head_end = data.find(b"\r\n\r\n")
            out.errors = judge_status(plan, out.status, data[head_end + 4 :])
            if not out.dropped and out.status == 200 and plan.stream and plan.expect != "4xx":
                # A complete (chunked) body: only the frame markers are checked.
                if b"event: error" in data:
                    out.errors.append(
                        (
                            "error_frame",
                            data[data.find(b"event: error") :][:300].decode(errors="replace"),
                        )
                    )
                elif b"data: [DONE]" not in data:
                    out.errors.append(("no_done", "raw body without data: [DONE]"))
        elif not out.dropped:
            out.errors = [("transport", f"connection closed after {len(data)} bytes: {data!r}")]
        return out
    finally:
        if drop.rst:
            with contextlib.suppress(OSError):
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await writer.wait_closed()


async def run_one(client: httpx.AsyncClient, base: str, plan: Plan, hang_after: float) -> Outcome:
    """Send one plan within the hang bound and classify what happened."""
    parts = urlsplit(base)
    start = time.monotonic()
    try:
        if plan.drop is not None and plan.drop.mode != "chunks":
            coro = send_raw(parts.hostname or "127.0.0.1", parts.port or 80, plan)
        else:
            coro = send_httpx(client, base, plan)
        out = await asyncio.wait_for(coro, hang_after)
    except TimeoutError:
        out = Outcome(errors=[("hang", f"no answer within {hang_after:g}s")])
    except (httpx.TransportError, OSError) as exc:
        out = Outcome(errors=[("transport", f"{type(exc).__name__}: {exc}")])
    except Exception as exc:  # noqa: BLE001 - a bug in this script: keep soaking, say so
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        out = Outcome(errors=[("client_bug", tb)])
    out.seconds = time.monotonic() - start
    return out


# ---------------------------------------------------------------------------
# bookkeeping
# ---------------------------------------------------------------------------


@dataclass
class TypeStats:
    count: int = 0
    dropped: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "count": self.count,
            "dropped": self.dropped,
            "statuses": dict(sorted(self.statuses.items())),
            "errors": dict(sorted(self.errors.items())),
            "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
            "latency_max_s": round(lat[-1], 3) if lat else None,
            "completion_tokens": self.completion_tokens,
        }


@dataclass
class Tally:
    types: dict[str, TypeStats] = field(default_factory=dict)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, plan: Plan, out: Outcome) -> None:
        st = self.types.setdefault(plan.type, TypeStats())
        st.count += 1
        st.dropped += out.dropped
        st.statuses[str(out.status) if out.status is not None else "none"] += 1
        st.latencies.append(out.seconds)
        st.completion_tokens += out.completion_tokens
        for kind, detail in out.errors:
            st.errors[kind] += 1
            shown = self.examples.setdefault(kind, [])
            if len(shown) < MAX_EXAMPLES_PER_KIND:
                body = plan.body.decode(errors="replace")
                shown.append(
                    {
                        "type": plan.type,
                        "case": plan.case,
                        "path": plan.path,
                        "accept_sse": plan.accept_sse,
                        "drop": plan.drop.describe() if plan.drop else None,
                        "status": out.status,
                        "seconds": round(out.seconds, 2),
                        "detail": detail[:500],
                        "body": body
                        if len(body) <= 3000
                        else body[:3000] + f"... ({len(body)} chars)",
                    }
                )

    def errors(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for st in self.types.values():
            total.update(st.errors)
        return total


def rss_mb(pid: int | None) -> float | None:
    """VmRSS of a process in MB, from /proc (None if unknown or gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


async def health(client: httpx.AsyncClient, base: str) -> dict[str, Any] | None:
    try:
        resp = await client.get(base + "/health", timeout=10)
        doc = resp.json() if resp.status_code == 200 else None
        return doc if isinstance(doc, dict) else None
    except (httpx.HTTPError, ValueError):
        return None


async def sampler(
    client: httpx.AsyncClient,
    base: str,
    pid: int | None,
    every: float,
    t0: float,
    samples: list[dict[str, Any]],
    stop: asyncio.Event,
    proc: subprocess.Popen[bytes] | None,
) -> None:
    """Sample RSS and /health every ``every`` seconds until ``stop`` is set."""
    while not stop.is_set():
        samples.append(await sample(client, base, pid, t0))
        if proc is not None and proc.poll() is not None:
            stop.set()  # the server died: the clients stop too
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def sample(
    client: httpx.AsyncClient, base: str, pid: int | None, t0: float
) -> dict[str, Any]:
    start = time.monotonic()
    h = await health(client, base)
    slots = (h or {}).get("slots") or {}
    engine = (h or {}).get("engine") or {}
    return {
        "t": round(start - t0, 2),
        "rss_mb": rss_mb(pid),
        "health_ms": round((time.monotonic() - start) * 1000, 1) if h else None,
        "active": slots.get("active"),
        "queued": slots.get("queued"),
        "tokens_generated": engine.get("tokens_generated"),
        "prompt_tokens": engine.get("prompt_tokens_processed"),
    }


async def client_loop(
    client: httpx.AsyncClient,
    base: str,
    mixer: Mixer,
    tally: Tally,
    deadline: float,
    hang_after: float,
    stop: asyncio.Event,
) -> None:
    while time.monotonic() < deadline and not stop.is_set():
        plan = mixer.draw()
        tally.add(plan, await run_one(client, base, plan, hang_after))


# ---------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------


def start_server(args: argparse.Namespace, log_path: Path) -> Server:
    """``sluice serve`` on a free port, output to ``log_path``; waits for /health."""
    port = free_port()
    cmd = [*SLUICE, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--threads", str(args.threads), "--parallel", str(args.parallel)]
    return Server("sluice", [*cmd, "--log-level", "warning", *args.server_arg], port, log_path)


def scan_log(path: Path | None) -> dict[str, Any]:
    """Tracebacks and ERROR lines in the server's log (distinct final exception lines)."""
    if path is None or not path.exists():
        return {"tracebacks": None, "error_lines": None, "exceptions": []}
    lines = path.read_text(errors="replace").splitlines()
    exceptions: Counter[str] = Counter()
    tracebacks = 0
    in_tb = False
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            tracebacks += 1
            in_tb = True
        elif in_tb and line and not line.startswith((" ", "Traceback")):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not nxt.startswith(" ") or "During handling" in nxt or not nxt:
                exceptions[line[:200]] += 1
                in_tb = False
    error_lines = sum(1 for line in lines if re.search(r"\bERROR\b|\bCRITICAL\b", line))
    return {
        "tracebacks": tracebacks,
        "error_lines": error_lines,
        "exceptions": [{"line": k, "count": v} for k, v in exceptions.most_common(15)],
    }


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------


async def soak(
    args: argparse.Namespace, base: str, pid: int | None, proc: subprocess.Popen[bytes] | None
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    mixer = Mixer(rng, args.drop_share, args.bad_share)
    tally = Tally()
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    duration = args.minutes * 60
    # Idle connections expire before uvicorn's 5 s keep-alive timeout closes them, so a
    # request never races the server closing its connection (a false transport error).
    limits = httpx.Limits(
        max_connections=args.concurrency * 2,
        max_keepalive_connections=args.concurrency,
        keepalive_expiry=2.0,
    )
    timeout = httpx.Timeout(args.hang_after + 30)
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
        httpx.AsyncClient(timeout=10) as probe,
    ):
        t0 = time.monotonic()
        first = await sample(probe, base, pid, t0)
        samples.append(first)
        sampling = asyncio.create_task(
            sampler(probe, base, pid, args.sample_every, t0, samples, stop, proc)
        )
        deadline = t0 + duration
        progress = asyncio.create_task(report_progress(tally, t0, duration, stop))
        await asyncio.gather(
            *(
                client_loop(client, base, mixer, tally, deadline, args.hang_after, stop)
                for _ in range(args.concurrency)
            )
        )
        clients_done = time.monotonic()
        died = proc is not None and proc.poll() is not None
        # Settle: wait for the server to finish (and forget) everything.
        settle_start = time.monotonic()
        final: dict[str, Any] = {}
        idle_after: float | None = None
        while not died:
            final = await sample(probe, base, pid, t0)
            if final["active"] == 0 and final["queued"] == 0:
                idle_after = time.monotonic() - settle_start
                break
            if time.monotonic() - settle_start > args.settle:
                break
            await asyncio.sleep(0.5)
        stop.set()
        await sampling
        progress.cancel()
        if not died:
            final = await sample(probe, base, pid, t0)
            samples.append(final)
    return summarize(args, tally, samples, first, final, t0, clients_done, idle_after, died)


async def report_progress(tally: Tally, t0: float, duration: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(30)
        n = sum(st.count for st in tally.types.values())
        errs = dict(tally.errors())
        print(
            f"  [{time.monotonic() - t0:5.0f}s / {duration:.0f}s] {n} requests, errors {errs}",
            flush=True,
        )


def summarize(
    args: argparse.Namespace,
    tally: Tally,
    samples: list[dict[str, Any]],
    first: dict[str, Any],
    final: dict[str, Any],
    t0: float,
    clients_done: float,
    idle_after: float | None,
    died: bool,
) -> dict[str, Any]:
    run_s = clients_done - t0
    warmup = min(60.0, 0.1 * args.minutes * 60)
    rss = [s for s in samples if s["rss_mb"] is not None]
    base_sample = next((s for s in rss if s["t"] >= warmup), rss[0] if rss else None)
    start_mb = base_sample["rss_mb"] if base_sample else None
    end_mb = final.get("rss_mb")
    drift_mb = end_mb - start_mb if start_mb is not None and end_mb is not None else None
    errors = tally.errors()
    total = sum(st.count for st in tally.types.values())
    dropped = sum(st.dropped for st in tally.types.values())
    gen = (final.get("tokens_generated") or 0) - (first.get("tokens_generated") or 0)
    prompt = (final.get("prompt_tokens") or 0) - (first.get("prompt_tokens") or 0)
    leaked = {
        "active": final.get("active"),
        "queued": final.get("queued"),
        "idle_after_s": round(idle_after, 2) if idle_after is not None else None,
    }
    leaked_n = (final.get("active") or 0) + (final.get("queued") or 0)
    health_ms = [s["health_ms"] for s in samples if s["health_ms"] is not None]
    reasons = []
    if errors["5xx"]:
        reasons.append(f"{errors['5xx']} responses with a 5xx status")
    if errors["hang"]:
        reasons.append(f"{errors['hang']} requests hung (> {args.hang_after:g}s)")
    if not died and (leaked_n or idle_after is None):
        reasons.append(f"slots not idle {args.settle:g}s after the clients stopped: {leaked}")
    if died:
        reasons.append("the server died")
    return {
        "finished": now().isoformat(timespec="seconds"),
        "config": {
            "minutes": args.minutes,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "drop_share": args.drop_share,
            "bad_share": args.bad_share,
            "hang_after_s": args.hang_after,
            "settle_s": args.settle,
            "url": args.url,
            "threads": None if args.url else args.threads,
            "parallel": None if args.url else args.parallel,
            "server_args": args.server_arg,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        },
        "totals": {
            "requests": total,
            "dropped": dropped,
            "requests_per_s": round(total / run_s, 2) if run_s else None,
            "run_s": round(run_s, 1),
            "errors": {k: errors[k] for k in ERROR_KINDS if errors[k]},
            "5xx": errors["5xx"],
            "hangs": errors["hang"],
            "leaked_slots": leaked_n,
        },
        "slots_after_settle": leaked,
        "throughput": {
            "engine_tokens_generated": gen,
            "engine_prompt_tokens": prompt,
            "tok_s": round(gen / run_s, 1) if run_s else None,
            "client_completion_tokens": sum(st.completion_tokens for st in tally.types.values()),
        },
        "rss": {
            "start_mb": _r(start_mb),
            "start_at_s": base_sample["t"] if base_sample else None,
            "end_mb": _r(end_mb),
            "drift_mb": _r(drift_mb),
            "drift_pct": _r(100 * drift_mb / start_mb)
            if drift_mb is not None and start_mb
            else None,
            "max_mb": _r(max((s["rss_mb"] for s in rss), default=None)),
            "first_mb": _r(rss[0]["rss_mb"]) if rss else None,
        },
        "health": {
            "max_ms": max(health_ms, default=None),
            "p50_ms": round(statistics.median(health_ms), 1) if health_ms else None,
            "unanswered": sum(1 for s in samples if s["health_ms"] is None),
        },
        "types": {k: tally.types[k].row() for k in sorted(tally.types)},
        "examples": tally.examples,
        "samples": samples,
        "verdict": {"pass": not reasons, "reasons": reasons},
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


def _fmt_counter(d: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in d.items()) or "-"


def type_table(result: dict[str, Any]) -> list[list[str]]:
    rows = [["type", "n", "drop", "statuses", "errors", "p50 s", "max s"]]
    for name, st in result["types"].items():
        rows.append(
            [
                name,
                str(st["count"]),
                str(st["dropped"]),
                _fmt_counter(st["statuses"]),
                _fmt_counter(st["errors"]),
                f"{st['latency_p50_s']}",
                f"{st['latency_max_s']}",
            ]
        )
    return rows


def summary_lines(result: dict[str, Any]) -> list[tuple[str, str]]:
    t, rss, tp, h = result["totals"], result["rss"], result["throughput"], result["health"]
    server = result.get("server", {})
    slots = {k: v for k, v in result["slots_after_settle"].items() if v is not None}
    verdict = result["verdict"]
    requests = f"{t['requests']} in {t['run_s']}s ({t['requests_per_s']}/s)"
    served = f"{tp['engine_tokens_generated']} generated, {tp['engine_prompt_tokens']} prompt"
    end = f"{rss['end_mb']} MB"
    return [
        ("requests", f"{requests}, {t['dropped']} dropped by the client"),
        ("errors", _fmt_counter(t["errors"])),
        ("5xx", str(t["5xx"])),
        ("hangs", str(t["hangs"])),
        ("slots after settle", _fmt_counter(slots)),
        *(
            [
                ("RSS start / end", f"{rss['start_mb']} MB (at {rss['start_at_s']}s) / {end}"),
                ("RSS drift", f"{rss['drift_mb']} MB ({rss['drift_pct']}%)"),
                ("RSS max / first", f"{rss['max_mb']} MB / {rss['first_mb']} MB"),
            ]
            if rss["first_mb"] is not None
            else [("RSS", "not sampled (--url without --pid)")]
        ),
        ("tok/s served", f"{tp['tok_s']} (tokens: {served})"),
        ("/health latency", f"p50 {h['p50_ms']} ms, max {h['max_ms']} ms, {h['unanswered']} lost"),
        (
            "server log",
            f"{server['log']}: {server['tracebacks']} tracebacks"
            if server.get("log")
            else "not read (--url)",
        ),
        ("verdict", "PASS" if verdict["pass"] else "FAIL: " + "; ".join(verdict["reasons"])),
    ]


def print_report(result: dict[str, Any]) -> None:
    rows = type_table(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    for key, value in summary_lines(result):
        print(f"{key:>20}: {value}")
    for exc in result.get("server", {}).get("exceptions", []):
        print(f"{'':>20}  {exc['count']}x {exc['line']}")


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    flags = ["--threads", str(c["threads"]), "--parallel", str(c["parallel"]), *c["server_args"]]
    out = [
        f"# Soak {result['started']}",
        "",
        (
            f"{c['minutes']:g} min, {c['concurrency']} clients, seed {c['seed']}, "
            f"{c['drop_share']:.0%} dropped, {c['bad_share']:.0%} bad requests, "
            f"hang bound {c['hang_after_s']:g} s; server {c['url'] or ' '.join(flags)}; "
            f"{c['machine']}."
        ),
        "",
        "| | |",
        "|---|---|",
    ]
    out += [f"| {k} | {v.replace('|', '/')} |" for k, v in summary_lines(result)]
    for exc in result.get("server", {}).get("exceptions", []):
        out.append(f"| server exception | {exc['count']}x `{exc['line']}` |")
    rows = type_table(result)
    out += ["", "## Per request type", "", render_table(rows[0], rows[1:], markdown=True)]
    if result["examples"]:
        out += ["", "## Examples of errors", ""]
        for kind, shown in result["examples"].items():
            out.append(f"### {kind}")
            out.append("")
            for ex in shown:
                out.append(
                    f"- `{ex['type']}` {ex['case']} (drop {ex['drop']}, accept_sse "
                    f"{ex['accept_sse']}, status {ex['status']}, {ex['seconds']} s): "
                    f"{ex['detail'][:300]!r}"
                )
                out.append(f"  - body: `{ex['body'][:300]}`")
            out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, default=10.0, help="run length (default 10)")
    p.add_argument("--concurrency", type=int, default=12, help="concurrent clients (default 12)")
    p.add_argument("--url", help="soak this running server instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    p.add_argument("--threads", type=int, default=1, help="server --threads (default 1)")
    p.add_argument("--parallel", type=int, default=4, help="server --parallel (default 4)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for sluice serve (repeat; e.g. --server-arg=--ctx)",
    )
    p.add_argument("--server-log", type=Path, help="server output file (default: in /tmp)")
    p.add_argument("--seed", type=int, default=None, help="seed of the request mix")
    p.add_argument("--drop-share", type=float, default=0.25, help="share dropped (0.25)")
    p.add_argument("--bad-share", type=float, default=0.12, help="share of bad requests (0.12)")
    p.add_argument(
        "--hang-after",
        type=float,
        default=300.0,
        help="seconds after which a request counts as hung (default 300)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="seconds to wait for idle slots after the clients stop (default 30)",
    )
    p.add_argument(
        "--sample-every",
        type=float,
        default=3.0,
        help="seconds between RSS and /health samples (default 3)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=RESULTS,
        help="where soak-<date>.{json,md} go (default benchmarks/results)",
    )
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(2**31)

    started = now()
    when = stamp(started)
    server: Server | None = None
    log_path: Path | None = None
    if args.url:
        base, pid = args.url.rstrip("/"), args.pid
    else:
        log_path = args.server_log or Path(tempfile.gettempdir()) / f"sluice-soak-{when}.log"
        server = start_server(args, log_path)
        base, pid = server.base, server.pid
    print(
        f"soak: {base} (pid {pid}), {args.minutes:g} min, {args.concurrency} clients, "
        f"seed {args.seed}",
        flush=True,
    )
    exit_code: int | None = None
    try:
        result = asyncio.run(soak(args, base, pid, server.proc if server else None))
    finally:
        if server is not None:
            exit_code = server.close(timeout=30)
    result["started"] = started.isoformat(timespec="seconds")
    result["server"] = {
        "url": base,
        "pid": pid,
        "log": str(log_path) if log_path else None,
        "exit_code": exit_code,
        **scan_log(log_path),
    }
    print_report(result)
    print()
    save_report(args.out_dir, f"soak-{when}", result, markdown(result))
    return 0 if result["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
