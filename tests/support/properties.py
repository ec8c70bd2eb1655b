"""Property-based hardening: request bodies, and the checks of what a server answers.

The strategies build request bodies for ``/v1/chat/completions`` and
``/v1/completions`` five ways, for a server over real HTTP (the real app on
the scripted runner, or ``sluice serve`` on the real model):

* **schema**: from the wire schemas (``ChatCompletionRequest`` /
  ``CompletionRequest.model_json_schema()``), with domain strategies for the
  open fields: tools, ``tool_choice``, ``response_format``, ``logit_bias``,
  ``stop``, ``prompt``;
* **structured**: valid chat bodies whose tools or ``response_format`` carry a
  random JSON schema (huge bounds, patterns, ``$ref``, ``enum``, nesting,
  keywords of the wrong type);
* **valid**: well-formed bodies with a random set of features;
* **tree**: valid bodies with a subtree replaced by a hostile JSON value
  (lone surrogates, control chars, control-token text, huge or negative
  numbers, ``1e308``, deep nesting, big arrays, wrong types, nulls) or by an
  odd value of its own type, a field deleted, or a known or unknown field added;
* **bytes**: the JSON text of a body mutated as bytes (truncation, invalid
  UTF-8, other encodings, ``NaN``/``Infinity``, huge numbers, deep nesting).

Every answer is checked by :func:`check_answer`: never a 5xx (nor a
``server_error`` frame inside a 200 stream, nor a dropped connection); an
answer within a time bound; every 4xx the OpenAI error JSON whose message
names its ``param`` (or one ``event: error`` frame for a stream sent with
``Accept: text/event-stream``); a 200 stream well formed (ends with
``data: [DONE]`` or an error frame); a body that is not UTF-8 or holds a lone
surrogate never accepted; a valid body answered 200. After each answer
``/health`` must answer with no slot active or queued.

``REGRESSIONS`` are explicit examples of bodies that once broke the server (a
500, a hang, a memory blow-up), run apart from the search so that one still
failing does not stop it. ``tests/dialects/openai/test_properties.py`` runs
the strategies on the scripted runner (profile ``UNIT``),
``test_properties_real_model.py`` beside it on the real model: each bounded
by a :class:`Profile` (what one example may cost).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import HealthCheck, event, example, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from sluice.core.request import SamplingParams
from sluice.dialects.openai.schema import ChatCompletionRequest, CompletionRequest
from tests.support.fakes import EOS_ID, FakeSampler, ScriptedRunner
from tests.support.helpers import CHAT, TEXT

# -- what one example may cost ------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """Bounds that keep one example cheap on a given server."""

    max_tokens: SearchStrategy[int]  # max_tokens / max_completion_tokens of generated bodies
    n: SearchStrategy[int]  # choices of generated bodies
    text_size: int  # longest generated text
    vocab: int  # token ids below this are in the vocabulary
    huge_bodies: bool  # also send bodies of a megabyte and more
    max_body_bytes: int  # the server's limit (a raw value just past it gets a 413)
    answer_within: float  # seconds for a whole answer (no hang)
    idle_within: float  # seconds for the slots to be free again afterwards
    always: tuple[str, ...] = ()  # fields every schema-generated body has (cost bounds)


UNIT = Profile(
    max_tokens=st.integers(1, 64) | st.sampled_from([1, 10**6, 2**31 - 1, 2**63 - 1]),
    n=st.integers(1, 16),
    text_size=40,
    vocab=0xD000,  # every id below it is a character of the scripted runner
    huge_bodies=True,
    max_body_bytes=1 << 20,
    answer_within=20.0,
    idle_within=5.0,
)


# -- a case: one request ------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One request: endpoint, raw body bytes, headers, and what is known about the body."""

    path: str
    raw: bytes
    accept: str | None = None
    content_type: str | None = "application/json"
    stream: bool | None = None  # the body's "stream" when known (None: a byte mutation)
    valid: bool = False  # well formed by construction: must get a 200
    script: int = 0  # the scripted runner's output (index into SCRIPTS; unit only)
    how: str = ""  # which generator, for statistics

    def headers(self) -> dict[str, str]:
        out = {}
        if self.accept is not None:
            out["accept"] = self.accept
        if self.content_type is not None:
            out["content-type"] = self.content_type
        return out

    def __repr__(self) -> str:
        raw = self.raw
        if len(raw) > 800:
            raw = raw[:400] + b"...<%d bytes in all>..." % len(raw) + raw[-200:]
        extra = "".join(
            f", {f}={getattr(self, f)!r}"
            for f in ("accept", "content_type", "stream", "valid", "script")
            if getattr(self, f) != getattr(Case, f)
        )
        return f"Case({self.path!r}, {raw!r}{extra})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis's printer
        p.text(repr(self))


