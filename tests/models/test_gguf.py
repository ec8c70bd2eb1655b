"""GGUF metadata from the header, and the memory estimate measured against real loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFWriter

from sluice.models.catalog import resolve_model
from sluice.models.gguf import (
    GgufError,
    GgufInfo,
    estimate_memory,
    kv_cache_bytes,
    memory_estimate,
    params_string,
    read_gguf_info,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def smollm2() -> GgufInfo:
    return read_gguf_info(resolve_model("smollm2").path)


@pytest.fixture(scope="module")
def gemma() -> GgufInfo:
    return read_gguf_info(resolve_model("gemma3-270m").path)


# -- the real models ------------------------------------------------------------


def test_smollm2_metadata(smollm2: GgufInfo) -> None:
    path = resolve_model("smollm2").path
    assert smollm2.architecture == "llama"
    assert smollm2.quantization == "Q4_1"
    assert smollm2.size_label == smollm2.params_string == "135M"
    assert smollm2.n_params == 134_515_008
    assert smollm2.file_size == path.stat().st_size
    assert smollm2.bits_per_weight == pytest.approx(96_576_768 * 8 / 134_515_008, abs=0.01)
    assert smollm2.context_length == 8192
    assert (smollm2.block_count, smollm2.embedding_length, smollm2.feed_forward_length) == (
        30,
        576,
        1536,
    )
    assert (smollm2.head_count, smollm2.head_count_kv) == (9, 3)
    assert (smollm2.key_length, smollm2.value_length) == (64, 64)  # defaults: 576 / 9
    assert smollm2.sliding_window is None
    assert smollm2.n_vocab == 49152
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    assert smollm2.supports_tools is False
    assert smollm2.name and "Smollm2" in smollm2.name


def test_gemma_metadata(gemma: GgufInfo) -> None:
    assert gemma.architecture == "gemma3"
    assert gemma.quantization == "Q4_K_M"
    assert gemma.params_string == "270M"
    assert 260e6 < gemma.n_params < 280e6
    assert gemma.context_length == 32768
    assert (gemma.block_count, gemma.head_count, gemma.head_count_kv) == (18, 4, 1)
    assert (gemma.key_length, gemma.value_length) == (256, 256)  # explicit keys, not 640 / 4
    assert gemma.sliding_window == 512
    assert gemma.n_vocab == 262144
    assert gemma.chat_template is None and gemma.supports_tools is False
    assert dict(gemma.block_type_bytes)["Q4_K"] == 13_271_040  # llama.cpp repacks: 12.66 MiB


def test_agrees_with_the_gguf_packages_own_reader(smollm2: GgufInfo) -> None:
    reader = gguf.GGUFReader(smollm2.path)  # 1.7 s: the reason this module has its own parser
    assert smollm2.n_params == sum(int(t.n_elements) for t in reader.tensors)
    assert smollm2.tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert smollm2.n_vocab == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert smollm2.chat_template == reader.fields["tokenizer.chat_template"].contents()
    blocks = [0] * smollm2.block_count
    for t in reader.tensors:
        if t.name.startswith("blk."):
            blocks[int(t.name.split(".")[1])] += int(t.n_bytes)
    assert smollm2.layer_bytes == tuple(blocks)


def test_reading_is_fast_and_cached(smollm2: GgufInfo, gemma: GgufInfo) -> None:
    from sluice.models.gguf import _read_cached

    _read_cached.cache_clear()
    start = time.perf_counter()
    for info in (smollm2, gemma):
        assert read_gguf_info(info.path) == info
    uncached = time.perf_counter() - start
    assert uncached < 0.5, f"both headers took {uncached:.2f} s"  # measured: 8 + 18 ms
    assert read_gguf_info(gemma.path) is read_gguf_info(gemma.path)


# -- synthetic files --------------------------------------------------------------


def _write(path: Path, *, arch: str = "llama", split: int = 0, **options: object) -> None:
    """A small GGUF with gguf's own writer: 2 layers, a Q4_K and an F16 block tensor."""
    endian = GGUFEndian.BIG if options.get("big_endian") else GGUFEndian.LITTLE
    w = GGUFWriter(path, arch, endianess=endian, split_max_tensors=split)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(options.get("kv_heads", 2))  # type: ignore[arg-type]
    w.add_context_length(1024)
    if "template" in options:
        w.add_chat_template(str(options["template"]))
    if "file_type" in options:
        w.add_file_type(int(options["file_type"]))  # type: ignore[call-overload]
    w.add_token_list(["a", "b", "c"])
    w.add_token_scores([0.0, 0.0, 0.0])
    w.add_tensor("token_embd.weight", np.zeros((3, 64), np.float32))
    w.add_tensor(
        "blk.0.attn_q.weight", np.zeros((4, 144), np.uint8), raw_dtype=GGMLQuantizationType.Q4_K
    )
    w.add_tensor("blk.1.attn_q.weight", np.zeros((64, 64), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_defaults_and_derived_fields(tmp_path: Path) -> None:
    _write(tmp_path / "m.gguf", kv_heads=[2, 1], template="{% if tools %}{{ tools }}{% endif %}")
    info = read_gguf_info(tmp_path / "m.gguf")
    assert (info.key_length, info.value_length) == (16, 16)  # 64 / 4
    assert info.head_count_kv == 2  # per-layer counts: the largest
    assert info.n_params == 3 * 64 + 4 * 256 + 64 * 64
    assert info.tensor_bytes == 3 * 64 * 4 + 4 * 144 + 64 * 64 * 2
    assert info.layer_bytes == (4 * 144, 64 * 64 * 2)
    assert info.quantization == "F16"  # no general.file_type: the type with the most bytes
    assert info.params_string == "5.3K" and info.size_label is None
    assert info.supports_tools is True and info.n_vocab == 3
    assert info.context_length == 1024 and info.sliding_window is None


def test_file_type_names(tmp_path: Path) -> None:
    _write(tmp_path / "a.gguf", file_type=gguf.LlamaFileType.MOSTLY_Q5_K_S)
    _write(tmp_path / "b.gguf", file_type=0)
    assert read_gguf_info(tmp_path / "a.gguf").quantization == "Q5_K_S"
    assert read_gguf_info(tmp_path / "b.gguf").quantization == "F32"


def test_big_endian_file(tmp_path: Path) -> None:
    _write(tmp_path / "le.gguf")
    _write(tmp_path / "be.gguf", big_endian=True)
    le, be = read_gguf_info(tmp_path / "le.gguf"), read_gguf_info(tmp_path / "be.gguf")
    assert (be.n_params, be.block_count, be.head_count_kv) == (le.n_params, 2, 2)


def test_split_model_counts_every_shard(tmp_path: Path) -> None:
    _write(tmp_path / "whole.gguf")
    _write(tmp_path / "m.gguf", split=2)  # m-00001-of-00002.gguf, m-00002-of-00002.gguf
    first = tmp_path / "m-00001-of-00002.gguf"
    info, whole = read_gguf_info(first), read_gguf_info(tmp_path / "whole.gguf")
    assert (info.n_params, info.layer_bytes) == (whole.n_params, whole.layer_bytes)
    assert info.file_size == sum(p.stat().st_size for p in tmp_path.glob("m-*.gguf"))
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(GgufError, match="missing: m-00002-of-00002.gguf"):
        read_gguf_info(first)


def test_cache_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path, file_type=3)
    assert read_gguf_info(path).quantization == "Q4_1"
    _write(path, file_type=15)
    os.utime(path, ns=(1, 1))  # a different mtime even on a coarse clock
    assert read_gguf_info(path).quantization == "Q4_K_M"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"NOPE" + bytes(20), "not a GGUF file"),
        (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little"), "truncated"),
        (b"GGUF" + (9).to_bytes(4, "little") + bytes(16), "version 9"),
    ],
)
def test_bad_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match=message):
        read_gguf_info(path)


