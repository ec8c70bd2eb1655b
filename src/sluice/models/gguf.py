"""What a GGUF file holds, read from its header, and what loading it costs in RAM.

:func:`read_gguf_info` parses the header only (metadata and tensor table) with
the ``gguf`` package's constants (value types, quantization block sizes, the
``llama_ftype`` names). It does not use ``gguf.GGUFReader``: that reader builds
an object for every element of every array, so the tokenizer's vocabulary
alone takes it 1.7 s on SmolLM2 and 8 s on Gemma 3 (262,144 tokens); this
parser steps over arrays it does not need and reads both in milliseconds.
Results are cached by (path, size, mtime).

:func:`estimate_memory` is the host RAM a load needs, calibrated against
llama.cpp's real allocations (tests/models/test_gguf.py measures them).

Example::

    info = read_gguf_info("SmolLM2-135M-Instruct.Q4_1.gguf")
    info.architecture, info.quantization, info.params_string  # "llama", "Q4_1", "135M"
    estimate_memory(info, ctx_per_seq=4096, parallel=4, batch=512)  # 550_036_544 (525 MiB)
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import platform
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from sluice.core.request import SamplerDefaults
from sluice.engine.attention import scores_bytes, unfused

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format (GGUFValueType's numbering).
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
# Numeric arrays up to this length keep their values (per-layer head counts);
# longer ones (token scores and types) keep only their length.
_KEEP_ARRAY = 4096
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")

Value = int | float | bool | str | tuple[int | float | bool, ...]


class GgufError(ValueError):
    """The file is not a GGUF file this reader understands (the message says why)."""


@dataclass(frozen=True, slots=True)
class GgufInfo:
    """The metadata a model listing and the memory guard need."""

    path: str
    file_size: int  # bytes, all shards of a split model
    architecture: str
    name: str | None  # general.name
    organization: str | None  # general.organization (LM Studio's "publisher")
    size_label: str | None  # general.size_label, e.g. "135M"
    params_string: str  # size_label, else derived from n_params
    n_params: int  # sum of the tensors' element counts
    tensor_bytes: int
    quantization: str  # "Q4_K_M"; from general.file_type, else the dominant tensor type
    bits_per_weight: float  # tensor_bytes * 8 / n_params
    n_vocab: int
    context_length: int | None  # trained context
    block_count: int
    embedding_length: int
    feed_forward_length: int  # largest, if per layer
    head_count: int  # largest, if per layer
    head_count_kv: int  # largest, if per layer
    key_length: int
    value_length: int
    sliding_window: int | None
    chat_template: str | None
    supports_tools: bool  # the chat template mentions ``tools``
    sampling: dict[str, float]  # its recommended sampling (general.sampling.*): field -> value
    layer_bytes: tuple[int, ...]  # tensor bytes of each repeating block (blk.N.*)
    block_type_bytes: tuple[tuple[str, int], ...]  # blk.* tensor bytes by type: ("Q4_K", n)


def replay_info(path: str, size: int, template: str | None, ctx: int) -> GgufInfo:
    """What a listing shows of a replay model (recorded answers, no weights)."""
    return GgufInfo(
        path=path,
        file_size=size,
        architecture="replay",
        name=None,
        organization=None,
        size_label=None,
        params_string="0",
        n_params=0,
        tensor_bytes=0,
        quantization="none",
        bits_per_weight=0.0,
        n_vocab=0,
        context_length=ctx,
        block_count=0,
        embedding_length=0,
        feed_forward_length=0,
        head_count=0,
        head_count_kv=0,
        key_length=0,
        value_length=0,
        sliding_window=None,
        chat_template=template,
        supports_tools=bool(template and "tools" in template),
        sampling={},
        layer_bytes=(),
        block_type_bytes=(),
    )


# -- the header -----------------------------------------------------------------


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, advancing an offset."""

    __slots__ = ("_u64", "buf", "order", "pos")

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf = buf
        self.pos = 0
        self.order = order
        self._u64 = struct.Struct(order + "Q")

    def scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value  # type: ignore[no-any-return]

    def u32(self) -> int:
        return int(self.scalar("I"))

    def u64(self) -> int:
        (value,) = self._u64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def string(self) -> str:
        n = self.u64()
        end = self.pos + n
        if end > len(self.buf):
            raise GgufError("a string runs past the end of the file")
        text = self.buf[self.pos : end].decode("utf-8", "replace")
        self.pos = end
        return text

    def value(self, vtype: int) -> Value:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self._array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GgufError(f"unknown metadata value type {vtype}")
        return self.scalar(fmt)

    def _array(self) -> Value:
        itype, count = self.u32(), self.u64()
        if count > len(self.buf) - self.pos:  # every element takes at least a byte
            raise GgufError("an array is longer than the file")
        fmt = _SCALAR_FORMATS.get(itype)
        if fmt is not None and count <= _KEEP_ARRAY:
            items = struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, self.pos)
            self.pos += struct.calcsize(f"{count}{fmt}")
            return tuple(items)
        self._skip_array(itype, count, fmt)
        return count  # a long array: only its length (the vocabulary size, for tokens)

    def _skip_array(self, itype: int, count: int, fmt: str | None) -> None:
        if fmt is not None:
            self.pos += count * struct.calcsize(fmt)
        elif itype == _STRING:
            # The only per-element work left: each string's length (fast: one unpack each).
            unpack, buf, pos = self._u64.unpack_from, self.buf, self.pos
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
        else:  # nested arrays: rare (no model key uses them); walk them
            for _ in range(count):
                self.value(itype)


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    elements: int
    nbytes: int
    ggml_type: GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class _Header:
    metadata: dict[str, Value]
    tensors: list[_Tensor]


