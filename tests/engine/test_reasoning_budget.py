"""Reasoning budgets in the engine loop, on the scripted runner: the reasoning block is
counted (usage), and when its budget is spent the family's closer is forced as the next
tokens, decoded without steps of their own; the answer follows."""

from __future__ import annotations

from typing import Any

from sluice.engine.reasoning import ReasoningLimit, ReasoningTrack
from tests.engine.test_fewer_steps import run
from tests.support.fakes import EOS, ScriptedRunner

THINK = [b"<think>", *([b" hm"] * 40), b"</think>", b"Paris", b".", EOS]
CLOSER = "</think>"


def limit(budget: int | None, **kw: Any) -> ReasoningLimit:
    closer = tuple(ScriptedRunner().tokenize(CLOSER, add_special=False))
    fields: dict[str, Any] = {"start": b"<think>", "ends": (b"</think>",), "closer": closer}
    return ReasoningLimit(**{**fields, "budget": budget, **kw})


def test_the_reasoning_block_is_counted_without_a_budget() -> None:
    text, _f, usage, runner, _e = run(THINK, reasoning=limit(None))
    assert text == "<think>" + " hm" * 40 + "</think>Paris."
    assert usage.reasoning_tokens == 42  # the block, its markers included
    assert usage.completion_tokens == 45  # and the end-of-generation token
    assert runner.forced_closers == []


def test_a_spent_budget_forces_the_closer_then_the_answer() -> None:
    text, finish, usage, runner, engine = run(THINK, reasoning=limit(6))
    assert text == "<think>" + " hm" * 5 + CLOSER + "Paris."
    assert finish.reason == "stop"
    assert usage.reasoning_tokens == 6 + len(CLOSER)  # the closer is reasoning too
    assert usage.completion_tokens == 6 + len(CLOSER) + 3
    assert runner.forced_closers == [list(map(ord, CLOSER))]
    assert engine.stats.reasoning_closed == 1
    # The closer was decoded with the token before it, in one step.
    last = runner.piece_id(b" hm")
    assert [len(e.tokens) for d in runner.decodes for e in d if e.tokens[0] == last][-1] == 9


def test_a_prompt_that_opened_the_block_counts_from_the_first_token() -> None:
    script = [*([b" hm"] * 10), b"</think>", b"ok", EOS]
    text, _f, usage, _r, _e = run(script, reasoning=limit(3, opened=True))
    assert text == " hm" * 3 + CLOSER + "ok"
    assert usage.reasoning_tokens == 3 + len(CLOSER)


def test_output_without_the_block_is_not_touched() -> None:
    script = [b" ", b"Hello", *([b" hm"] * 10), EOS]
    text, _f, usage, runner, _e = run(script, reasoning=limit(2))
    assert text == " Hello" + " hm" * 10
    assert usage.reasoning_tokens == 0 and runner.forced_closers == []


def test_a_block_closed_within_the_budget_is_left_alone() -> None:
    script = [b"<think>", b" hm", b"</think>", b"ok", EOS]
    text, _f, usage, runner, _e = run(script, reasoning=limit(10))
    assert text == "<think> hm</think>ok"
    assert usage.reasoning_tokens == 3 and runner.forced_closers == []


def test_the_closer_is_not_forced_past_max_tokens() -> None:
    text, finish, usage, runner, _e = run(THINK, reasoning=limit(6), max_tokens=10)
    assert finish.reason == "length" and usage.completion_tokens == 10
    assert runner.forced_closers == [] and CLOSER not in text


def test_drafts_never_run_past_the_budget() -> None:
    # A loop that prompt-lookup drafts well: drafts stop short of the budget.
    loop = [b"<think>", *([b" the", b" cat", b" sat"] * 30), b"</think>", b"ok", EOS]
    text, _f, usage, _r, engine = run(loop, prompt=" the cat sat" * 4, reasoning=limit(40))
    assert text == "<think>" + (" the cat sat" * 13) + CLOSER + "ok"
    assert usage.reasoning_tokens == 40 + len(CLOSER)
    assert engine.stats.drafted_tokens > 0 and engine.stats.accepted_tokens > 0


def test_the_track_sees_markers_split_across_tokens() -> None:
    track = ReasoningTrack(limit(None))
    for piece in (b" ", b"<th", b"ink>", b"a", b"</th"):
        track.feed(piece)
    assert track.active and track.tokens == 4
    track.feed(b"ink>\n")
    assert not track.active and track.tokens == 5