class Raw:
    """JSON text spliced into a body as is: what ``json.dumps`` cannot write."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        t = self.text
        return f"Raw({t if len(t) <= 40 else t[:20] + f'...<{len(t)}>...' + t[-10:]})"

    def __deepcopy__(self, memo: Any) -> Raw:
        return self


def encode_body(body: Any, *, ascii_only: bool = True) -> bytes:
    """JSON bytes of ``body`` with :class:`Raw` values spliced in.

    ``ascii_only=False`` writes lone surrogates as CESU-8 bytes (invalid UTF-8)
    instead of ``\\ud800`` escapes.
    """
    raws: list[str] = []

    def swap(node: Any) -> Any:
        if isinstance(node, Raw):
            raws.append(node.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return node

    text = json.dumps(swap(body), ensure_ascii=ascii_only)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw, 1)
    return text.encode("utf-8", "surrogatepass")


def make_case(path: str, body: Any, **kw: Any) -> Case:
    """A case for a body given as a tree (with :class:`Raw` values) or as raw bytes."""
    if isinstance(body, bytes):
        return Case(path, body, **kw)
    # Known only for a real bool or none at all: validation coerces 1, "true", "yes"...
    stream = body.get("stream", False) if isinstance(body, dict) else False
    return Case(path, encode_body(body), stream=stream if isinstance(stream, bool) else None, **kw)


# -- hostile values ------------------------------------------------------------------

CONTROL_TEXT = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "<eos>",
    "<s>",
    "</s>",
    "[INST]",
    "[TOOL_CALLS]",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<|python_tag|>",
]
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\r\n",
    "\u2028",
    "\ufeff",
    "\ud800",
    "\udfff",
    "a\udbffb",
    "\ud83d\ude00",  # a valid pair: json.dumps writes it as two escapes that decode to one char
    "\U0001f600",
    "²",
    "٣",
    "𝟙",
    "-5",
    "--5",
    "+5",
    " 5",
    "0x10",
    "1e3",
    "NaN",
    "null",
    "{{ raise_exception('x') }}",
    "{% for x in range(10**9) %}x{% endfor %}",
    '{"name": "get_weather", "arguments": {}}',
    "\\",
    '"',
    "x" * 300,
]
ODD_CHARS = ["\x00", "\x1f", "\x7f", "\u2028", "\ufeff", "\ud800", "\udc00", "\U0010ffff", "²"]
BIG_INTS = [
    0,
    -1,
    1,
    2,
    16,
    17,
    255,
    49152,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    10**19,
    10**20,
    10**30,
]
ODD_FLOATS = [0.0, -0.0, 0.5, 1e-300, 5e-324, 1e308, -1e308, 1.7976931348623157e308, 100.0001]


def raw_values(profile: Profile) -> list[Raw]:
    """JSON that Python objects cannot express, or that is costly to build as objects."""

    def nest(depth: int, open_: str = "[", close: str = "]", inner: str = "") -> str:
        return open_ * depth + inner + close * depth

    texts = [
        "NaN",
        "Infinity",
        "-Infinity",
        "1e999",
        "-1e999",
        "1e-999",
        "9" * 5000,
        "-" + "1" * 30,
        "1" * 20,
        "1" * 21,
        "1" + "0" * 400 + ".5",
        "-0",
        '"\\ud800"',
        '"x\\udfff"',
        '"\\udc00\\ud800"',
        '"\\ud83d\\ude00"',
        '"\\u0000"',
        nest(63),
        nest(64),
        nest(65),
        nest(1000),
        nest(100_000),
        nest(1000, '{"a":', "}", "1"),
        "[" + ",".join(["0"] * 20_000) + "]",
        "{" + ",".join(f'"{i}":1' for i in range(5000)) + "}",
        "[" + ",".join(['{"role":"user","content":"hi"}'] * 5000) + "]",
    ]
    if profile.huge_bodies:
        texts.append('"' + "a" * 200_000 + '"')
        texts.append('"' + "a" * (profile.max_body_bytes + 1) + '"')  # a 413
    return [Raw(t) for t in texts]


def texts(size: int) -> SearchStrategy[str]:
    """Mostly plain text; sometimes control-token text, odd characters or lone surrogates."""
    plain = st.text(max_size=size)
    odd = st.one_of(
        st.sampled_from(CONTROL_TEXT + ODD_STRINGS),
        st.text(
            alphabet=st.one_of(st.characters(), st.sampled_from(ODD_CHARS)),
            max_size=size,
        ),
        st.tuples(plain, st.sampled_from(CONTROL_TEXT + ODD_STRINGS), plain).map("".join),
    )
    return st.one_of(plain, plain, odd)


def json_values(size: int) -> SearchStrategy[Any]:
    """Any JSON value (no :class:`Raw`), leaning to the awkward."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from(BIG_INTS),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from(ODD_FLOATS),
        texts(size),
    )
    return st.recursive(
        scalars,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(texts(8), c, max_size=4),
        max_leaves=8,
    )


# -- random JSON schemas ----------------------------------------------------------------

SCHEMA_BOUNDS = st.one_of(
    st.integers(-2, 12),
    st.sampled_from(
        [0, 255, 256, 4096, 4097, 65536, 10**6, 10**9, 2**31, 2**53, 10**18, 10**30, -(10**9)]
    ),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1.5, 1e308, -1e308, "5", None, True]),
)
PATTERNS = [
    "^[a-z]+$",
    "^\\d{3}-\\d{4}$",
    "^(a|b)*$",
    "^(?:ab)+c?$",
    "^[^\\s]{1,8}$",
    "^.*$",
    "^[\\w\\s]*$",
    "^a{0,4096}$",
    "^a{1000000000}$",
    "^a{2,1}$",
    "^(a*)*$",
    "^(((((a)))))$",
    "^\\p{L}+$",
    "^(?=x)x$",
    "^[z-a]$",
    "^\\ud800$",
    "^[\\ud800-\\udfff]$",
    "[a-z]+",
    "a$",
    "^a",
    "(",
    ")",
    "^[$",
    "^a{99999999999999999999}$",
    "^\\1$",
    "",
]
FORMATS = ["date-time", "date", "time", "email", "uuid", "uri", "ipv4", "hostname", "bogus"]
SCHEMA_KEYWORDS = [
    "type",
    "properties",
    "required",
    "items",
    "prefixItems",
    "additionalProperties",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "$ref",
    "$defs",
    "definitions",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "pattern",
    "format",
    "minProperties",
    "maxProperties",
    "patternProperties",
    "uniqueItems",
]
SCHEMA_TYPES = ["string", "integer", "number", "boolean", "null", "object", "array"]
REFS = [
    "#",
    "#/$defs/a",
    "#/definitions/a",
    "#/$defs/missing",
    "#/properties/a",
    "#/$defs/a/properties/b",
    "#/$defs/a~1b",
    "#/$defs/%61",
    "http://example.com/schema.json",
    "other.json#/a",
    "",
]
PROPERTY_NAMES = ["a", "b", "city", "x y", "", "$ref", "__proto__", "\ud800", "<|im_end|>"]


