"""Which attention kernel llama.cpp runs a model with (the ``--flash-attn`` setting).

llama.cpp's "auto" turns its fused (flash) attention on wherever the device has it,
the CPU included. On the CPU the fused kernel walks the cache one cell at a time
with an online softmax, while the unfused graph does two matrix products and one
vectorized softmax. Measured on SmolLM2-135M, 2 threads (one decode step of one
sequence, fused / unfused): 13.1 / 12.6 ms at 200 cells, 27.6 / 18.1 ms at 900,
66 / 36 ms at 3,000; with 16 drafted rows verified beside it 540 / 270 ms at
3,000; prefill level (25.2 / 26.3 s for 3,000 tokens). A lone row also takes a
split-cache path in the fused kernel once a sequence holds 512 cells, whose
rounding differs from the same row decoded among others, so a verified draft
could change a greedy answer at a near tie.

The unfused graph pays in memory: the scores of a batch (``K·Q`` and its softmax,
one float per head, token and cell) sit in llama.cpp's compute buffer. So "auto" is
unfused on the CPU while those scores stay under :data:`UNFUSED_SCORES_LIMIT`, and
llama.cpp's own choice with layers on a GPU, where the fused kernels are the fast
ones.
"""

from __future__ import annotations

UNFUSED_SCORES_LIMIT = 512 << 20
CHOICES = ("auto", "on", "off")


def scores_bytes(n_head: int, cells_seq: int, batch: int) -> int:
    """The unfused graph's attention scores for a full batch at a full context.

    A batch holds at most ``batch`` tokens; each attends to the cells of its own
    sequence's stream (at most ``cells_seq``): ``K·Q`` and the softmax's output, f32.
    """
    return 2 * 4 * n_head * cells_seq * batch


def unfused(choice: str, *, on_gpu: bool, n_head: int, cells_seq: int, batch: int) -> bool:
    """Whether the model runs with the unfused attention graph (flash attention off)."""
    if choice not in CHOICES:
        raise ValueError(f"flash_attn must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice != "auto":
        return choice == "off"
    return not on_gpu and scores_bytes(n_head, cells_seq, batch) <= UNFUSED_SCORES_LIMIT
