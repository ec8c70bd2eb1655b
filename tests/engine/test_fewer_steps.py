"""Jump-forward and prompt-lookup speculation in the engine loop, on the scripted runner:
the output is what plain decoding gives (text, stop strings, limits, usage), in fewer
decode steps, and no rejected draft token is ever left in a sequence's KV cache or in a
saved prompt state."""

from __future__ import annotations

import time
from typing import Any

import pytest

from sluice.core.events import Finish, TextDelta, Usage
from sluice.core.request import SamplingParams
from sluice.engine.engine import Engine
from sluice.engine.speculate import Acceptance, DraftPolicy, PromptLookup
from sluice.engine.types import EngineRequest
from sluice.engine.work import EngineConfig
from tests.engine.test_engine import ListSink
from tests.support.fakes import EOS, Forced, ScriptedRunner
from tests.support.helpers import wait_until

GRAMMAR = 'start: "x"'  # any grammar: the scripted runner only notes that there is one
LOOP = [b" the", b" cat", b" sat", b" on", b" a", b" mat"]


class BehindSink(ListSink):
    """A client a few steps behind, never far enough to be paused."""

    def backlog(self) -> int:
        return 5


def run(
    script: list[Any],
    *,
    prompt: str = "p",
    config: EngineConfig | None = None,
    rewind: bool = True,
    sink: ListSink | None = None,
    **request: Any,
) -> tuple[str, Finish, Usage, ScriptedRunner, Engine]:
    """One request on a fresh engine: its text, finish, usage, the runner and engine."""
    runner = ScriptedRunner(default=script, n_ctx_seq=4096, n_batch=256, can_rewind=rewind)
    engine = Engine(runner, config or EngineConfig(n_parallel=1))
    engine.start()
    sink = sink or ListSink()
    try:
        engine.submit(
            [EngineRequest(prompt_tokens=runner.tokenize(prompt, add_special=False), **request)],
            sink,
        )
        wait_until(sink.finished)
        time.sleep(0.05)  # the idle save, if any
    finally:
        engine.stop()
    text = "".join(e.text for e in sink.events if isinstance(e, TextDelta))
    finish = next(e for e in sink.events if isinstance(e, Finish))
    assert finish.usage is not None
    return text, finish, finish.usage, runner, engine


def grammar(**kw: Any) -> SamplingParams:
    return SamplingParams(grammar=GRAMMAR, **kw)


# -- jump-forward -------------------------------------------------------------------------

KEYS = [b"{", Forced(b'"name"'), Forced(b": "), b'"Ada"', Forced(b', "age": '), b"36", b"}", EOS]


def test_forced_tokens_are_output_at_once_and_decoded_with_the_next() -> None:
    text, finish, usage, runner, engine = run(KEYS, sampling=grammar())
    plain, _f, plain_usage, plain_runner, _e = run(KEYS, sampling=grammar(jump_forward=False))
    assert text == plain == '{"name": "Ada", "age": 36}'
    assert usage.completion_tokens == plain_usage.completion_tokens == 8
    assert finish.reason == "stop"
    # '{' decoded with the two tokens forced after it, in one row run.
    ids = [runner.piece_id(p) for p in (b"{", b'"name"', b": ")]
    assert [e.tokens for d in runner.decodes for e in d if e.tokens[0] == ids[0]] == [ids]
    assert len(runner.decodes) == len(plain_runner.decodes) - 3
    assert engine.stats.forced_tokens == 3


def test_a_stop_string_inside_forced_tokens_ends_the_output_there() -> None:
    text, finish, _usage, _r, _e = run(KEYS, sampling=grammar(), stop=("age",))
    assert text == '{"name": "Ada", "'
    assert finish.reason == "stop" and finish.stop_string == "age"


def test_max_tokens_counts_forced_tokens() -> None:
    text, finish, usage, _r, _e = run(KEYS, sampling=grammar(), max_tokens=2)
    assert (text, finish.reason, usage.completion_tokens) == ('{"name"', "length", 2)


def test_no_jump_forward_without_a_grammar_or_with_logprobs() -> None:
    for kw in ({"sampling": SamplingParams()}, {"sampling": grammar(), "logprobs": 0}):
        text, _f, _u, _r, engine = run(KEYS, **kw)
        assert text == '{"name": "Ada", "age": 36}'
        assert engine.stats.forced_tokens == 0


# -- prompt-lookup speculation ------------------------------------------------------------


def test_a_repeating_answer_is_drafted_and_kept_in_fewer_steps() -> None:
    script = [*LOOP * 6, EOS]
    text, _finish, usage, runner, engine = run(script)
    plain, _f, plain_usage, plain_runner, _e = run(script, sampling=SamplingParams(max_draft=0))
    assert text == plain == "".join(p.decode() for p in LOOP * 6)
    assert usage.completion_tokens == plain_usage.completion_tokens == 37
    assert engine.stats.accepted_tokens > 20
    assert len(runner.decodes) < len(plain_runner.decodes) - 20
    # Every drafted row had logits: one per draft token and one for the row before.
    assert any(e.n_logits > 1 for d in runner.decodes for e in d)


def test_a_rejected_draft_leaves_the_kv_cache_and_is_never_saved() -> None:
    """The answer repeats, then goes elsewhere where the draft expects the repeat: the
    rejected rows are dropped at once, so the sequence's cache (and the prompt state
    saved from it) holds only tokens of the prompt and the answer."""
    script = [*LOOP * 3, b" the", b" dog", b" ran", *LOOP * 2, b" end", EOS]
    config = EngineConfig(n_parallel=1, cache_ram_bytes=1 << 20, cache_min_tokens=1)
    text, _f, _u, runner, engine = run(script, config=config)
    assert text == "".join(p.decode() for p in script[:-1])
    assert engine.stats.drafted_tokens > engine.stats.accepted_tokens > 0  # some refused
    prompt = runner.tokenize("p", add_special=False)
    answer = [runner.piece_id(p) for p in script[:-1]]
    real = prompt + answer
    assert runner.history[0] == real[: len(runner.history[0])]
    assert runner.saves, "the idle slot was saved"
    for _seq, tokens in runner.saves:
        assert tokens == real[: len(tokens)]