def test_params_string() -> None:
    assert [params_string(n) for n in (134_515_008, 1_540_000_000, 7_000_000_000, 999)] == [
        "135M",
        "1.5B",
        "7B",
        "999",
    ]


# -- memory -------------------------------------------------------------------------


def test_kv_cache_matches_llama_cpp(smollm2: GgufInfo, gemma: GgufInfo) -> None:
    """The sizes llama.cpp logs ("llama_kv_cache: size = ...") for these settings."""
    est = memory_estimate(smollm2, ctx_per_seq=4096, parallel=4, batch=512)
    assert est.kv_cache == 360 * MiB
    # Gemma's SWA layers get full-size caches (swa_full): 48 MiB + 240 MiB.
    assert memory_estimate(gemma, ctx_per_seq=4096, parallel=4, batch=512).kv_cache == 288 * MiB
    # 1000 tokens per sequence: llama.cpp rounds each up to 1024 cells.
    odd = memory_estimate(smollm2, ctx_per_seq=1000, parallel=3, batch=256)
    assert odd.kv_cache == kv_cache_bytes(smollm2, 3072) == int(67.5 * MiB)


def test_estimate_parts(smollm2: GgufInfo) -> None:
    base = memory_estimate(smollm2, ctx_per_seq=512, parallel=2, batch=512)
    assert base.weights == smollm2.file_size  # Q4_1: nothing the CPU backend repacks
    assert estimate_memory(smollm2, ctx_per_seq=512, parallel=2, batch=512) == base.total
    logits = memory_estimate(smollm2, ctx_per_seq=512, parallel=2, batch=512, all_logits=True)
    assert logits.compute - base.compute == 2 * 49152 * (512 - 2) * 4
    offloaded = memory_estimate(smollm2, ctx_per_seq=512, parallel=2, batch=512, gpu_layers=10)
    assert base.weights - offloaded.weights == sum(smollm2.layer_bytes[-10:])
    assert offloaded.kv_cache == base.kv_cache * 20 // 30
    every = memory_estimate(smollm2, ctx_per_seq=512, parallel=2, batch=512, gpu_layers=-1)
    assert every.kv_cache == 0
    with pytest.raises(ValueError):
        memory_estimate(smollm2, ctx_per_seq=0, parallel=1, batch=512)


