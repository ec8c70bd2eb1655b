"""SamplerDefaults: a sampling field a request leaves out gets the model's declared
default (config entry, else GGUF), else llama.cpp's; an explicit value always wins."""

from __future__ import annotations

from sluice.core.request import LLAMA_CPP_SAMPLING, SamplerDefaults, SamplingParams


def test_left_out_fields_get_llama_cpps_defaults() -> None:
    filled = LLAMA_CPP_SAMPLING.fill(SamplingParams())
    assert (filled.temperature, filled.top_k, filled.top_p, filled.min_p) == (
        0.8,
        40,
        0.95,
        0.05,
    )


def test_an_explicit_value_always_wins_zero_included() -> None:
    given = SamplingParams(
        temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, penalty_last_n=0
    )
    assert LLAMA_CPP_SAMPLING.fill(given) is given
    half = LLAMA_CPP_SAMPLING.fill(SamplingParams(top_k=0, temperature=1.5))
    assert (half.temperature, half.top_k, half.top_p, half.min_p) == (1.5, 0, 0.95, 0.05)


def test_the_gguf_declares_and_the_config_entry_overrides() -> None:
    metadata = {
        "general.sampling.temp": 0.6,
        "general.sampling.top_k": 20,
        "general.sampling.top_p": "not a number",
        "general.name": "x",
    }
    gguf = SamplerDefaults.from_gguf(metadata.get)
    assert gguf == {"temperature": 0.6, "top_k": 20.0}
    declared = SamplerDefaults.declared(gguf)
    assert declared.as_dict() == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0.05,
        "repeat_penalty": 1.0,
        "repeat_last_n": 64,
        "source": "gguf",
    }
    assert isinstance(declared.top_k, int)
    both = SamplerDefaults.declared(gguf, (("temperature", 0.0), ("min_p", 0.1)))
    assert (both.temperature, both.top_k, both.min_p, both.source) == (0.0, 20, 0.1, "config")
    assert SamplerDefaults.declared({}) == LLAMA_CPP_SAMPLING


def test_penalties_left_out_get_the_declared_ones() -> None:
    """llama.cpp reads general.sampling.penalty_repeat and penalty_last_n too."""
    metadata = {"general.sampling.penalty_repeat": 1.1, "general.sampling.penalty_last_n": 128}
    declared = SamplerDefaults.declared(SamplerDefaults.from_gguf(metadata.get))
    filled = declared.fill(SamplingParams())
    assert (filled.repeat_penalty, filled.penalty_last_n) == (1.1, 128)
    assert isinstance(filled.penalty_last_n, int) and filled.uses_penalties
    # An explicit value wins, 1.0 (no penalty) included; left out, llama.cpp's.
    assert declared.fill(SamplingParams(repeat_penalty=1.0)).repeat_penalty == 1.0
    plain = LLAMA_CPP_SAMPLING.fill(SamplingParams())
    assert (plain.repeat_penalty, plain.penalty_last_n, plain.uses_penalties) == (1.0, 64, False)
    assert not SamplingParams().uses_penalties
