"""Greedy sampling without a llama.cpp chain (an argmax over the logits) picks exactly the
token llama.cpp's own greedy + logit-bias samplers pick, on the real model."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from sluice.core.request import SamplingParams
from sluice.engine.llama_runner import LlamaRunner
from sluice.engine.llama_sampling import Chain
from sluice.engine.runner import BatchEntry
from tests.support.llama import real_runner


def llama_greedy_chain(runner: LlamaRunner, biases: list[tuple[int, float]]) -> Chain:
    """llama.cpp's logit_bias + greedy samplers, built by hand."""
    L: Any = runner._L
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if biases:
        arr = (L.llama_logit_bias * len(biases))()
        for i, (token, bias) in enumerate(biases):
            arr[i].token, arr[i].bias = token, bias
        L.llama_sampler_chain_add(
            chain, L.llama_sampler_init_logit_bias(runner.n_vocab, len(biases), arr)
        )
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    return Chain(chain)


@pytest.fixture(scope="module")
def runner() -> Any:
    with real_runner() as r:
        yield r


def test_greedy_without_a_chain_matches_llamas_greedy(runner: LlamaRunner) -> None:
    text = "Once upon a time, in a land far away, there lived a fox who " * 6
    prompt = runner.tokenize(text, add_special=True)[:300]
    runner.decode([BatchEntry(0, prompt, 0, True, True)])  # logits for every row
    greedy = SamplingParams(temperature=0.0)
    # The argmax of the row (by construction of the text, often " fox", " a", ...) is
    # biased away below, so the bias decides the token in many rows.
    top = runner.sample(runner.new_sampler(greedy, prompt), 5)
    cases = [
        greedy,
        dataclasses.replace(greedy, ignore_eos=True),
        dataclasses.replace(greedy, logit_bias=((top, -100.0), (13, 3.0), (13, 2.5))),
        dataclasses.replace(greedy, logit_bias=((top, float("-inf")),), ignore_eos=True),
    ]
    try:
        for params in cases:
            fast = runner.new_sampler(params, prompt)
            assert fast.ptr is None  # no llama.cpp chain: the argmax path
            biases = list(params.logit_bias)
            if params.ignore_eos:
                biases += [(t, float("-inf")) for t in runner._eog_tokens()]
            chain = llama_greedy_chain(runner, biases)
            mine = [runner.sample(fast, row) for row in range(len(prompt))]
            theirs = [runner.sample(chain, row) for row in range(len(prompt))]
            runner.free_sampler(chain)
            assert mine == theirs, params
        assert runner.sample(runner.new_sampler(cases[2], prompt), 5) != top
    finally:
        runner.keep_prefix(0, 0)


def test_stateful_or_random_sampling_keeps_llamas_chain(runner: LlamaRunner) -> None:
    for params in (
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=0.0, repeat_penalty=1.3),
    ):
        sampler = runner.new_sampler(params, [1, 2, 3])
        assert sampler.ptr is not None, params
        runner.free_sampler(sampler)
    # A grammar is never in the chain: it checks the chain's choice (the gate).
    sampler = runner.new_sampler(SamplingParams(temperature=0.0, grammar='start: "a"'), [1])
    assert sampler.ptr is None and sampler.gate is not None
    runner.free_sampler(sampler)


def llama_grammar_chain(runner: LlamaRunner, grammar: str, params: SamplingParams) -> Chain:
    """llama.cpp's grammar sampler at the head of the chain (a pass over the whole
    vocabulary every token), then the request's samplers: what sluice did before."""
    L: Any = runner._L
    chain = runner._chain(params, [], [])
    head = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(
        head, L.llama_sampler_init_grammar(runner._vocab, grammar.encode(), b"root")
    )
    while L.llama_sampler_chain_n(chain) > 0:
        L.llama_sampler_chain_add(head, L.llama_sampler_chain_remove(chain, 0))
    L.llama_sampler_free(chain)
    return Chain(head)


