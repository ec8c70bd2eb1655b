"""A tiny llama.cpp vision projector ("mmproj") that sees colour, made offline for the tests.

llama.cpp runs a vision model as two files: the text model and a projector GGUF
(``general.architecture = "clip"``): a small ViT plus a projector onto the text model's
embedding width. No registry here ships one small enough for the tests, so this module writes
one with numpy and the ``gguf`` package, for the packaged text models:

* ``smollm2`` (SmolLM2-135M-Instruct, ChatML): a LLaVA-style projector
  (``clip.projector_type = "mlp"``);
* ``gemma3`` (Gemma 3 270M base, no chat template): a Gemma 3 projector
  (``clip.projector_type = "gemma3"``), whose image llama.cpp wraps in the text
  ``<start_of_image>``/``<end_of_image>`` and decodes with causal attention off.

The projector *carries meaning*. A 64 px image is cut into sixteen 16 px patches; the patch
embedding measures each patch's mean red, green and blue; the one transformer block is an exact
identity (zero residual weights); the projector maps the three means onto the text model's own
input embeddings of the words " red", " green", " blue" (rows of ``token_embd.weight``). A pure
red image therefore reaches the model as sixteen copies of " red", and a small model asked for
the colour answers "red". Only the mean colour of each patch is seen: mixed, white or black
images give no reliable word. Gemma scales token embeddings by sqrt(n_embd) inside its graph but
not image embeddings, so its targets are scaled here.

Prompts measured at temperature 0 (llama-server and mtmd's Python API agree):

* SmolLM2, one user message "Name the colour of this image in one word." with the image
  before or after the text: red -> "red" / "The colour of this image is red.", green -> "Green." /
  '... "green".'. "What colour is this image?" works only with the image first (red works either
  way). Assert on red or green: the text-only question answers "blue".
* Gemma 3 270M, raw prompt "<image marker>\nThis picture is one solid colour. Its colour is":
  " a combination of red and yellow..." / "... of green and yellow..."; text-only "blue and
  yellow".

Both norms on the way (the LayerNorm ``v.post_ln`` and, for gemma3, an RMS norm before the
projection) would blur three raw means, so each patch's vision vector is
``(r, g, b, -r, -g, -b, 0, ...)``: its mean is zero, and either norm only rescales it (to
``sqrt(width / 2)`` for a pure colour, which the projector divides out).

Example::

    path = colour_projector("smollm2")   # cached under ~/.cache/sluice-test/projectors/
    png = solid_png((255, 0, 0))         # 64x64 red
    # llama-server -m SmolLM2...gguf --mmproj {path}; an image_url of png -> "... red ..."

    python -m tests.support.projector smollm2 /tmp/mmproj.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

ProjectorKind = Literal["mlp", "gemma3"]
PackagedModel = Literal["smollm2", "gemma3"]

# Bump when the generator's output changes: cached projectors are rebuilt.
VERSION = 1

IMAGE_SIZE = 64  # px; llama.cpp resizes any image to this
PATCH_SIZE = 16  # px: (64 / 16)^2 = 16 image tokens
VISION_WIDTH = 64
FFN_WIDTH = 128  # must differ from VISION_WIDTH, or clip.cpp takes up/down as swapped
HEAD_COUNT = 4
NORM_EPS = 1e-6
N_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
COLOUR_WORDS = (" red", " green", " blue")

# Architectures whose graph multiplies token embeddings (only) by sqrt(n_embd).
_SCALES_TOKEN_EMBEDDINGS = frozenset({"gemma3", "gemma3n", "gemma4", "gemma-embedding"})

# Which packaged model (sluice.models.catalog name) and projector each short name means.
_PACKAGED: dict[str, tuple[str, ProjectorKind]] = {
    "smollm2": ("smollm2", "mlp"),
    "gemma3": ("gemma3-270m", "gemma3"),
}

Floats = npt.NDArray[np.float32]


# -- the text model ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _TokenEmbeddings:
    """Where ``token_embd.weight`` lies in a text model's GGUF file."""

    architecture: str
    n_embd: int
    n_vocab: int
    qtype: GGMLQuantizationType
    data_offset: int  # absolute file offset of row 0