def json_schemas(size: int = 12) -> SearchStrategy[Any]:
    """Random JSON schemas: mostly plausible, with huge bounds, odd patterns, bad refs."""
    value = json_values(size)
    names = st.one_of(st.sampled_from(PROPERTY_NAMES), st.text(max_size=6))
    string = st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "minLength": SCHEMA_BOUNDS,
            "maxLength": SCHEMA_BOUNDS,
            "pattern": st.sampled_from(PATTERNS) | texts(size),
            "format": st.sampled_from(FORMATS),
            "enum": st.lists(texts(size), max_size=4),
        },
    )
    number = st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={
            "minimum": SCHEMA_BOUNDS,
            "maximum": SCHEMA_BOUNDS,
            "exclusiveMinimum": SCHEMA_BOUNDS,
            "exclusiveMaximum": SCHEMA_BOUNDS,
            "multipleOf": SCHEMA_BOUNDS,
        },
    )
    simple = st.sampled_from(
        [
            {"type": "boolean"},
            {"type": "null"},
            {},
            True,
            False,
            {"type": ["string", "null"]},
            {"type": ["integer", "string", "object"]},
            {"type": []},
            {"type": "bogus"},
            {"type": 5},
            {"not": {}},
            {"type": "object"},
            {"type": "array"},
        ]
    )
    literal = st.one_of(
        st.lists(value, max_size=4).map(lambda v: {"enum": v}),
        value.map(lambda v: {"const": v}),
    )
    ref = st.sampled_from(REFS).map(lambda r: {"$ref": r})
    # A keyword with a value of any type: {"type": "object", "properties": [1]} and the like.
    garbage = st.builds(
        lambda t, kw: {"type": t, **kw},
        st.sampled_from(SCHEMA_TYPES),
        st.dictionaries(st.sampled_from(SCHEMA_KEYWORDS), value, min_size=1, max_size=3),
    )
    leaf = st.one_of(string, number, simple, literal, ref, garbage)

    def extend(children: SearchStrategy[Any]) -> SearchStrategy[Any]:
        obj = st.fixed_dictionaries(
            {"type": st.just("object")},
            optional={
                "properties": st.dictionaries(names, children, max_size=4),
                "required": st.lists(names, max_size=3),
                "additionalProperties": st.booleans() | children,
                "minProperties": SCHEMA_BOUNDS,
                "maxProperties": SCHEMA_BOUNDS,
                "patternProperties": st.dictionaries(
                    st.sampled_from(PATTERNS), children, max_size=2
                ),
            },
        )
        array = st.fixed_dictionaries(
            {"type": st.just("array")},
            optional={
                "items": children | st.lists(children, max_size=3),
                "prefixItems": st.lists(children, max_size=3),
                "minItems": SCHEMA_BOUNDS,
                "maxItems": SCHEMA_BOUNDS,
                "uniqueItems": st.booleans(),
            },
        )
        combined = st.builds(
            lambda k, xs: {k: xs},
            st.sampled_from(["anyOf", "oneOf", "allOf"]),
            st.lists(children, max_size=3),
        )
        with_defs = st.builds(
            lambda k, defs, root: {**root, k: defs} if isinstance(root, dict) else root,
            st.sampled_from(["$defs", "definitions"]),
            st.dictionaries(st.sampled_from(["a", "b", "a/b"]), children, max_size=2),
            children,
        )
        return st.one_of(obj, array, combined, with_defs)

    return st.recursive(leaf, extend, max_leaves=6)


# -- the strategies, for one profile ----------------------------------------------------

TOOL_NAMES = ["get_weather", "lookup", "f", "a.b-c_1"]
VALID_PARAMETERS = [
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 10}}},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {}},
    {},
]
VALID_SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "string", "enum": ["yes", "no"]},
    {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"type": "null"}},
    },
]
SCRIPTS: list[list[bytes]] = [
    [b"Hello", b" world", b"!"],
    [b"<tool_call>", b"\n", b'{"name": "get_weather", "arguments": {"city": "Paris"}}', b"\n"]
    + [b"</tool_call>"],
    [b"<tool_call>", b'{"name": ', b"\xff", b"\xe2\x82"],
    [b"<think>", b"hmm", b"</think>", b"ok"],
    [b"\xe2\x82", b"\xac", b"\xf0\x9f"],
    [b"<|im_end|>", b"<|im_start|>", b"x"],
    [b'{"a": ', b"1}"],
    [],
    [b"x"] * 40,
]