JSON_GRAMMAR = r"""root ::= "{" ws "\"name\":" ws str "," ws "\"age\":" ws num ws "}"
str ::= "\"" [a-zA-Z ]{1,12} "\""
num ::= [1-9] [0-9]?
ws ::= [ \n]?"""
# The same language in llguidance's Lark, which the gate runs.
JSON_LARK = r"""start: "{" ws "\"name\":" ws str "," ws "\"age\":" ws num ws "}"
str: "\"" /[a-zA-Z ]{1,12}/ "\""
num: /[1-9][0-9]?/
ws: (" " | "\n")?
"""


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repeat_penalty=1.2),
        SamplingParams(temperature=0.0, logit_bias=((90, -5.0),)),
    ],
    ids=["greedy", "penalties", "bias"],
)
def test_checking_the_chosen_token_picks_what_the_whole_pass_picks(
    runner: LlamaRunner, params: SamplingParams
) -> None:
    """Sample first, ask the grammar about that token only, and pass over the whole
    vocabulary only when it is rejected: greedy, that is exactly the token a grammar
    at the head of the chain gives, with far fewer passes."""
    prompt = "A person, as JSON:"
    gated = dataclasses.replace(params, grammar=JSON_LARK)
    checks, rejections = runner.grammar_checks, runner.grammar_rejections
    text, _ = generate(runner, gated, prompt, 40)
    reference = llama_grammar_chain(runner, JSON_GRAMMAR, params)
    want, _ = generate_with(runner, reference, prompt, 40)
    assert text == want and text.startswith("{") and text.endswith("}"), (text, want)
    n_checks = runner.grammar_checks - checks
    n_rejected = runner.grammar_rejections - rejections
    # A check per token, the end included; a pass only for the tokens refused (the
    # end of generation at least: the model would go on).
    assert n_checks >= 10 and 0 < n_rejected < n_checks / 2, (n_checks, n_rejected)


def test_a_quiet_prompt_chunk_goes_in_a_decode_of_its_own() -> None:
    """A paced chunk (no logits wanted) beside generating sequences: llama.cpp would give it
    one token in their ubatch and run the other 63 rows below the attention's 64-row tile.
    In a call of its own it is whole tiles; the other rows' logits are read where that
    second call put them."""
    with real_runner(n_parallel=3) as runner:
        _quiet_chunk_alone(runner)


def _quiet_chunk_alone(runner: LlamaRunner) -> None:
    text = "The river ran past the mill and the baker's house, then under the bridge. " * 12
    prompt = runner.tokenize(text, add_special=True)
    for seq in (1, 2):
        runner.keep_prefix(seq, 0)
        runner.decode([BatchEntry(seq, prompt[: 40 + seq], 0, True)])
    gen = [BatchEntry(seq, [prompt[40 + seq]], 40 + seq, True) for seq in (1, 2)]
    runner.decode(gen)  # the reference: the generating rows alone
    alone = [runner._logits(row).copy() for row in (0, 1)]
    for seq in (1, 2):
        runner.keep_prefix(seq, 40 + seq)
    runner.keep_prefix(0, 0)
    calls: list[int] = []
    L: Any = runner._L
    decode = L.llama_decode

    def counting(ctx: Any, batch: Any) -> int:
        calls.append(int(batch.n_tokens))
        return int(decode(ctx, batch))

    chunk = BatchEntry(0, prompt[:64], 0, False)
    L.llama_decode = counting
    try:
        runner.decode([chunk, *gen])  # rows 64 and 65 of the step's batch
    finally:
        L.llama_decode = decode
    assert calls == [64, 2]
    for row, want in zip((64, 65), alone, strict=True):
        assert (runner._logits(runner._rows[row]) == want).all()  # type: ignore[index]
        assert runner.sample(runner.new_sampler(SamplingParams(temperature=0.0), []), row) == int(
            want.argmax()
        )
    # A step without such a chunk is one call, its rows as they are.
    runner.keep_prefix(0, 64)
    runner.keep_prefix(1, 41)
    runner.decode([BatchEntry(0, prompt[64:70], 64, True), gen[0]])
    assert runner._rows is None


def generate(runner: LlamaRunner, params: SamplingParams, text: str, n: int) -> tuple[str, Any]:
    """Up to ``n`` tokens after ``text`` (sequence 0), sampled with ``params``; the
    text and the sampler (freed), the cache cleared."""
    prompt = runner.tokenize(text, add_special=False)
    return generate_with(runner, runner.new_sampler(params, prompt), text, n)


