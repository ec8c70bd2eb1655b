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
    given = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
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
        "source": "gguf",
    }
    assert isinstance(declared.top_k, int)
    both = SamplerDefaults.declared(gguf, (("temperature", 0.0), ("min_p", 0.1)))
    assert (both.temperature, both.top_k, both.min_p, both.source) == (0.0, 20, 0.1, "config")
    assert SamplerDefaults.declared({}) == LLAMA_CPP_SAMPLING