class Strategies:
    """Every body strategy, bounded by ``profile``."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        size = profile.text_size
        self.text = texts(size)
        self.plain = st.text(max_size=size)
        self.values = json_values(size)
        self.raws = st.sampled_from(raw_values(profile))
        self.hostile = st.one_of(
            self.values,
            self.values,
            self.raws,
            st.sampled_from([None, {}, [], "", 0, -1, True, 1e308, [None], {"": None}]),
        )
        self.token_id = st.integers(0, profile.vocab - 1)
        self.schemas = json_schemas(size)
        self.accept = st.sampled_from([None, "text/event-stream", "application/json", "*/*"])
        self.script = st.integers(0, len(SCRIPTS) - 1)

        chat_schema = ChatCompletionRequest.model_json_schema()
        text_schema = CompletionRequest.model_json_schema()
        self.chat_fields = sorted(chat_schema["properties"])
        self.text_fields = sorted(text_schema["properties"])
        overrides = self._overrides()
        self.schema_chat = from_schema(chat_schema, chat_schema, overrides, always=profile.always)
        self.schema_text = from_schema(text_schema, text_schema, overrides, always=profile.always)

    # -- field strategies (the open parts of the wire schemas) ---------------------

    def _overrides(self) -> dict[str, SearchStrategy[Any]]:
        p = self.profile
        tool_name = st.sampled_from(TOOL_NAMES) | self.text
        tool = st.one_of(
            st.builds(
                lambda name, desc, params: {
                    "type": "function",
                    "function": {"name": name, "description": desc, "parameters": params},
                },
                tool_name,
                self.plain,
                self.schemas | st.sampled_from(VALID_PARAMETERS),
            ),
            st.dictionaries(st.sampled_from(["type", "function"]), self.values, max_size=2),
        )
        return {
            "content": st.one_of(
                self.text,
                st.none(),
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image_url", "input_audio", ""])},
                        optional={"text": self.text | self.values},
                    ),
                    max_size=3,
                ),
            ),
            "text": self.text,
            "name": tool_name,
            "model": st.sampled_from(["smollm2", "local-model", "scripted"]) | self.text,
            # Mostly in bounds: an odd value here hides every other field of the body.
            "max_tokens": st.one_of(
                p.max_tokens, p.max_tokens, p.max_tokens, st.integers(max_value=0)
            ),
            "max_completion_tokens": p.max_tokens | st.integers(max_value=0),
            "n": st.one_of(p.n, p.n, st.integers()),
            "seed": st.integers() | st.sampled_from(BIG_INTS),
            "top_k": st.integers() | st.sampled_from(BIG_INTS),
            "repeat_last_n": st.integers() | st.sampled_from(BIG_INTS),
            "tools": st.lists(tool, max_size=3),
            "tool_choice": st.one_of(
                st.sampled_from(["none", "auto", "required", "any", ""]),
                st.builds(lambda name: {"type": "function", "function": {"name": name}}, tool_name),
                st.builds(lambda fn: {"type": "function", "function": fn}, self.values),
                st.dictionaries(st.sampled_from(["type", "function"]), self.values, max_size=2),
            ),
            "response_format": st.one_of(
                st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "bogus"}]),
                st.builds(
                    lambda schema, strict: {
                        "type": "json_schema",
                        "json_schema": {"name": "out", "schema": schema, "strict": strict},
                    },
                    self.schemas | st.sampled_from(VALID_SCHEMAS),
                    st.booleans(),
                ),
                st.builds(lambda js: {"type": "json_schema", "json_schema": js}, self.values),
            ),
            "logit_bias": st.dictionaries(
                st.one_of(
                    self.token_id.map(str),
                    st.sampled_from(BIG_INTS).map(str),
                    st.sampled_from(ODD_STRINGS),
                ),
                st.floats(-100, 100) | st.sampled_from([-101, 101, 1e308, -1e308, 5e-324]),
                max_size=5,
            ),
            "stop": st.one_of(self.text, st.lists(self.text, max_size=6)),
            "prompt": st.one_of(
                self.text,
                st.lists(self.text, min_size=1, max_size=3),
                st.lists(
                    st.one_of(self.token_id, self.token_id, st.integers()), min_size=1, max_size=8
                ),
                st.lists(st.lists(self.token_id, min_size=1, max_size=6), min_size=1, max_size=3),
                st.sampled_from([[], [[]], [[], [1]], [1, "a"], [[1], "a"]]),
            ),
            "chat_template_kwargs": st.dictionaries(
                st.sampled_from(["enable_thinking", "add_generation_prompt", "tools"]) | self.text,
                self.values,
                max_size=3,
            ),
            "metadata": st.dictionaries(self.text, self.text, max_size=3),
        }

    # -- valid bodies ----------------------------------------------------------------

    def _sampling(self, draw: Any, chat: bool) -> dict[str, Any]:
        """A random set of valid sampling fields."""
        p = self.profile
        optional: dict[str, SearchStrategy[Any]] = {
            "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries(
                {},
                optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()},
            ),
            "n": p.n,
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1),
            "top_k": st.integers(0, 100),
            "min_p": st.floats(0, 1),
            "repeat_penalty": st.floats(0.5, 2),
            "repeat_last_n": st.integers(-1, 128),
            "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2),
            "seed": st.integers(0, 2**32),
            "stop": st.one_of(
                st.text(min_size=1, max_size=6),
                st.lists(st.text(min_size=1, max_size=6), max_size=4),
            ),
            "logit_bias": st.dictionaries(self.token_id.map(str), st.floats(-100, 100), max_size=4),
            "user": self.plain,
            "model": st.sampled_from(["smollm2", "local-model"]),
            "ignore_eos": st.booleans(),
        }
        keys = draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=6))
        body = {k: draw(optional[k]) for k in keys}
        body["max_tokens" if not chat or draw(st.booleans()) else "max_completion_tokens"] = draw(
            p.max_tokens
        )
        return body

    def valid_chat(self) -> SearchStrategy[dict[str, Any]]:
        @st.composite
        def build(draw: Any) -> dict[str, Any]:
            message = st.builds(
                lambda role, content: {"role": role, "content": content},
                st.sampled_from(["system", "user", "assistant", "developer"]),
                st.text(min_size=1, max_size=self.profile.text_size),
            )
            body: dict[str, Any] = {"messages": draw(st.lists(message, min_size=1, max_size=3))}
            body["messages"][-1]["role"] = "user"
            body.update(self._sampling(draw, chat=True))
            if draw(st.booleans()):
                body["logprobs"] = True
                body["top_logprobs"] = draw(st.integers(0, 5))
            if draw(st.booleans()):
                names = draw(
                    st.lists(st.sampled_from(TOOL_NAMES), min_size=1, max_size=3, unique=True)
                )
                body["tools"] = [
                    {
                        "type": "function",
                        "function": {
                            "name": name,
                            "description": "a tool",
                            "parameters": draw(st.sampled_from(VALID_PARAMETERS)),
                        },
                    }
                    for name in names
                ]
                choice = st.sampled_from(["none", "auto", "required"]) | st.sampled_from(names).map(
                    lambda name: {"type": "function", "function": {"name": name}}
                )
                if draw(st.booleans()):
                    body["tool_choice"] = draw(choice)
                if draw(st.booleans()):
                    body["parallel_tool_calls"] = draw(st.booleans())
            elif draw(st.booleans()):
                body["response_format"] = draw(
                    st.one_of(
                        st.just({"type": "json_object"}),
                        st.sampled_from(VALID_SCHEMAS).map(
                            lambda s: {
                                "type": "json_schema",
                                "json_schema": {"name": "out", "schema": s},
                            }
                        ),
                    )
                )
            return body

        return build()

    def valid_text(self) -> SearchStrategy[dict[str, Any]]:
        @st.composite
        def build(draw: Any) -> dict[str, Any]:
            one = st.text(min_size=1, max_size=self.profile.text_size)
            ids = st.lists(self.token_id, min_size=1, max_size=8)
            prompt = draw(
                st.one_of(
                    one,
                    st.lists(one, min_size=1, max_size=2),
                    ids,
                    st.lists(ids, min_size=1, max_size=2),
                )
            )
            body: dict[str, Any] = {"prompt": prompt}
            body.update(self._sampling(draw, chat=False))
            if draw(st.booleans()):
                body["logprobs"] = draw(st.integers(0, 5))
            if draw(st.booleans()):
                body["echo"] = draw(st.booleans())
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                # One engine sequence per prompt and choice: keep within the server's capacity.
                body["n"] = min(body.get("n", 1), 4)
            return body

        return build()

    # -- cases -------------------------------------------------------------------------

    def _case(
        self, path: str, bodies: SearchStrategy[Any], how: str, **kw: Any
    ) -> SearchStrategy[Case]:
        return st.builds(
            lambda body, accept, script: make_case(
                path, body, accept=accept, script=script, how=how, **kw
            ),
            bodies,
            self.accept,
            self.script,
        )

    def valid_cases(self) -> SearchStrategy[Case]:
        return st.one_of(
            self._case(CHAT, self.valid_chat(), "valid", valid=True),
            self._case(TEXT, self.valid_text(), "valid", valid=True),
        )

    def schema_cases(self) -> SearchStrategy[Case]:
        return st.one_of(
            self._case(CHAT, self.schema_chat, "schema"),
            self._case(TEXT, self.schema_text, "schema"),
        )

    def tree_cases(self) -> SearchStrategy[Case]:
        fields = {CHAT: self.chat_fields, TEXT: self.text_fields}
        chat = self._case(
            CHAT, mutated(self.valid_chat(), self.hostile, self.like, fields[CHAT]), "tree"
        )
        text = self._case(
            TEXT, mutated(self.valid_text(), self.hostile, self.like, fields[TEXT]), "tree"
        )
        return st.one_of(chat, chat, text)  # chat bodies have more to them

    def like(self, value: Any) -> SearchStrategy[Any]:
        """Odd values of the same JSON type as ``value``."""
        if isinstance(value, bool):
            return st.booleans() | st.sampled_from([0, 1, "true", "yes", None])
        if isinstance(value, int):
            return st.one_of(
                st.integers(), st.sampled_from(BIG_INTS), st.sampled_from([0.0, 1.5, 1e308])
            )
        if isinstance(value, float):
            return st.one_of(
                st.floats(allow_nan=False, allow_infinity=False),
                st.sampled_from(ODD_FLOATS),
                st.integers(),
            )
        if isinstance(value, str):
            return self.text
        if isinstance(value, list):
            return st.builds(
                lambda extra: [*value, *extra], st.lists(self.hostile, min_size=1, max_size=2)
            ) | st.just([])
        if isinstance(value, dict):
            return st.just({})
        return self.hostile

    def structured_cases(self) -> SearchStrategy[Case]:
        """Chat bodies whose tools or response_format carry a random JSON schema."""

        @st.composite
        def build(draw: Any) -> dict[str, Any]:
            body: dict[str, Any] = draw(self.valid_chat())
            body.pop("response_format", None)
            body.pop("tool_choice", None)
            schema = draw(self.schemas)
            if draw(st.booleans()):
                tools = body.setdefault("tools", [])
                tools.append(
                    {"type": "function", "function": {"name": "g_x", "parameters": schema}}
                )
                body["tool_choice"] = draw(
                    st.sampled_from(["required", "auto", "none", {"function": {"name": "g_x"}}])
                )
            else:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "out", "schema": schema},
                }
            return body

        return self._case(CHAT, build(), "structured")

    def byte_cases(self) -> SearchStrategy[Case]:
        return byte_mutated(st.one_of(self.valid_cases(), self.tree_cases()), self.raws)


# -- from the wire schemas ---------------------------------------------------------------


def from_schema(
    schema: Any,
    root: dict[str, Any],
    overrides: dict[str, SearchStrategy[Any]],
    name: str | None = None,
    always: tuple[str, ...] = (),
) -> SearchStrategy[Any]:
    """Values for a pydantic JSON schema; ``overrides`` replaces named properties' strategies.

    Properties named in ``always`` are drawn as if required, at the top level.

    Optional properties appear a few at a time (a body with every field set
    would fail validation on the first odd one and test little else); bounded
    numbers are drawn from their range, with the bounds themselves and a value
    just past each now and then.
    """
    if name is not None and name in overrides:
        return overrides[name]
    if "$ref" in schema:
        target = root["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
        return st.deferred(lambda: from_schema(target, root, overrides))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root, overrides, name) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return texts(12)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind in ("integer", "number"):
        return _bounded(schema, integer=kind == "integer")
    if kind == "array":
        items = from_schema(schema.get("items", {}), root, overrides)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object":
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(texts(8), json_values(12), max_size=3)
        required = [k for k in [*schema.get("required", []), *always] if k in props]
        optional = sorted(k for k in props if k not in required)
        strategies = {k: from_schema(v, root, overrides, k) for k, v in props.items()}

        @st.composite
        def obj(draw: Any) -> dict[str, Any]:
            keys = draw(st.lists(st.sampled_from(optional), unique=True, max_size=5))
            return {k: draw(strategies[k]) for k in [*required, *keys]}

        return obj()
    return json_values(12)


def _bounded(schema: dict[str, Any], *, integer: bool) -> SearchStrategy[Any]:
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    hi = schema.get("maximum", schema.get("exclusiveMaximum"))
    edges = [b for b in (lo, hi) if b is not None]
    inside: SearchStrategy[Any]
    near: list[Any]
    if integer:
        inside = st.integers(lo, hi)
        near = [int(e) + d for e in edges for d in (-1, 0, 1)]
    else:
        inside = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
        near = [e + d for e in edges for d in (-0.001, 0, 0.001)]
    if near:
        return st.one_of(inside, inside, st.sampled_from(near))
    return inside


# -- tree mutations ----------------------------------------------------------------------

Path = tuple[Any, ...]


def tree_paths(node: Any, prefix: Path = ()) -> Iterator[Path]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from tree_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from tree_paths(v, (*prefix, i))


def _parent(root: Any, path: Path) -> Any:
    node = root
    for key in path[:-1]:
        node = node[key]
    return node


def mutated(
    bases: SearchStrategy[dict[str, Any]],
    values: SearchStrategy[Any],
    like: Callable[[Any], SearchStrategy[Any]],
    fields: list[str],
) -> SearchStrategy[Any]:
    """A valid body changed one to three times.

    Each change is one of: a subtree replaced by any hostile value; a value
    replaced by an odd one of the same type (``like``: control-token text,
    huge numbers...), so that more bodies get past validation; a subtree
    deleted; a known (at the top) or unknown field added; now and then, the
    whole body replaced.
    """

    @st.composite
    def build(draw: Any) -> Any:
        def fresh(strategy: SearchStrategy[Any]) -> Any:
            # A copy: strategies hand out shared objects (sampled_from, just), and
            # a later "add" must change this body only.
            return copy.deepcopy(draw(strategy))

        body: Any = fresh(bases)
        for _ in range(draw(st.sampled_from([1, 1, 2, 3]))):
            op = draw(
                st.sampled_from([*["replace"] * 2, *["retype"] * 3, "delete", "add", "whole"])
            )
            if op == "whole" or not isinstance(body, dict | list):
                body = fresh(values | st.just({}))
                continue
            if op == "add":
                targets = [p for p in tree_paths(body) if isinstance(_get(body, p), dict)]
                if not targets:
                    continue
                where = draw(st.sampled_from(targets))
                key = draw(st.sampled_from(fields) | texts(8) if where == () else texts(8))
                _get(body, where)[key] = fresh(values)
                continue
            inner = list(tree_paths(body))[1:]
            if not inner:
                continue
            path = draw(st.sampled_from(inner))
            if op == "delete":
                del _parent(body, path)[path[-1]]
            else:
                _parent(body, path)[path[-1]] = fresh(
                    like(_get(body, path)) if op == "retype" else values
                )
        return body

    return build()


def _get(root: Any, path: Path) -> Any:
    node = root
    for key in path:
        node = node[key]
    return node


# -- byte mutations ------------------------------------------------------------------------

BAD_BYTES = [
    b"\xff",
    b"\xfe\xff",
    b"\xc3",
    b"\xc0\xaf",
    b"\xed\xa0\x80",  # a surrogate in CESU-8
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\x00",
    b"\xef\xbb\xbf",
    b"\\ud800",
    b"\\u",
    b"\\",
    b'"',
    b"}",
    b"]",
    b",",
    b":",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"9" * 5000,
    b"[" * 2000,
]
# What may replace a number or literal: not JSON, or JSON no server should take as is.
BAD_LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000, b"-0", b"01", b"+1"]
BAD_LITERALS += [b".5", b"0x10", b"1e-400", b"True", b"None", b"nul", b"[" * 2000]
NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


def byte_mutated(cases: SearchStrategy[Case], raws: SearchStrategy[Raw]) -> SearchStrategy[Case]:
    """The JSON text of a case, changed as bytes one to three times."""

    @st.composite
    def build(draw: Any) -> Case:
        case = draw(cases)
        raw = bytearray(case.raw)
        inserted = st.sampled_from(BAD_BYTES) | st.binary(min_size=1, max_size=6)
        for _ in range(draw(st.integers(1, 3))):
            op = draw(
                st.sampled_from(
                    ["truncate", "insert", "overwrite", "literal", "splice", "frame", "recode"]
                )
            )
            pos = draw(st.integers(0, len(raw)))
            if op == "truncate":
                del raw[pos:]
            elif op == "insert":
                raw[pos:pos] = draw(inserted)
            elif op == "overwrite":
                raw[pos : pos + draw(st.integers(1, 4))] = draw(inserted)
            elif op == "literal":
                found = list(NUMBER.finditer(raw))
                if found:
                    m = draw(st.sampled_from(found))
                    new = draw(st.sampled_from(BAD_LITERALS))
                    raw[m.start() : m.end()] = new
            elif op == "splice":  # a raw value as a new first field
                brace = raw.find(b"{")
                if brace >= 0:
                    text = draw(raws).text.encode("utf-8", "surrogatepass")
                    raw[brace + 1 : brace + 1] = (
                        b'"zz":' + text + (b"," if raw[brace + 1 : brace + 2] != b"}" else b"")
                    )
            elif op == "recode":  # the same JSON in another encoding (not UTF-8)
                text = bytes(raw).decode("utf-8", "surrogateescape")
                codec = draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32-be", "latin-1"]))
                errors = "replace" if codec == "latin-1" else "surrogatepass"
                raw = bytearray(text.encode(codec, errors))
            else:  # framing around the document
                raw[:0] = draw(st.sampled_from([b"", b"\xef\xbb\xbf", b" \n\t", b"[", b"{}"]))
                raw += draw(st.sampled_from([b"", b" ", b"}", b"x", b"\x00", b"{}"]))
        content_type = draw(
            st.sampled_from(
                [
                    "application/json",
                    "application/json",
                    None,
                    "text/plain",
                    "application/json; charset=latin-1",
                ]
            )
        )
        out: Case = dataclasses.replace(
            case, raw=bytes(raw), stream=None, valid=False, content_type=content_type, how="bytes"
        )
        return out

    return build()


# -- sending and checking --------------------------------------------------------------------


class Failure(AssertionError):
    pass


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    body: bytes
    elapsed: float


def send(client: httpx.Client, base: str, case: Case, within: float) -> Answer:
    """POST the case; the whole answer must arrive within ``within`` seconds."""
    start = time.monotonic()
    try:
        with client.stream(
            "POST", base + case.path, content=case.raw, headers=case.headers(), timeout=within
        ) as r:
            body = bytearray()
            for chunk in r.iter_raw():
                body += chunk
                if time.monotonic() - start > within:
                    raise Failure(
                        f"no complete answer within {within}s (status {r.status_code}, "
                        f"{len(body)} bytes so far: {bytes(body[-300:])!r})"
                    )
            return Answer(r.status_code, r.headers, bytes(body), time.monotonic() - start)
    except httpx.TimeoutException as exc:
        raise Failure(f"no answer within {within}s ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        raise Failure(f"the connection failed instead of an answer: {exc!r}") from exc


def _error_object(err: Any, where: str) -> dict[str, Any]:
    assert isinstance(err, dict), f"{where}: 'error' is not an object: {err!r}"
    missing = {"message", "type", "param", "code"} - err.keys()
    assert not missing, f"{where}: the error object lacks {sorted(missing)}: {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"{where}: no message: {err!r}"
    assert isinstance(err["type"], str), f"{where}: type is not a string: {err!r}"
    assert err["param"] is None or isinstance(err["param"], str), f"{where}: param {err!r}"
    assert err["code"] is None or isinstance(err["code"], str), f"{where}: code {err!r}"
    # The message names the field: every name in the param's path (so "response_format
    # type" names response_format.type). OpenAI's context-length message names none.
    if err["param"] is not None and err["code"] != "context_length_exceeded":
        names = [n for n in re.split(r"[.\[\]]", err["param"]) if n and not n.isdigit()]
        missing_names = [n for n in names if n not in err["message"]]
        assert not missing_names, f"{where}: the message does not name {err['param']!r}: {err!r}"
    return err


def _lone_surrogate(raw: bytes) -> bool:
    """Whether the body parses as JSON (as Python reads it) with a lone surrogate in a string."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _sse_frames(body: bytes) -> list[tuple[str | None, str]]:
    """(event, data) of each frame; comments (pings) dropped; strict about the framing."""
    text = body.decode("utf-8")
    assert text.endswith("\n\n"), f"the stream does not end with a blank line: {text[-200:]!r}"
    frames: list[tuple[str | None, str]] = []
    for block in text[:-2].split("\n\n"):
        event: str | None = None
        data: str | None = None
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if not lines:
            continue
        for line in lines:
            if line.startswith("event: ") and event is None:
                event = line[7:]
            elif line.startswith("data: ") and data is None:
                data = line[6:]
            else:
                raise AssertionError(f"unexpected SSE line {line!r} in {block!r}")
        assert data is not None, f"a frame without data: {block!r}"
        frames.append((event, data))
    return frames