@pytest.mark.parametrize("max_tokens", [3, 10, 25])
def test_max_tokens_ends_inside_a_draft(max_tokens: int) -> None:
    script = [*LOOP * 6, EOS]
    text, finish, usage, runner, _e = run(script, max_tokens=max_tokens)
    assert usage.completion_tokens == max_tokens and finish.reason == "length"
    assert text == "".join(p.decode() for p in (LOOP * 6)[:max_tokens])
    assert len(runner.history[0]) <= 1 + max_tokens


def test_a_stop_string_inside_an_accepted_draft() -> None:
    script = [*LOOP * 4, b" dog", *LOOP, EOS]
    text, finish, _u, _r, engine = run(script, stop=(" dog",))
    assert text == "".join(p.decode() for p in LOOP * 4)
    assert finish.reason == "stop" and engine.stats.accepted_tokens > 0


def test_two_choices_draft_side_by_side() -> None:
    script = [*LOOP * 5, EOS]
    runner = ScriptedRunner(default=script, n_ctx_seq=4096, n_batch=256, can_rewind=True)
    engine = Engine(runner, EngineConfig(n_parallel=2))
    engine.start()
    sink = ListSink()
    prompt = runner.tokenize("p", add_special=False)
    try:
        engine.submit([EngineRequest(prompt_tokens=prompt, choice=i) for i in (0, 1)], sink)
        wait_until(lambda: sum(isinstance(e, Finish) for e in sink.events) == 2)
    finally:
        engine.stop()
    expected = "".join(p.decode() for p in LOOP * 5)
    for choice in (0, 1):
        text = "".join(
            e.text for e in sink.events if isinstance(e, TextDelta) and e.choice == choice
        )
        assert text == expected
    assert engine.stats.accepted_tokens > 20
    answer = prompt + [runner.piece_id(p) for p in LOOP * 5]
    for seq in (0, 1):
        assert runner.history[seq] == answer[: len(runner.history[seq])]


def test_no_drafts_where_they_cannot_be_undone_or_are_not_wanted() -> None:
    script = [*LOOP * 6, EOS]
    expected = "".join(p.decode() for p in LOOP * 6)
    for kw in (
        {"rewind": False},  # a recurrent model's state cannot drop rejected rows
        {"sink": BehindSink()},  # its client is behind already
        {"sampling": SamplingParams(max_draft=0)},  # the request turned it off
        {"config": EngineConfig(n_parallel=1, max_draft=0)},  # the server did
    ):
        text, _f, _u, _r, engine = run(script, **kw)  # type: ignore[arg-type]
        assert text == expected
        assert engine.stats.drafted_tokens == 0, kw


# -- the pieces ---------------------------------------------------------------------------


def test_lookup_prefers_the_longest_and_latest_match_and_extends_a_loop() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 9, 2, 3, 4, 7])
    lookup.extend([2, 3, 4])
    assert lookup.draft(3) == [7, 2, 3]  # the latest "2 3 4" was followed by 7
    lookup = PromptLookup([5, 1, 2, 3, 1, 2, 3])
    assert lookup.draft(7) == [1, 2, 3, 1, 2, 3, 1]  # a loop drafts past its period
    assert PromptLookup([1, 2, 3, 4]).draft(4) == []  # no earlier occurrence
    assert PromptLookup([1, 2, 1, 2]).draft(4) == []  # two tokens are not a match


def test_a_copy_keeps_to_its_source() -> None:
    """Copying the first line, the answer reaches "1 2 3", which the second line has
    more recently: the draft goes on from the first line, where the copy is."""
    lookup = PromptLookup([10, 11, 12, 1, 2, 3, 4, 5, 20, 21, 1, 2, 3, 6, 6])
    lookup.extend([10, 11, 12])
    assert lookup.draft(3) == [1, 2, 3]
    lookup.extend([1, 2, 3])
    assert lookup.draft(3) == [4, 5, 20]
    lookup.extend([7])  # the answer leaves the copy
    assert lookup.cursor is None
    lookup.extend([1, 2, 3])
    assert lookup.draft(2) == [7, 1]  # the latest match again: the answer's own "1 2 3 7"


def test_acceptance_follows_the_drafts_and_recovers() -> None:
    policy = DraftPolicy()
    record = Acceptance()
    for _ in range(10):
        record.observe(8, 8)
    assert record.rate > 0.95 and policy.length(record.rate, 16, 1, 1.0) >= 8
    for n in range(1, 10):
        record.observe(4, 0)
        if policy.length(record.rate, 16, 1, 1.0) == 0:
            break
    assert n <= 4, "a copy that ended stops the drafts within a few"
    for _ in range(3):
        record.shadow(True)  # steps without a draft sampled what it would have drafted
    assert policy.length(record.rate, 16, 1, 1.0) > 0  # so it drafts again


def test_the_policy_drafts_long_when_kept_short_when_not_and_less_beside_others() -> None:
    policy = DraftPolicy()
    assert policy.length(0.99, 16, 1, 1.0) == 16
    assert 0 < policy.length(0.85, 16, 1, 1.0) < 10
    assert policy.length(0.4, 16, 1, 1.0) == 0
    alone = policy.length(0.9, 16, 1, 1.0)
    assert policy.length(0.9, 16, 4, 0.4) < alone
    assert policy.length(0.6, 16, 8, 0.25) == 0
