"""A tiny llama.cpp audio projector that tells a low tone from a high one, made offline.

llama.cpp hears audio through a projector GGUF with an audio encoder (Whisper-style: a
log-mel spectrogram, two 1-d convolutions, transformer blocks, then the projector onto the
text model's embedding width). No registry here ships one small enough for the tests, so
this module writes one (``clip.projector_type = "ultravox"``) with numpy and the ``gguf``
package for SmolLM2-135M-Instruct, as ``tests/support/projector.py`` does for images.

What llama.cpp does before the encoder (``mtmd-audio.cpp``): the clip (16 kHz) gets 30 s of
silence appended and becomes an 80-bin log10 mel spectrogram, clamped at (its maximum - 8) and
mapped by ``(x + 4) / 4``; each full 3000-frame window (30 s) is one chunk. A chunk is 1500
positions after the stride-2 convolution and, stacked 100 at a time, 15 tokens.

The weights *carry meaning*:

1. ``a.conv1d.1`` measures each frame's low half of the mel bins against its high half:
   channel 0 is ``f = 0.25 * (sum(low) - sum(high))``, channel 1 is ``-f``. A silent frame
   is the same floor in every bin, so its ``f`` is exactly 0; a 300 Hz tone lifts the low
   bins (``f > 0``), a 3 kHz tone the high ones (``f < 0``).
2. ``a.conv1d.2`` computes ``gelu(f) - gelu(-f) = f`` (exactly) back into channels 0 and 1,
   again as ``f`` and ``-f`` (GELU follows each convolution). ``a.position_embd`` puts a
   constant 1 in channel 2, so no position's vector is ever all zero.
3. The one block's attention has zero query and key weights, so every position attends to
   all 1500 evenly: its value, ``LN(x)[0] - LN(x)[1]`` (LayerNorm's mean cancels; its scale
   only shrinks loud frames), averaged over the whole chunk, is written to residual channel
   3. Every position now holds the clip's mean ``m``: positive for a low tone, negative for a
   high one, whatever part of the 30 s the tone filled. The feed-forward adds nothing.
4. Ultravox's projector: an RMS norm (a positive scale), ``mm.a.mlp.1`` makes
   ``b = K * sum(channel 3)`` twice, as ``(b, -b)`` in both halves of a SwiGLU, which gives
   ``(b * silu(b), -b * silu(-b))`` whichever half is the gate: the first is large when
   ``m > 0`` and the second is ~0, and the other way round when ``m < 0``. The mid RMS norm
   keeps only their ratio, and ``mm.a.mlp.2`` maps the two to the token embeddings of
   :data:`WORDS` (" low" for the low tone, " high" for the high one).

A chunk therefore reaches the model as fifteen copies of one word's embedding. Silence (or a
sound with both bands alike) gives no reliable word.

Example::

    path = tone_projector()            # cached under ~/.cache/sluice-test/projectors/
    clip = tone_wav(LOW_HZ)            # 1.5 s, 16 kHz
    # llama-server -m SmolLM2...gguf --mmproj {path}; an input_audio of clip -> "... low ..."

    python -m tests.support.audio_projector /tmp/mmproj-audio.gguf
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from tests.support.audio import tone, wav
from tests.support.projector import (
    Floats,
    _embedding_rows,
    _read_token_embeddings,
    _word_ids,
    cached_projector,
)

# Bump when the generator's output changes: cached projectors are rebuilt.
VERSION = 1

SAMPLE_RATE = 16000  # what llama.cpp's whisper preprocessor takes
N_MEL = 80
WIDTH = 64  # the audio encoder's width
FFN_WIDTH = 128  # must differ from WIDTH, or clip.cpp takes up/down as swapped
HEAD_COUNT = 4
NORM_EPS = 1e-5
N_POSITIONS = 1500  # 3000 mel frames after the stride-2 convolution
STACK = 100  # positions per token: 15 tokens per 30 s chunk
TOKENS_PER_CHUNK = N_POSITIONS // STACK
HALF = 4  # SwiGLU width (mm.a.mlp.1 makes twice this)
GAIN = 4.0  # K: how sharply the SwiGLU picks one side
WORDS = (" low", " high")  # heard for a low tone, a high tone

LOW_HZ, HIGH_HZ = 300.0, 3000.0


def _encoder_tensors() -> dict[str, Floats]:
    """The Whisper-style encoder (numpy shapes, the reverse of ggml's ``ne``)."""
    w, ff = WIDTH, FFN_WIDTH
    zeros = np.zeros
    half = N_MEL // 2
    conv1 = zeros((w, N_MEL, 3), np.float32)  # (out, in, kernel); tap 1 is the frame itself
    conv1[0, :half, 1] = 0.25
    conv1[0, half:, 1] = -0.25
    conv1[1, :, 1] = -conv1[0, :, 1]
    conv2 = zeros((w, w, 3), np.float32)
    conv2[0, 0, 1], conv2[0, 1, 1] = 1.0, -1.0  # gelu(f) - gelu(-f) = f
    conv2[1, 0, 1], conv2[1, 1, 1] = -1.0, 1.0
    position = zeros((N_POSITIONS, w), np.float32)
    position[:, 2] = 1.0
    tensors: dict[str, Floats] = {
        "a.conv1d.1.weight": conv1,
        "a.conv1d.1.bias": zeros((w, 1), np.float32),  # (channels, 1): added along time
        "a.conv1d.2.weight": conv2,
        "a.conv1d.2.bias": zeros((w, 1), np.float32),
        "a.position_embd.weight": position,
    }
    blk = "a.blk.0"
    value = zeros((w, w), np.float32)
    value[0, 0], value[0, 1] = 1.0, -1.0
    out = zeros((w, w), np.float32)
    out[3, 0] = 1.0
    tensors |= {
        f"{blk}.attn_q.weight": zeros((w, w), np.float32),
        f"{blk}.attn_q.bias": zeros(w, np.float32),
        f"{blk}.attn_k.weight": zeros((w, w), np.float32),  # Whisper's key has no bias
        f"{blk}.attn_v.weight": value,
        f"{blk}.attn_v.bias": zeros(w, np.float32),
        f"{blk}.attn_out.weight": out,
        f"{blk}.attn_out.bias": zeros(w, np.float32),
        f"{blk}.ffn_up.weight": zeros((ff, w), np.float32),
        f"{blk}.ffn_up.bias": zeros(ff, np.float32),
        f"{blk}.ffn_down.weight": zeros((w, ff), np.float32),
        f"{blk}.ffn_down.bias": zeros(w, np.float32),
    }
    for norm in ("ln1", "ln2"):
        tensors[f"{blk}.{norm}.weight"] = np.ones(w, np.float32)
        tensors[f"{blk}.{norm}.bias"] = zeros(w, np.float32)
    return tensors


def _projector_tensors(targets: Floats) -> dict[str, Floats]:
    """Ultravox's projector: the clip's mean (channel 3) onto ``targets`` (2 x n_embd)."""
    stacked = STACK * WIDTH
    mlp1 = np.zeros((2 * HALF, stacked), np.float32)
    mean_channel = np.arange(STACK) * WIDTH + 3
    for row, sign in ((0, 1.0), (1, -1.0), (HALF, 1.0), (HALF + 1, -1.0)):
        mlp1[row, mean_channel] = sign * GAIN
    mlp2 = np.zeros((targets.shape[1], HALF), np.float32)
    # One side ~0, the mid RMS norm makes the other sqrt(HALF).
    mlp2[:, 0] = targets[0] / math.sqrt(HALF)
    mlp2[:, 1] = targets[1] / math.sqrt(HALF)
    return {
        "mm.a.norm_pre.weight": np.ones(stacked, np.float32),
        "mm.a.mlp.1.weight": mlp1,
        "mm.a.norm_mid.weight": np.ones(HALF, np.float32),
        "mm.a.mlp.2.weight": mlp2,
    }


def make_audio_projector(model_path: Path, out_path: Path) -> Path:
    """Write the tone-hearing projector for the text model at ``model_path`` to ``out_path``
    (any model whose :data:`WORDS` are one token each). Returns ``out_path``."""
    from gguf import GGUFWriter

    model_path = Path(model_path)
    info = _read_token_embeddings(model_path)
    targets = _embedding_rows(model_path, info, _word_ids(model_path, WORDS))
    writer = GGUFWriter(str(out_path), "clip")
    writer.add_name(f"sluice tone projector (ultravox) for {model_path.name}")
    writer.add_description(
        "Test projector: hears a low tone as the word ' low', a high tone as ' high'."
    )
    writer.add_string("clip.projector_type", "ultravox")
    writer.add_bool("clip.has_vision_encoder", False)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_uint32("clip.audio.num_mel_bins", N_MEL)
    writer.add_uint32("clip.audio.projector.stack_factor", STACK)
    writer.add_uint32("clip.audio.embedding_length", WIDTH)
    writer.add_uint32("clip.audio.feed_forward_length", FFN_WIDTH)
    writer.add_uint32("clip.audio.projection_dim", info.n_embd)
    writer.add_uint32("clip.audio.block_count", 1)
    writer.add_uint32("clip.audio.attention.head_count", HEAD_COUNT)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", NORM_EPS)
    for name, array in (_encoder_tensors() | _projector_tensors(targets)).items():
        # The convolution kernels in f16 as converters write them (their values are exact).
        writer.add_tensor(
            name,
            array.astype(np.float16)
            if name.startswith("a.conv1d.") and name.endswith(".weight")
            else array,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


def tone_projector() -> Path:
    """SmolLM2's tone projector, built once into the projectors' cache
    (:func:`~tests.support.projector.cached_projector`, :data:`VERSION`)."""
    from sluice.models.catalog import resolve_model

    model_path = resolve_model("smollm2").path
    return cached_projector(
        "tone-smollm2",
        model_path,
        f"{VERSION}|ultravox",
        lambda out: make_audio_projector(model_path, out),
    )


def tone_wav(hz: float, seconds: float = 1.5, rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit WAV of one tone, faded in and out over 20 ms (no clicks)."""
    samples = tone(hz, seconds, rate)
    fade = np.minimum(
        1.0, np.minimum(np.arange(len(samples)), np.arange(len(samples))[::-1]) / (0.02 * rate)
    )
    return wav((samples * fade).astype(np.float32), rate)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.audio_projector",
        description="Write SmolLM2's tone-hearing test projector GGUF.",
    )
    parser.add_argument("out", nargs="?", type=Path, help="write here (default: the cache)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out is None:
        path = tone_projector()
    else:
        from sluice.models.catalog import resolve_model

        path = make_audio_projector(resolve_model("smollm2").path, args.out)
    took = time.perf_counter() - start
    print(f"{path} ({path.stat().st_size} bytes, {took:.1f} s)")


if __name__ == "__main__":
    main()