def check_answer(case: Case, answer: Answer) -> None:
    """The properties of one answer (the request's own; health is checked after)."""
    status, ctype = answer.status, answer.headers.get("content-type", "")
    event(f"{case.how} {'chat' if case.path == CHAT else 'text'} {status}")
    head = answer.body[:600]
    assert status < 500, f"a {status}: {head!r}"
    try:
        case.raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        assert 400 <= status < 500, f"a body that is not UTF-8 ({exc}) got {status}: {head!r}"
    if status < 400 and _lone_surrogate(case.raw):
        raise AssertionError(f"a body with a lone surrogate got {status}: {head!r}")
    if case.valid:
        assert status == 200, f"a valid body got {status}: {head!r}"
    if status >= 400:
        assert status < 500
        if ctype.startswith("text/event-stream"):
            assert case.accept == "text/event-stream", f"an SSE error without asking: {head!r}"
            frames = _sse_frames(answer.body)
            assert len(frames) == 1 and frames[0][0] == "error", f"not one error frame: {frames!r}"
            payload = json.loads(frames[0][1])
            assert isinstance(payload.get("message"), str) and isinstance(payload.get("type"), str)
            _error_object(payload.get("error"), f"{status} error frame")
        else:
            assert ctype.startswith("application/json"), f"a {status} as {ctype!r}: {head!r}"
            body = json.loads(answer.body)
            assert isinstance(body, dict) and set(body) == {"error"}, f"not an error body: {head!r}"
            _error_object(body["error"], f"{status}")
        return
    assert status == 200, f"status {status}: {head!r}"
    if ctype.startswith("text/event-stream"):
        assert case.stream is not False, "a stream for a body without stream: true"
        frames = _sse_frames(answer.body)
        assert frames, "an empty 200 stream"
        data = [d for _, d in frames]
        last_event, last = frames[-1]
        if last_event == "error":
            payload = json.loads(last)
            err = _error_object(payload.get("error"), "in-stream error frame")
            assert err["type"] != "server_error", f"the stream ended with a server error: {err!r}"
            assert "[DONE]" not in data, "[DONE] before an error frame"
            body_frames = frames[:-1]
        else:
            assert last == "[DONE]" and last_event is None, f"the stream ends with {frames[-1]!r}"
            assert data.count("[DONE]") == 1, "more than one [DONE]"
            body_frames = frames[:-1]
        for ev, d in body_frames:
            assert ev is None, f"an {ev!r} frame before the end: {d[:200]!r}"
            chunk = json.loads(d)
            assert chunk.get("object") in ("chat.completion.chunk", "text_completion"), chunk
            assert isinstance(chunk.get("choices"), list), chunk
    else:
        assert case.stream is not True, f"a stream request answered as {ctype!r}"
        assert ctype.startswith("application/json"), f"a 200 as {ctype!r}: {head!r}"
        body = json.loads(answer.body)
        assert body.get("object") in ("chat.completion", "text_completion"), head
        assert isinstance(body.get("choices"), list) and body["choices"], head


