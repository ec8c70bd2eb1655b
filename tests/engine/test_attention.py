"""The --flash-attn choice: unfused attention on the CPU while its scores stay small."""

from __future__ import annotations

import pytest

from sluice.engine.attention import UNFUSED_SCORES_LIMIT, scores_bytes, unfused


def test_scores_are_two_floats_per_head_token_and_cell() -> None:
    assert scores_bytes(9, 4096, 512) == 2 * 4 * 9 * 4096 * 512  # SmolLM2: 144 MiB


def test_auto_is_unfused_on_the_cpu_while_the_scores_fit() -> None:
    assert unfused("auto", on_gpu=False, n_head=9, cells_seq=8192, batch=512)
    # 32 heads at 32k tokens of context: 4 GiB of scores a batch; fused.
    assert not unfused("auto", on_gpu=False, n_head=32, cells_seq=32768, batch=512)
    cells = UNFUSED_SCORES_LIMIT // (2 * 4 * 8 * 512)
    assert unfused("auto", on_gpu=False, n_head=8, cells_seq=cells, batch=512)
    assert not unfused("auto", on_gpu=False, n_head=8, cells_seq=cells + 256, batch=512)


def test_auto_leaves_a_gpu_to_llama_cpp_and_on_off_are_kept() -> None:
    assert not unfused("auto", on_gpu=True, n_head=9, cells_seq=512, batch=512)
    assert unfused("off", on_gpu=True, n_head=32, cells_seq=32768, batch=512)
    assert not unfused("on", on_gpu=False, n_head=9, cells_seq=512, batch=512)
    with pytest.raises(ValueError, match="flash_attn must be one of"):
        unfused("fast", on_gpu=False, n_head=9, cells_seq=512, batch=512)
