"""TriggerScanner: where a lazy grammar engages, found at a cost that does not grow
with the output (the patterns run once per occurrence of a trigger word)."""

from __future__ import annotations

import re

from sluice.core.syntax import ReasoningSyntax
from sluice.engine.trigger import TriggerScanner
from sluice.local.plan import OutputPlan

TAG = "<tool_call>"


def plan_patterns(reasoning: ReasoningSyntax | None = None, opened: bool = False) -> tuple:
    plan = OutputPlan(fmt="hermes", trigger_tag=TAG, reasoning=reasoning, reasoning_opened=opened)
    return plan.triggers, plan.trigger_words


def test_a_long_output_without_the_word_never_runs_the_patterns() -> None:
    patterns, words = plan_patterns()
    scan = TriggerScanner(patterns, words)
    for _ in range(20_000):
        assert scan.feed(b" the fox <tool and <call> ") is None
    assert scan.checks == 0


def test_the_word_split_across_tokens_engages_at_the_token_that_completes_it() -> None:
    patterns, words = plan_patterns()
    scan = TriggerScanner(patterns, words)
    pieces = ["Sure", ", let me", " check. <", "tool", "_c", "all>"]
    results = [scan.feed(p.encode()) for p in pieces]
    # Matched when "all>" arrived; the capture begins in " check. <" (token 2).
    assert results == [None, None, None, None, None, 2]
    assert scan.checks == 1


def test_no_words_runs_the_patterns_on_every_token_like_llama_cpp() -> None:
    patterns, _words = plan_patterns()
    scan = TriggerScanner(patterns)
    assert [scan.feed(p) for p in (b"a", b"b", b"<tool_call>")] == [None, None, 2]
    assert scan.checks == 3


def test_a_call_inside_reasoning_is_not_a_trigger_but_one_after_it_is() -> None:
    think = ReasoningSyntax("<think>", "</think>")
    patterns, words = plan_patterns(think)
    scan = TriggerScanner(patterns, words)
    pieces = ["<think>", "maybe ", TAG, " no", "</think>", "Now: ", TAG, "\n"]
    results = [scan.feed(p.encode()) for p in pieces]
    assert results[:6] == [None] * 6
    assert results[6] == 6  # the second tag, in token 6
    # The prompt may open the reasoning: then only after its end.
    patterns, words = plan_patterns(think, opened=True)
    scan = TriggerScanner(patterns, words)
    assert [scan.feed(p.encode()) for p in ("x ", TAG, "</think>", TAG)] == [None, None, None, 3]


def test_the_scanner_agrees_with_the_patterns_over_the_whole_output() -> None:
    think = ReasoningSyntax("<think>", "</think>")
    patterns, words = plan_patterns(think)
    rx = [re.compile(p) for p in patterns]
    text = "  <think> a <tool_call> b </think> c <tool_call> d"
    scan = TriggerScanner(patterns, words)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        first = scan.feed(piece.encode())
        so_far = "".join(pieces[: i + 1])
        expected = next((m for r in rx if (m := r.fullmatch(so_far))), None)
        assert (first is None) == (expected is None), so_far
        if expected is not None:
            assert first == expected.start(1) // 3
            break
    else:
        raise AssertionError("never engaged")