# GGUF value types -> size in bytes (scalars); 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read_token_embeddings(model_path: Path) -> _TokenEmbeddings:
    """Find ``token_embd.weight`` by walking the GGUF header.

    ``gguf.GGUFReader`` would take 4 s (SmolLM2) to 18 s (Gemma 3, 262k tokens) building a
    view of every vocabulary entry; skipping them here takes a fraction of a second.
    """
    with open(model_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", mm, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{model_path} is not a GGUF v2+ file")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", mm, pos)
            pos += 8 + n
            return mm[pos - n : pos].decode("utf-8", "replace")

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype == _GGUF_STRING:
                (n,) = struct.unpack_from("<Q", mm, pos)
                pos += 8 + n
            elif vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if etype in _SCALAR_SIZES:
                    pos += count * _SCALAR_SIZES[etype]
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                pos += _SCALAR_SIZES[vtype]

        architecture, alignment = "", 32
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", mm, pos)
            pos += 4
            if key == "general.architecture" and vtype == _GGUF_STRING:
                architecture = string()
            elif key == "general.alignment" and vtype == 4:
                (alignment,) = struct.unpack_from("<I", mm, pos)
                pos += 4
            else:
                skip(vtype)

        found: tuple[list[int], int, int] | None = None
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", mm, pos)
            dims = list(struct.unpack_from(f"<{n_dims}Q", mm, pos + 4))
            qtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            if name == "token_embd.weight":
                found = (dims, qtype, offset)
        if found is None:
            raise ValueError(f"{model_path} has no token_embd.weight")
        data_start = (pos + alignment - 1) // alignment * alignment
        dims, qtype, offset = found
        return _TokenEmbeddings(
            architecture, dims[0], dims[1], GGMLQuantizationType(qtype), data_start + offset
        )


def _embedding_rows(model_path: Path, info: _TokenEmbeddings, ids: list[int]) -> Floats:
    """Rows ``ids`` of ``token_embd.weight``, dequantized: ``len(ids) x n_embd``."""
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    row_bytes = info.n_embd // block * type_size
    rows = []
    with open(model_path, "rb") as f:
        for i in ids:
            if not 0 <= i < info.n_vocab:
                raise ValueError(f"token id {i} out of range (n_vocab {info.n_vocab})")
            f.seek(info.data_offset + i * row_bytes)
            raw = np.frombuffer(f.read(row_bytes), dtype=np.uint8).reshape(1, row_bytes)
            rows.append(dequantize(raw, info.qtype).reshape(info.n_embd))
    return np.stack(rows).astype(np.float32)


def _word_ids(model_path: Path, words: tuple[str, ...]) -> list[int]:
    """The one token id of each word (with its leading space), by the model's own tokenizer."""
    import llama_cpp  # heavy; only needed while building

    llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False, n_threads=1)
    try:
        ids = []
        for word in words:
            tokens = llm.tokenize(word.encode(), add_bos=False, special=False)
            if len(tokens) != 1:
                raise ValueError(f"{word!r} is {len(tokens)} tokens in {model_path.name}")
            ids.append(tokens[0])
        return ids
    finally:
        llm.close()


# -- the projector ----------------------------------------------------------------------------


def _gelu(x: float) -> float:
    """ggml's GELU (tanh approximation)."""
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _vision_tensors() -> dict[str, Floats]:
    """The image encoder: patch means in, the same (normalized) vectors out.

    Shapes are numpy's (row-major), the reverse of ggml's ``ne``.
    """
    w, ff = VISION_WIDTH, FFN_WIDTH
    zeros = np.zeros
    # Conv kernel (out, in=RGB, ky, kx): channel c and c+3 average colour c over the patch.
    patch = zeros((w, 3, PATCH_SIZE, PATCH_SIZE), np.float32)
    for c in range(3):
        patch[c, c] = 1.0 / PATCH_SIZE**2
        patch[c + 3, c] = -1.0 / PATCH_SIZE**2
    tensors: dict[str, Floats] = {
        "v.patch_embd.weight": patch,
        "v.patch_embd.bias": zeros(w, np.float32),
        "v.position_embd.weight": zeros((N_PATCHES, w), np.float32),
    }
    # One block that is an exact identity: attention output and feed-forward down are zero,
    # so both residual additions add nothing.
    blk = "v.blk.0"
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensors[f"{blk}.{name}.weight"] = zeros((w, w), np.float32)
        tensors[f"{blk}.{name}.bias"] = zeros(w, np.float32)
    tensors[f"{blk}.ffn_up.weight"] = zeros((ff, w), np.float32)
    tensors[f"{blk}.ffn_up.bias"] = zeros(ff, np.float32)
    tensors[f"{blk}.ffn_down.weight"] = zeros((w, ff), np.float32)
    tensors[f"{blk}.ffn_down.bias"] = zeros(w, np.float32)
    for norm in (f"{blk}.ln1", f"{blk}.ln2", "v.post_ln"):
        tensors[f"{norm}.weight"] = np.ones(w, np.float32)
        tensors[f"{norm}.bias"] = zeros(w, np.float32)
    return tensors


def _projector_tensors(kind: ProjectorKind, targets: Floats) -> dict[str, Floats]:
    """Map each patch's normalized (r, g, b, -r, -g, -b, 0...) onto ``targets`` (3 x n_embd)."""
    n_embd = targets.shape[1]
    # A pure colour's vision vector after LayerNorm or RMS norm: sqrt(width / 2) in its slot.
    pure = math.sqrt(VISION_WIDTH / 2)
    if kind == "mlp":
        # mm.0 (vision -> text width), GELU, mm.2 (text -> text width).
        mm0 = np.zeros((n_embd, VISION_WIDTH), np.float32)
        mm2 = np.zeros((n_embd, n_embd), np.float32)
        for c in range(3):
            mm0[c, c] = 1.0
            mm2[:, c] = targets[c] / _gelu(pure)
        return {
            "mm.0.weight": mm0,
            "mm.0.bias": np.zeros(n_embd, np.float32),
            "mm.2.weight": mm2,
            "mm.2.bias": np.zeros(n_embd, np.float32),
        }
    # gemma3: RMS norm * soft_emb_norm, then x @ input_projection (ggml ne [n_embd, width]).
    proj = np.zeros((VISION_WIDTH, n_embd), np.float32)
    proj[:3] = targets / pure
    return {
        "mm.input_projection.weight": proj,
        "mm.soft_emb_norm.weight": np.ones(VISION_WIDTH, np.float32),
    }