def _read_header(path: Path) -> _Header:
    with path.open("rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise GgufError(f"{path} is empty") from exc
    with buf:
        try:
            return _parse(buf, path)
        except struct.error as exc:
            raise GgufError(f"{path} is truncated or corrupt ({exc})") from exc


def _parse(buf: mmap.mmap, path: Path) -> _Header:
    if buf[:4] != _MAGIC:
        raise GgufError(f"{path} is not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    # A file written on a big-endian machine reads as a version with low bits 0.
    order = "<" if version & 0xFFFF else ">"
    cur = _Cursor(buf, order)
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise GgufError(f"{path}: GGUF version {version} is not supported")
    n_tensors, n_kv = cur.u64(), cur.u64()
    metadata: dict[str, Value] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.u32())
    tensors = [_tensor_info(cur) for _ in range(n_tensors)]
    return _Header(metadata, tensors)


def _tensor_info(cur: _Cursor) -> _Tensor:
    name = cur.string()
    dims = [cur.u64() for _ in range(cur.u32())]
    raw_type = cur.u32()
    cur.u64()  # data offset: not needed
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError) as exc:
        raise GgufError(f"tensor {name!r} has an unknown type {raw_type}") from exc
    elements = math.prod(dims)
    return _Tensor(name, elements, elements * type_size // block, ggml_type)


# -- interpretation -------------------------------------------------------------


def read_gguf_info(path: str | os.PathLike[str]) -> GgufInfo:
    """The metadata of a ``.gguf`` file (the first shard, for a split model).

    Raises :class:`GgufError` for a file that is not GGUF, and ``OSError``
    for one that cannot be read. Cached until the size or mtime of the file,
    or of one of its shards, changes.
    """
    # Absolute, not resolved: a symlinked shard keeps the name its siblings are found by.
    p = Path(os.path.abspath(Path(path).expanduser()))
    st = p.stat()
    stamps = ((st.st_size, st.st_mtime_ns), *(_stamp(s) for s in _named_shards(p)))
    return _read_cached(str(p), stamps)


def projector_inputs(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """What a projector (mmproj) GGUF takes besides text: ``"image"`` (a vision
    encoder) and ``"audio"`` (an audio encoder), by its ``clip.has_*_encoder`` keys; an
    unreadable file takes nothing. Cached until the file changes."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    try:
        return _projector_inputs(str(p), _stamp(p))
    except (GgufError, OSError):
        return ()


@functools.lru_cache(maxsize=64)
def _projector_inputs(path: str, _stamp: tuple[int, int] | None) -> tuple[str, ...]:
    metadata = _read_header(Path(path)).metadata
    # Files from before the keys: a vision projector (audio came with the keys).
    vision = metadata.get("clip.has_vision_encoder", "clip.has_audio_encoder" not in metadata)
    audio = metadata.get("clip.has_audio_encoder", False)
    return tuple(k for k, on in (("image", vision), ("audio", audio)) if on is True)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None  # a missing shard: reading reports it
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=256)
def _read_cached(path: str, stamps: tuple[tuple[int, int] | None, ...]) -> GgufInfo:
    p = Path(path)
    header = _read_header(p)
    tensors = list(header.tensors)
    file_size = p.stat().st_size
    for shard in _other_shards(p, header.metadata):
        tensors += _read_header(shard).tensors
        file_size += shard.stat().st_size
    return _interpret(path, file_size, header.metadata, tensors)


def _named_shards(path: Path) -> list[Path]:
    """Shards 2..n, by the first one's name ``x-00001-of-0000n.gguf``."""
    m = _SHARD.search(path.name)
    if m is None or int(m.group(1)) != 1:
        return []
    stem, count = path.name[: m.start()], int(m.group(2))
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]


def _other_shards(path: Path, metadata: Mapping[str, Value]) -> list[Path]:
    """Shards 2..n of a split model: they hold the rest of the tensors."""
    count = metadata.get("split.count")
    if not isinstance(count, int) or count <= 1:
        return []
    shards = _named_shards(path)
    if len(shards) != count - 1:
        raise GgufError(f"{path.name} is one of {count} shards, but not named like a first one")
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise GgufError(f"{path.name} is split in {count} files; missing: {', '.join(missing)}")
    return shards


def _interpret(
    path: str, file_size: int, md: Mapping[str, Value], tensors: list[_Tensor]
) -> GgufInfo:
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise GgufError(f"{path} has no general.architecture")
    n_params = sum(t.elements for t in tensors)
    tensor_bytes = sum(t.nbytes for t in tensors)
    embd = _int(md, f"{arch}.embedding_length", 0)
    heads = _int(md, f"{arch}.attention.head_count", 0)
    head_dim = embd // heads if heads else 0
    blocks = _int(md, f"{arch}.block_count", 0)
    template = _str(md, "tokenizer.chat_template")
    size_label = _str(md, "general.size_label")
    return GgufInfo(
        path=path,
        file_size=file_size,
        architecture=arch,
        name=_str(md, "general.name"),
        organization=(_str(md, "general.organization") or "").strip() or None,
        size_label=size_label,
        params_string=size_label or params_string(n_params),
        n_params=n_params,
        tensor_bytes=tensor_bytes,
        quantization=_quantization(md, tensors),
        bits_per_weight=round(tensor_bytes * 8 / n_params, 2) if n_params else 0.0,
        n_vocab=_vocab_size(md, arch),
        context_length=_int(md, f"{arch}.context_length", 0) or None,
        block_count=blocks,
        embedding_length=embd,
        feed_forward_length=_int(md, f"{arch}.feed_forward_length", 0),
        head_count=heads,
        head_count_kv=_int(md, f"{arch}.attention.head_count_kv", heads),
        key_length=_int(md, f"{arch}.attention.key_length", head_dim),
        value_length=_int(md, f"{arch}.attention.value_length", head_dim),
        sliding_window=_int(md, f"{arch}.attention.sliding_window", 0) or None,
        chat_template=template,
        supports_tools=any("tools" in t for t in _templates(md)),
        sampling=SamplerDefaults.from_gguf(md.get),
        layer_bytes=_layer_bytes(tensors, blocks),
        block_type_bytes=_block_type_bytes(tensors),
    )


def _int(md: Mapping[str, Value], key: str, default: int) -> int:
    """An integer key; the largest value of a per-layer array (an upper bound)."""
    value = md.get(key)
    if isinstance(value, tuple):
        numbers = [int(v) for v in value]
        return max(numbers) if numbers else default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return default


def _str(md: Mapping[str, Value], key: str) -> str | None:
    value = md.get(key)
    return value if isinstance(value, str) else None


def _templates(md: Mapping[str, Value]) -> list[str]:
    # Besides the default, a file may carry named ones (``tokenizer.chat_template.tool_use``).
    return [
        v for k, v in md.items() if k.startswith("tokenizer.chat_template") and isinstance(v, str)
    ]


def _vocab_size(md: Mapping[str, Value], arch: str) -> int:
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        return tokens  # a long array: its length
    if isinstance(tokens, tuple):
        return len(tokens)
    return _int(md, f"{arch}.vocab_size", 0)


def _quantization(md: Mapping[str, Value], tensors: list[_Tensor]) -> str:
    file_type = md.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        try:
            name = LlamaFileType(file_type).name
        except ValueError:
            name = ""
        if name and name != "GUESSED":
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return _dominant_type(tensors)


def _dominant_type(tensors: list[_Tensor]) -> str:
    """Without ``general.file_type``: the tensor type holding the most bytes ("Q4_K")."""
    totals: dict[GGMLQuantizationType, int] = {}
    for t in tensors:
        totals[t.ggml_type] = totals.get(t.ggml_type, 0) + t.nbytes
    if not totals:
        return "unknown"
    return max(totals, key=lambda k: totals[k]).name


def _layer_bytes(tensors: list[_Tensor], blocks: int) -> tuple[int, ...]:
    sizes = [0] * blocks
    for t in tensors:
        if t.name.startswith("blk."):
            index = t.name.split(".", 2)[1]
            if index.isdigit() and int(index) < blocks:
                sizes[int(index)] += t.nbytes
    return tuple(sizes)


def _block_type_bytes(tensors: list[_Tensor]) -> tuple[tuple[str, int], ...]:
    totals: dict[str, int] = {}
    for t in tensors:
        if t.name.startswith("blk.") and len(t.name.split(".")) > 3:
            totals[t.ggml_type.name] = totals.get(t.ggml_type.name, 0) + t.nbytes
    return tuple(sorted(totals.items()))


def params_string(n_params: int) -> str:
    """``134_515_008`` -> ``"135M"``, ``1_540_000_000`` -> ``"1.5B"`` (LM Studio's style)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n_params >= scale:
            value = n_params / scale
            text = f"{value:.0f}" if value >= 100 else f"{value:.1f}".removesuffix(".0")
            return text + suffix
    return str(n_params)


# -- memory ---------------------------------------------------------------------

_MiB = 1 << 20
_KV_PAD = 256  # llama.cpp rounds each sequence's KV cells up to a multiple of this
_F16, _F32 = 2, 4
# Weight types the CPU backend may copy into its repacked (interleaved) layout at
# load. The copy is anonymous memory; the mmapped originals stay resident as well.
_REPACKED = frozenset({"Q4_0", "Q4_K", "IQ4_NL", "Q2_K", "MXFP4"})
_REPACKED_ARM = _REPACKED | {"Q8_0", "Q5_K", "Q6_K", "Q1_0"}
# llama.cpp's vocabulary tables and the runner's per-token caches (measured: 16.5 MB
# for 49k tokens with BPE merges, 36 MB for 262k tokens in llama.cpp, about as much
# again in the runner's Python caches), plus a base for allocator slack, thread
# buffers and the serving side's per-model objects (template, parser).
_PER_TOKEN = 400
_BASE = 32 * _MiB


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Host RAM of one loaded model, by part (bytes)."""

    weights: int  # the mapped file (resident once read) and repacked copies
    kv_cache: int
    compute: int  # activations, attention masks and logits of one batch
    overhead: int  # vocabulary tables and caches

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.overhead


def memory_estimate(
    info: GgufInfo,
    *,
    ctx_per_seq: int,
    parallel: int,
    batch: int,
    gpu_layers: int = 0,
    all_logits: bool = False,
    unfused_attention: bool = False,
) -> MemoryEstimate:
    """Host RAM a load with these settings needs, by part; an upper bound.

    Settings as :class:`~sluice.engine.llama_runner.LlamaRunner` passes them to
    llama.cpp: ``ctx_per_seq * parallel`` cells in ``parallel`` KV streams, f16 K
    and V, ``n_batch = n_ubatch = batch``. ``gpu_layers``: repeating layers
    actually offloaded (their weights and KV cache leave host RAM); pass 0 for a
    llama.cpp without a GPU backend, which ignores the setting. ``all_logits``:
    count a batch with logits for every token (echo with logprobs), which makes
    llama.cpp touch its whole logits buffer and grow its output buffer to match:
    ``2 * n_vocab * batch * 4`` bytes (1 GiB for Gemma 3 at batch 512).
    ``unfused_attention``: flash attention off (see :mod:`sluice.engine.attention`),
    which adds a batch's attention scores at a full context.
    """
    if min(ctx_per_seq, parallel, batch) < 1:
        raise ValueError("ctx_per_seq, parallel and batch must be positive")
    blocks = info.block_count
    offloaded = blocks if gpu_layers < 0 else min(gpu_layers, blocks)
    on_host = (blocks - offloaded) / blocks if blocks else 1.0
    cells_seq = -(-ctx_per_seq // _KV_PAD) * _KV_PAD
    weights = info.file_size - sum(info.layer_bytes[blocks - offloaded :])
    weights += int(_repacked_bytes(info) * on_host)
    return MemoryEstimate(
        weights=weights,
        kv_cache=int(kv_cache_bytes(info, cells_seq * parallel) * on_host),
        compute=_compute_bytes(info, cells_seq, parallel, batch, all_logits)
        + (scores_bytes(info.head_count, cells_seq, batch) if unfused_attention else 0),
        overhead=_BASE + _PER_TOKEN * info.n_vocab,
    )


def estimate_memory(
    info: GgufInfo,
    *,
    ctx_per_seq: int,
    parallel: int,
    batch: int,
    gpu_layers: int = 0,
    flash_attn: str = "auto",
) -> int:
    """Bytes of host RAM a load with the ``--flash-attn`` choice ``flash_attn`` needs:
    :func:`memory_estimate`'s total (``gpu_layers`` as there)."""
    return memory_estimate(
        info,
        ctx_per_seq=ctx_per_seq,
        parallel=parallel,
        batch=batch,
        gpu_layers=gpu_layers,
        unfused_attention=unfused(flash_attn),
    ).total


def kv_cache_bytes(info: GgufInfo, cells: int) -> int:
    """f16 K and V for ``cells`` tokens in every layer.

    Exact for llama.cpp's defaults, including sliding-window models: contexts
    are created with ``swa_full`` (llama.cpp logs "using full-size SWA cache"),
    so SWA layers get as many cells as the others. Per-layer KV head counts are
    taken at their largest, and recurrent/hybrid models are counted as if every
    layer were attention: both only over-estimate.
    """
    per_cell = info.head_count_kv * (info.key_length + info.value_length) * _F16
    return info.block_count * cells * per_cell


def _repacked_bytes(info: GgufInfo) -> int:
    kinds = _REPACKED_ARM if platform.machine().lower() in ("arm64", "aarch64") else _REPACKED
    return sum(n for kind, n in info.block_type_bytes if kind in kinds)


def _compute_bytes(
    info: GgufInfo, cells_seq: int, parallel: int, batch: int, all_logits: bool
) -> int:
    """The part of llama.cpp's compute buffer a batch touches, and the output buffer.

    llama.cpp reserves room for logits of a whole batch (``n_vocab * batch``
    floats: 512 MiB for Gemma 3 at batch 512), but a batch that wants one logit
    row per sequence touches only those rows, and untouched pages take no RAM.
    What grows with the settings: the attention masks (one per attention kind,
    ``cells x batch`` floats) and the activations of ``batch`` tokens.
    """
    masks = 2 if info.sliding_window else 1
    width = max(info.embedding_length, info.head_count * info.key_length)
    activations = batch * _F32 * (4 * width + 2 * info.feed_forward_length)
    rows = batch if all_logits else parallel
    logits = 2 * info.n_vocab * rows * _F32  # the graph's copy and the output buffer
    return masks * cells_seq * batch * _F32 + activations + logits
