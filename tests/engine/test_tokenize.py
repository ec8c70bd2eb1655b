"""Long texts are tokenized in pieces: the same tokens as one llama.cpp call, in linear time."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sluice.engine.text import literal_regex
from tests.support.llama import real_runner


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def runner(request: pytest.FixtureRequest) -> Iterator[Any]:
    with real_runner(request.param, n_ctx=256) as r:
        yield r


def _text(rng: random.Random, specials: list[str], n: int) -> str:
    words = ["abc ", "def", " 12", ".", "é", "日本語", "<", "|>", "\n", "\n\n", "  "]
    return "".join(
        rng.choice(specials) if rng.random() < 0.3 else rng.choice(words) * rng.randint(1, 9)
        for _ in range(n)
    )


@pytest.mark.parametrize("parse_special", [True, False])
@pytest.mark.parametrize("add_special", [True, False])
def test_pieces_give_the_tokens_of_one_call(
    runner: Any, parse_special: bool, add_special: bool
) -> None:
    rng = random.Random(7)
    specials = list(runner.control_texts[:40])
    for _ in range(3):
        text = _text(rng, specials, 6000)
        assert len(runner._control_cuts(text)) >= 2  # it really was cut
        one_call = runner._tokenize(text, add_special, parse_special)
        assert runner.tokenize(text, add_special=add_special, parse_special=parse_special) == (
            one_call
        )


def test_many_special_texts_tokenize_in_linear_time(runner: Any) -> None:
    # In one llama.cpp call, 100,000 of these took 45 s (quadratic); in pieces, 0.3-3 s.
    special = next(t for t in runner.control_texts if t.startswith("<") and len(t) > 4)
    t0 = time.monotonic()
    tokens = runner.tokenize(special * 100_000, add_special=False, parse_special=True)
    assert time.monotonic() - t0 < 15  # loose: a shared machine
    assert len(tokens) == 100_000


def test_literal_regex_matches_the_longest_literal_at_each_position() -> None:
    rx = literal_regex(["<a>", "<ab>", "b", "<abc"])
    assert rx is not None
    assert rx.findall("x<ab><a>b<abcd") == ["<ab>", "<a>", "b", "<abc"]
    assert literal_regex([]) is None
