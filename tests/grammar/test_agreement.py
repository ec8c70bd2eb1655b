"""Grammar and parser agree: what a forced call's grammar lets a model write, the
format's parser reads back as exactly the calls written.

The property, for every output format the server can use (one shipped template per
distinct format the template analysis or the hand-written families give, and the
hand-written formats chosen by ``tool_format``), on the server's own path
(:meth:`CompletionService.chat_prompt`: the plan's grammar, wrapped after the
reasoning block the prompt opened, and ``plan.parsers(0)``):

1. Walk the grammar (``tests/support/grammar_walk.py``): a seeded random walk over
   the tokens llguidance allows, on two vocabularies: bytes with the family's markers
   as single special tokens (so markup is matched as control tokens, and free text
   before a control token runs until it), and SmolLM2's real vocabulary (markers
   are text, spelled by whatever tokens the walk picks). Free text (reasoning,
   string values up to their closing markup) gets markup-like phrases of every
   family spliced in, and is closed after a few tokens.
2. Requests vary: tool sets with strings, enums, integers, numbers, booleans,
   nested objects, arrays, optional parameters and a tool without parameters;
   ``tool_choice`` required or a named function; one call or parallel calls (up to
   three walked); reasoning on (the template's default) and off.
3. Read the text back through the parser chain token by token, in a few random
   pieces and (one walk in five) character by character: the readings are the same, and the reading is the
   forced call(s) walked: no content, names among the tools (the named one when
   named), arguments valid under their schemas (``jsonschema``), and written back
   in the family's syntax (``tests/support/rendering.py``) they give the walked
   text itself (any other spelling of a JSON scalar that reads the same, and the
   model's call ids and indexes, excepted), the reasoning included. So a call lost,
   split, merged, renamed or read with other arguments fails.

A failure prints the format, the seed and the text: ``SEED=n`` reruns one seed.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest

from sluice.core.syntax import KEY_NAME, TaggedArgs
from tests.support.agreement import (
    Reading,
    every_markup,
    formats,
    markup,
    planned,
    problems,
    read,
    request,
    service,
)
from tests.support.grammar_walk import Vocab, marker_vocab, markers, model_vocab, walk


def _fn(name: str, parameters: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "description": f"{name} things"}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def _obj(props: dict[str, Any], *required: str) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required)}


WEATHER = [
    _fn(
        "get_weather",
        _obj(
            {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "city",
        ),
    ),
    _fn("get_time", _obj({"zone": {"type": "string"}}, "zone")),
    _fn("now", {"type": "object", "properties": {}}),
]
TYPES = [
    _fn(
        "fs.write_file",
        _obj(
            {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "mode": {"type": "integer"},
                "append": {"type": "boolean"},
            },
            "path",
            "content",
        ),
    ),
    _fn(
        "plot-points",
        _obj(
            {
                "points": {
                    "type": "array",
                    "items": _obj({"x": {"type": "number"}, "y": {"type": "number"}}, "x", "y"),
                },
                "label": {"type": "string"},
                "style": _obj({"color": {"type": "string"}, "width": {"type": "number"}}),
            },
            "points",
        ),
    ),
    _fn(
        "search",
        _obj(
            {"query": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "query",
        ),
    ),
]
TOOLSETS = {"weather": WEATHER, "types": TYPES}
# (tool set, tool_choice, parallel_tool_calls): forced calls, one or up to three
REQUESTS: list[tuple[str, Any, bool | None]] = [
    ("weather", "required", None),
    ("weather", "required", False),
    ("weather", {"type": "function", "function": {"name": "get_weather"}}, True),
    ("types", "required", True),
    ("types", {"type": "function", "function": {"name": "fs.write_file"}}, False),
    ("types", "required", None),
]
SAMPLES = {
    "markers": int(os.environ.get("SAMPLES", "600")),
    "model": int(os.environ.get("MODEL_SAMPLES", "60")),
}
FORMATS = formats()
_MADE_UP = re.compile(r"call_[0-9a-f]{24}")


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Vocab]:
    from tests.support.llama import real_runner

    with real_runner() as runner:
        yield model_vocab(runner)


def _chunkings(
    vocab: Vocab, tokens: list[int], text: str, rng: random.Random, by_char: bool
) -> Iterator[list[str]]:
    yield list(vocab.pieces(tokens))
    if by_char:
        yield list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
    yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


class _Setup:
    """One request's plan, matcher and phrases, made once per format."""

    def __init__(self, template: str, tool_format: str | None, vocab_of: Any, k: int) -> None:
        toolset, self.choice, parallel = REQUESTS[k % len(REQUESTS)]
        self.thinking = k < len(REQUESTS)
        self.label = f"{toolset}, {self.choice}, parallel={parallel}, thinking={self.thinking}"
        fmt = service(template, tool_format).format
        body = request(TOOLSETS[toolset], self.choice, parallel, self.thinking)
        self.plan = plan = planned(template, tool_format, body)
        own = markup(plan, fmt)
        self.vocab: Vocab = vocab_of(tuple(own))
        assert plan.grammar is not None
        self.matcher = self.vocab.matcher(plan.grammar)
        names = [t["function"]["name"] for t in plan.tools]
        self.phrases = [
            *every_markup(),
            *own,
            *own,
            *names,
            '"',
            "\\",
            "{",
            "}",
            "<",
            "</",
            "\n",
            " ",
        ]
        self.closers = [*own, *_named_closings(plan), '"', "}", "]"]
        self.named = self.choice["function"]["name"] if isinstance(self.choice, dict) else None