def check_health(client: httpx.Client, base: str, within: float) -> None:
    """``/health`` answers 200, and nothing is left active or queued."""
    deadline = time.monotonic() + within
    while True:
        try:
            r = client.get(base + "/health", timeout=within)
        except httpx.HTTPError as exc:
            raise Failure(f"/health did not answer: {exc!r}") from exc
        assert r.status_code == 200, f"/health answered {r.status_code}: {r.text[:300]}"
        slots = r.json()["slots"]
        if slots["active"] == 0 and slots["queued"] == 0:
            return
        if time.monotonic() > deadline:
            raise Failure(f"slots still busy {within}s after the answer: {slots}")
        time.sleep(0.01)


# -- explicit regressions: bodies that once broke the server --------------------------------------


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _text(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Once upon a time", "max_tokens": 4, **fields}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def _tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


SSE = "text/event-stream"

REGRESSIONS: list[Case] = [
    # lone surrogate escapes in content, prompt, names, keys, stop strings
    make_case(CHAT, rb'{"messages":[{"role":"user","content":"\ud800"}]}'),
    make_case(
        CHAT, rb'{"messages":[{"role":"user","content":"a\udfff"}],"stream":true}', accept=SSE
    ),
    make_case(TEXT, rb'{"prompt":"x\udbff","max_tokens":2}'),
    make_case(TEXT, rb'{"prompt":["ok","\ud83d"]}'),
    make_case(CHAT, _chat(stop=["\udfff"], user="\ud800")),
    make_case(TEXT, _text(logit_bias={"\ud800": 1})),
    make_case(CHAT, _chat(tools=[_tool({"type": "object", "properties": {"\ud800": {}}})])),
    # ... written as raw bytes: CESU-8 (invalid UTF-8), and UTF-16
    make_case(
        CHAT, encode_body(_chat(messages=[{"role": "user", "content": "\ud800"}]), ascii_only=False)
    ),
    make_case(TEXT, '{"prompt":"\ud800","max_tokens":2}'.encode("utf-16", "surrogatepass")),
    # ... a surrogate key over a bad value: the error's own message must still encode
    make_case(TEXT, rb'{"prompt":"x","metadata":{"\ud800":"\udfff"}}'),
    make_case(TEXT, rb'{"prompt":"x","\ud800":NaN,"stream":true}', accept=SSE),
    # JSON nested ~1,000 deep (and deeper)
    make_case(CHAT, b'{"messages":' + _nested(1000).encode() + b"}"),
    make_case(TEXT, _text(metadata=Raw('{"a":' * 1000 + "1" + "}" * 1000))),
    make_case(TEXT, _text(stream=True, x=Raw(_nested(100_000))), accept=SSE),
    # a 5,000-digit integer
    make_case(TEXT, _text(seed=Raw("9" * 5000))),
    make_case(CHAT, _chat(max_tokens=Raw("9" * 5000))),
    make_case(TEXT, _text(prompt=[Raw("-" + "9" * 5000)])),
    make_case(TEXT, _text(logit_bias={"5": Raw("1" * 5000)})),
    # logit_bias keys that are not token ids
    make_case(TEXT, _text(logit_bias={"--5": 1})),
    make_case(TEXT, _text(logit_bias={"²": 1})),
    make_case(CHAT, _chat(logit_bias={"٣": 1, "stream": 1})),
    make_case(TEXT, _text(logit_bias={"+5": 1, " 5": 1})),
    make_case(TEXT, _text(logit_bias={"99999999999999999999999": 1})),
    # tool_choice.function not an object
    make_case(
        CHAT, _chat(tools=[_WEATHER], tool_choice={"type": "function", "function": "get_weather"})
    ),
    make_case(CHAT, _chat(tools=[_WEATHER], tool_choice={"type": "function", "function": None})),
    make_case(
        CHAT, _chat(tools=[_WEATHER], tool_choice={"function": [1]}, stream=True), accept=SSE
    ),
    make_case(
        CHAT, _chat(tools=[_WEATHER], tool_choice={"type": "function", "function": {"name": 5}})
    ),
    # parameters.properties not an object
    make_case(
        CHAT,
        _chat(tools=[_tool({"type": "object", "properties": ["city"]})], tool_choice="required"),
    ),
    make_case(CHAT, _chat(tools=[_tool({"type": "object", "properties": "x"})])),
    make_case(
        CHAT,
        _chat(tools=[_tool({"type": "object", "properties": {"a": 5}})], tool_choice="required"),
    ),
    make_case(CHAT, _chat(response_format=_schema_format({"type": "object", "properties": None}))),
    # schemas with huge bounds (memory blowup)
    make_case(CHAT, _chat(response_format=_schema_format({"type": "string", "maxLength": 10**9}))),
    make_case(CHAT, _chat(response_format=_schema_format({"type": "string", "minLength": 10**9}))),
    make_case(
        CHAT,
        _chat(response_format=_schema_format({"type": "array", "items": {}, "maxItems": 10**9})),
    ),
    make_case(
        CHAT,
        _chat(response_format=_schema_format({"type": "array", "minItems": 10**9}), stream=True),
    ),
    make_case(
        CHAT,
        _chat(response_format=_schema_format({"type": "string", "pattern": "^a{0,1000000000}$"})),
    ),
    make_case(
        CHAT,
        _chat(
            response_format=_schema_format(
                {"type": "integer", "minimum": 10**18, "maximum": 10**30}
            )
        ),
    ),
    make_case(
        CHAT,
        _chat(
            tools=[
                _tool(
                    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**9}}}
                )
            ],
            tool_choice="required",
        ),
    ),
    # penalties (the real engine's penalties sampler)
    make_case(
        CHAT, _chat(presence_penalty=1.5, frequency_penalty=-2.0, repeat_penalty=1.3), valid=True
    ),
    make_case(
        TEXT, _text(repeat_penalty=1.1, repeat_last_n=-1, stream=True), valid=True, accept=SSE
    ),
    make_case(TEXT, _text(frequency_penalty=2.0, repeat_last_n=0), valid=True),
    make_case(TEXT, _text(presence_penalty=0.5, repeat_last_n=2**40)),
]


