"""Which attention kernel llama.cpp runs a model with (the ``--flash-attn`` setting).

"auto" is llama.cpp's own choice: its fused (flash) attention wherever the device
has it, the CPU included. "off" builds the unfused graph (``K·Q``, a softmax, a
product with ``V``), a trade on the CPU, measured on SmolLM2-135M with 2 threads
(one decode step, fused / unfused):

- Past a few hundred tokens of context the unfused graph is faster: the fused CPU
  kernel walks the cache one cell at a time with an online softmax. One sequence:
  27.6 / 18.1 ms at 900 cells, 66 / 36 ms at 3,000; 16 drafted rows verified
  beside it at 3,000 cells 540 / 270 ms. So copied text (prompt-lookup
  speculation) gains most from it: a 3,000-token file rewritten came out 1.47x
  faster without speculation, 3.3x llama-server's with it.
- Below about 300 cells it is slower with several sequences: the fused kernel
  reads only the cells in use, the unfused graph every cell of the padded view
  (256 at least): 4 sequences of 60 tokens 33 / 46 ms, 8 sequences 64 / 71 ms.
- It keeps a batch's attention scores in llama.cpp's compute buffer (``K·Q`` and
  its softmax, one float per head, token and cell): :func:`scores_bytes`, counted
  in the memory estimate.
- With fused attention a row's logits come out the same alone and among drafted
  rows while a sequence holds fewer than 512 cells (past that a lone row takes a
  split-cache path); unfused, ``K·Q`` of a lone row is a dot product per cell and
  of several rows a tiled product, which round differently (docs/speculation.md).
"""

from __future__ import annotations

CHOICES = ("auto", "on", "off")


def scores_bytes(n_head: int, cells_seq: int, batch: int) -> int:
    """The unfused graph's attention scores for a full batch at a full context.

    A batch holds at most ``batch`` tokens; each attends to the cells of its own
    sequence's stream (at most ``cells_seq``): ``K·Q`` and the softmax's output, f32.
    """
    return 2 * 4 * n_head * cells_seq * batch


def unfused(choice: str) -> bool:
    """Whether a model runs with the unfused attention graph (flash attention off)."""
    if choice not in CHOICES:
        raise ValueError(f"flash_attn must be one of {', '.join(CHOICES)}, not {choice!r}")
    return choice == "off"