def _named_closings(plan: Any) -> list[str]:
    """Closing markup that names its key (MiniMax-M3's ``</city>``), for every key."""
    syntax = plan.syntax
    tagged = [e for e in syntax.call if isinstance(e, TaggedArgs)] if syntax else []
    if not tagged or KEY_NAME not in tagged[0].value_suffix:
        return []
    keys = {"item"}
    for tool in plan.tools:
        keys |= set(_keys(tool["function"].get("parameters")))
    return [tagged[0].value_suffix.replace(KEY_NAME, k) for k in sorted(keys)]


def _keys(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        for key, value in (schema.get("properties") or {}).items():
            yield key
            yield from _keys(value)
        yield from _keys(schema.get("items"))


def _agree(template: str, tool_format: str | None, vocab_of: Any, samples: int) -> None:
    setups = [_Setup(template, tool_format, vocab_of, k) for k in range(2 * len(REQUESTS))]
    seeds = [int(os.environ["SEED"])] if "SEED" in os.environ else range(samples)
    failures = []
    stuck = 0
    for seed in seeds:
        rng = random.Random(seed)
        setup = setups[seed % len(setups)]
        vocab, plan = setup.vocab, setup.plan
        walked = walk(setup.matcher.deep_copy(), vocab, rng, setup.phrases, setup.closers)
        if not walked.stopped:
            stuck += 1
            continue
        text = vocab.text(walked.tokens)
        by_char = seed % 5 == 0  # the slowest reading: one walk in five
        chunkings = _chunkings(vocab, walked.tokens, text, rng, by_char)
        readings = [read(plan, chunks) for chunks in chunkings]
        found = problems(plan, text, readings[0], setup.named)
        if any(_same(r) != _same(readings[0]) for r in readings[1:]):
            found.append(f"streamed readings differ: {readings}")
        if found:
            failures.append(f"seed {seed} ({setup.label}): {found}\n  text: {text!r:.800}")
    name = setups[0].vocab.name
    assert stuck <= len(seeds) // 10, f"{stuck} of {len(seeds)} walks did not end"
    assert not failures, (
        f"{template} ({tool_format}) on {name}: {len(failures)} of {len(seeds)}:\n"
        + "\n".join(failures[:4])
    )


def _same(reading: Reading) -> Reading:
    """The reading with the ids sluice made up (fresh for each reading) left out."""
    calls = [[n, "" if _MADE_UP.fullmatch(i) else i, a] for n, i, a in reading.calls]
    return Reading(reading.content, reading.reasoning, calls)


@cache
def _marker_vocab(own: tuple[str, ...]) -> Vocab:
    return marker_vocab(markers(own))


def _ids() -> list[str]:
    return [t if f is None else f for t, f in FORMATS]


@pytest.mark.parametrize(("template", "tool_format"), FORMATS, ids=_ids())
def test_markers_as_special_tokens(template: str, tool_format: str | None) -> None:
    _agree(template, tool_format, _marker_vocab, SAMPLES["markers"])


@pytest.mark.parametrize(("template", "tool_format"), FORMATS, ids=_ids())
def test_smollm2_vocabulary(template: str, tool_format: str | None, smollm2: Vocab) -> None:
    _agree(template, tool_format, lambda own: smollm2, SAMPLES["model"])


def test_reading_is_compared() -> None:
    assert Reading("a") != Reading()