def with_regressions(test: Callable[..., None]) -> Callable[..., None]:
    for case in reversed(REGRESSIONS):
        test = example(case=case)(test)
    return test


# -- running a case on a server --------------------------------------------------------------------


class TotalRunner(ScriptedRunner):
    """The scripted runner, total over its whole vocabulary as a real model is.

    The plain fake turns token ids into ``chr(id)``, which fails for
    surrogates and ids past U+10FFFF: a fake's limit, not the server's. Text
    it cannot encode as UTF-8 fails as the real tokenizer does. Every
    sequence gets ``default`` (the case's script) whatever its prompt.
    """

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        text.encode("utf-8")  # as llama.cpp's tokenizer: a lone surrogate cannot be encoded
        return super().tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        if token >= 0x200000:
            return self._by_id.get(token, b"")
        if token == EOS_ID:
            return b""
        if token > 0x10FFFF:
            return b"\xff"
        return chr(token).encode("utf-8", "surrogatepass")

    def new_sampler(self, params: SamplingParams, prompt: list[int]) -> FakeSampler:
        return FakeSampler(list(prompt), list(self.default), params)


@dataclass
class Server:
    base: str
    client: httpx.Client
    runner: TotalRunner | None = None

    def __repr__(self) -> str:
        return f"Server({self.base!r})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def fresh_client() -> httpx.Client:
    """A client that opens a new connection per request.

    A kept-alive connection can be closed by the server's idle timeout just as
    the next request goes out: a reset that is no answer of the server's.
    """
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def run_case(srv: Server, case: Case, profile: Profile) -> None:
    """Send one case and check the answer and the server's health after it."""
    if srv.runner is not None:
        srv.runner.default = SCRIPTS[case.script]
        srv.runner.decodes.clear()
        srv.runner.history.clear()
    answer = send(srv.client, srv.base, case, profile.answer_within)
    try:
        check_answer(case, answer)
    finally:
        check_health(srv.client, srv.base, profile.idle_within)


PROPERTY = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
