"""The --flash-attn choice and what unfused attention keeps in memory."""

from __future__ import annotations

import pytest

from sluice.engine.attention import scores_bytes, unfused


def test_scores_are_two_floats_per_head_token_and_cell() -> None:
    assert scores_bytes(9, 4096, 512) == 2 * 4 * 9 * 4096 * 512  # SmolLM2: 144 MiB


def test_only_off_is_unfused_and_other_words_are_refused() -> None:
    assert unfused("off")
    assert not unfused("on") and not unfused("auto")  # auto: llama.cpp's (fused on a CPU)
    with pytest.raises(ValueError, match="flash_attn must be one of"):
        unfused("fast")