def generate_with(runner: LlamaRunner, sampler: Any, text: str, n: int) -> tuple[str, Any]:
    """:func:`generate` with a sampler made by the caller (freed here)."""
    prompt = runner.tokenize(text, add_special=False)
    out = b""
    try:
        runner.decode([BatchEntry(0, prompt, 0)])
        pos = row = len(prompt)
        row -= 1  # the batch row of the prompt's last token, then of each new one
        for _ in range(n):
            token = runner.sample(sampler, row)
            row = 0
            if runner.is_eog(token):
                break
            out += runner.token_bytes(token, special=True)
            runner.decode([BatchEntry(0, [token], pos)])
            pos += 1
    finally:
        runner.free_sampler(sampler)
        runner.keep_prefix(0, 0)
    return out.decode(errors="replace"), sampler


LAZY_PROMPT = "Say <tool_call> hi.\nSay <tool_call> hi.\nSay <tool_call> hi.\nSay"
LAZY = SamplingParams(
    temperature=0.0,
    grammar='start: "<tool_call> zzz qqq."',
    grammar_triggers=(r"[\s\S]*?(<tool_call>)[\s\S]*",),
    grammar_trigger_words=("<tool_call>",),
)


@pytest.mark.parametrize(
    "params",
    [
        LAZY,  # greedy without a chain until the trigger
        dataclasses.replace(LAZY, repeat_penalty=1.05),  # a chain of penalties + greedy
        dataclasses.replace(LAZY, temperature=0.5, top_k=1, seed=3),  # a random chain
    ],
    ids=["chainless", "penalties", "random"],
)
def test_a_deferred_lazy_grammar_engages_at_its_trigger(
    runner: LlamaRunner, params: SamplingParams
) -> None:
    free, _ = generate(runner, dataclasses.replace(params, grammar=None), LAZY_PROMPT, 8)
    assert free.startswith(" <tool_call> hi."), free  # what the model writes by itself
    # The grammar stays out of the way until the model writes the trigger, then
    # takes over from the tag: the rest is the grammar's, and it ends there.
    text, sampler = generate(runner, params, LAZY_PROMPT, 16)
    assert text == " <tool_call> zzz qqq.", text
    assert sampler.scan is None and sampler.grammar is None  # engaged (and freed)
    # Without the trigger the output is free, and nothing was ever checked twice.
    plain = "The capital of France is"
    free, _ = generate(runner, dataclasses.replace(params, grammar=None), plain, 12)
    text, sampler = generate(runner, params, plain, 12)
    assert text == free and "<tool_call>" not in text
    assert sampler.scan is not None and sampler.scan.checks == 0


def test_ignore_eos_gives_way_to_a_complete_grammar(runner: LlamaRunner) -> None:
    """A grammar's end is the output's end: with ignore_eos too, once the grammar is
    complete only the end may come (banned, nothing could be sampled)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, grammar='start: "{}"')
    text, _ = generate(runner, params, "JSON:", 12)
    assert text == "{}", text


def test_a_forced_closer_runs_on_past_the_reasoning_s_stop_string(runner: LlamaRunner) -> None:
    """A budget's closer ("</think>" and the line break after it) is taken whole by a
    grammar whose reasoning ends at the stop string "</think>" (llguidance's own
    validate_tokens stops counting where the stop string ends); a closer the grammar
    refuses part of is not taken at all."""
    grammar = 'start: thinking "\\n" "yes"\nthinking[stop="</think>"]: /(.|\\n)*/\n'
    sampler = runner.new_sampler(SamplingParams(temperature=0.0, grammar=grammar), [1])
    closer = runner.tokenize("</think>\n", add_special=False, parse_special=False)
    wrong = runner.tokenize("</think>no", add_special=False, parse_special=False)
    assert len(closer) > 1
    assert not runner.force_tokens(sampler, wrong)
    assert runner.force_tokens(sampler, closer)
    yes = runner.tokenize("yes", add_special=False, parse_special=False)
    assert runner.force_tokens(sampler, yes)
    assert sampler.gate is not None and sampler.gate.matcher.is_accepting()