def make_projector(model_path: Path, out_path: Path, kind: ProjectorKind) -> Path:
    """Write a colour-seeing projector for the text model at ``model_path`` to ``out_path``.

    ``kind`` is the projector type: ``"mlp"`` (LLaVA-style) or ``"gemma3"``. Either works with
    any text model whose words " red", " green", " blue" are one token each; the image is 16
    tokens. Returns ``out_path``.
    """
    if kind not in ("mlp", "gemma3"):
        raise ValueError(f"unknown projector kind {kind!r}")
    model_path = Path(model_path)
    info = _read_token_embeddings(model_path)
    targets = _embedding_rows(model_path, info, _word_ids(model_path, COLOUR_WORDS))
    if info.architecture in _SCALES_TOKEN_EMBEDDINGS:
        targets = targets * np.float32(math.sqrt(info.n_embd))

    writer = GGUFWriter(str(out_path), "clip")
    writer.add_name(f"sluice colour projector ({kind}) for {model_path.name}")
    writer.add_description(
        "Test projector: sees each patch's mean colour as the words ' red', ' green', ' blue'."
    )
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    if kind == "mlp":
        writer.add_bool("clip.has_llava_projector", True)
    else:
        writer.add_uint32("clip.vision.projector.scale_factor", 1)  # no pooling: 16 tokens
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", VISION_WIDTH)
    writer.add_uint32("clip.vision.feed_forward_length", FFN_WIDTH)
    writer.add_uint32("clip.vision.projection_dim", info.n_embd)
    writer.add_uint32("clip.vision.block_count", 1)
    writer.add_uint32("clip.vision.attention.head_count", HEAD_COUNT)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", NORM_EPS)
    writer.add_array("clip.vision.image_mean", [0.0, 0.0, 0.0])  # pixels stay in [0, 1]
    writer.add_array("clip.vision.image_std", [1.0, 1.0, 1.0])
    tensors = _vision_tensors() | _projector_tensors(kind, targets)
    for name, array in tensors.items():
        # The conv kernel in f16 as converters write it (1/256 is exact); the rest f32.
        writer.add_tensor(
            name, array.astype(np.float16) if name == "v.patch_embd.weight" else array
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


# -- cached projectors for the packaged models ------------------------------------------------


def cache_dir() -> Path:
    """``$SLUICE_TEST_CACHE`` if set, else ``~/.cache/sluice-test/projectors``."""
    env = os.environ.get("SLUICE_TEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache/sluice-test/projectors"


def cached_projector(name: str, model_path: Path, tag: str, make: Callable[[Path], object]) -> Path:
    """The projector ``make(path)`` writes, built once into :func:`cache_dir` as
    ``mmproj-{name}-<digest>.gguf``, the digest naming ``tag`` (the generator's version and
    kind) and the model file's path, size and mtime; written to a temporary name and
    renamed, so concurrent test workers never see half a file."""
    st = model_path.stat()
    key = f"{tag}|{model_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"mmproj-{name}-{digest}.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    try:
        make(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def colour_projector(model: PackagedModel) -> Path:
    """The colour projector of a packaged model (``"smollm2"``: mlp; ``"gemma3"``: gemma3),
    built once into :func:`cache_dir` (:func:`cached_projector`, :data:`VERSION`)."""
    from sluice.models.catalog import resolve_model

    name, kind = _PACKAGED[model]
    model_path = resolve_model(name).path
    return cached_projector(
        f"colour-{model}",
        model_path,
        f"{VERSION}|{kind}",
        lambda out: make_projector(model_path, out, kind),
    )


def solid_png(rgb: tuple[int, int, int], size: int = 64) -> bytes:
    """A ``size`` x ``size`` PNG of the one colour ``rgb``."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(out, format="PNG")
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.projector",
        description="Write a colour-seeing test projector GGUF.",
    )
    parser.add_argument("model", choices=sorted(_PACKAGED), help="the packaged text model")
    parser.add_argument("out", nargs="?", type=Path, help="write here (default: the cache)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out is None:
        path = colour_projector(args.model)
    else:
        from sluice.models.catalog import resolve_model

        name, kind = _PACKAGED[args.model]
        path = make_projector(resolve_model(name).path, args.out, kind)
    took = time.perf_counter() - start
    print(f"{path} ({path.stat().st_size} bytes, {took:.1f} s)")


if __name__ == "__main__":
    main()