def test_unfused_attention_adds_a_batch_of_scores(smollm2: GgufInfo) -> None:
    fused = memory_estimate(smollm2, ctx_per_seq=1000, parallel=2, batch=512)
    plain = memory_estimate(
        smollm2, ctx_per_seq=1000, parallel=2, batch=512, unfused_attention=True
    )
    assert plain.compute - fused.compute == 2 * 4 * 9 * 1024 * 512  # 9 heads, 1024 cells
    off = estimate_memory(smollm2, ctx_per_seq=1000, parallel=2, batch=512, flash_attn="off")
    assert off == plain.total
    assert estimate_memory(smollm2, ctx_per_seq=1000, parallel=2, batch=512) == fused.total


def test_repacked_weights_counted_twice(gemma: GgufInfo) -> None:
    est = memory_estimate(gemma, ctx_per_seq=512, parallel=1, batch=512)
    assert est.weights >= gemma.file_size + 13_271_040


# A clean process per setting: RSS growth from just before the load to just after
# a full batch (prefill of seq 0) and one more decode touching every sequence.
_CHILD = """
import json, sys
from sluice.models.catalog import resolve_model
from sluice.engine.llama_runner import LlamaRunner, LlamaRunnerConfig, _init_backend
from sluice.engine.runner import BatchEntry

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

name, ctx, parallel, batch = sys.argv[1], *map(int, sys.argv[2:5])
path = str(resolve_model(name).path)
_init_backend()
before = rss()
runner = LlamaRunner.load(LlamaRunnerConfig(
    model_path=path, n_parallel=parallel, n_ctx=ctx, n_batch=batch, n_threads=1,
    flash_attn=sys.argv[5]))
n = min(runner.n_batch, runner.n_ctx_seq // 2)
tokens = runner.tokenize("hello world " * 5000, add_special=True)[:n]
runner.decode([BatchEntry(0, tokens, 0)])
runner.decode([BatchEntry(0, tokens[:1], n)] + [BatchEntry(s, tokens[:1], 0) for s in range(1, parallel)])
print(json.dumps({"rss": rss() - before}))
"""

# (model, ctx per sequence, parallel, batch): small and large KV caches and two
# batch sizes on both models. Larger batches were measured too (in bounds: 1.13x
# and 1.24x at batch 2048) but a 2048-token prefill on one thread takes 15 s.
_SETTINGS = [
    ("smollm2", 512, 1, 512, "auto"),
    ("smollm2", 4096, 4, 512, "auto"),
    ("smollm2", 4096, 2, 512, "off"),  # unfused attention: a batch's scores too
    ("gemma3-270m", 2048, 2, 256, "auto"),
    ("gemma3-270m", 4096, 4, 512, "auto"),
]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_estimate_bounds_measured_memory(smollm2: GgufInfo, gemma: GgufInfo) -> None:
    """measured <= estimate <= 1.6 x measured + 64 MiB, for real loads.

    The upper margin: the estimate is meant for refusing loads that would not
    fit, so it may be generous, but not so much that it refuses loads that would.
    """
    infos = {"smollm2": smollm2, "gemma3-270m": gemma}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, name, *map(str, numbers)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, *numbers in _SETTINGS
    ]
    rows, failures = [], []
    for (name, ctx, parallel, batch, fa), child in zip(_SETTINGS, children):
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-2000:]
        measured = json.loads(out.splitlines()[-1])["rss"]
        est = estimate_memory(
            infos[name], ctx_per_seq=ctx, parallel=parallel, batch=batch, flash_attn=fa
        )
        row = f"{name} ctx={ctx} x{parallel} batch={batch} flash_attn={fa}: measured {measured / MiB:.0f} MiB, "
        rows.append(row + f"estimate {est / MiB:.0f} MiB ({est / measured:.2f}x)")
        if not measured <= est <= 1.6 * measured + 64 * MiB:
            failures.append(rows[-1])
    assert not failures, "\n".join(rows)


def test_symlinked_shards_are_found_by_their_link_names(tmp_path: Path) -> None:
    """Hub-style caches link shard names to content-named blobs."""
    _write(tmp_path / "m.gguf", split=2)
    (tmp_path / "blobs").mkdir()
    (tmp_path / "links").mkdir()
    for i, shard in enumerate(sorted(tmp_path.glob("m-*.gguf"))):
        shard.rename(tmp_path / "blobs" / f"sha{i}")
        (tmp_path / "links" / shard.name).symlink_to(tmp_path / "blobs" / f"sha{i}")
    info = read_gguf_info(tmp_path / "links/m-00001-of-00002.gguf")
    assert info.layer_bytes == (4 * 144, 64 * 64 * 2)
