"""Embeddings on llama.cpp: a pooled context beside a model's generation context.

A loaded model gets one on its first embedding request: a second
``llama_context`` on the same weights with ``embeddings`` on and a pooling type,
the GGUF's own when it declares one (``<arch>.pooling_type``: an embedding model),
else mean pooling (the chat models, as llama.cpp's server does with ``--pooling
mean``). Several inputs go through one ``llama_decode``, one sequence each, as many
as fit ``n_batch`` tokens; each sequence's pooled vector is read with
``llama_get_embeddings_seq`` and L2-normalized, like the peers.

It runs on worker threads, one decode at a time per context, the inputs of concurrent
requests decoded together (``engine/embed_batch.py``): never on the engine thread, so
generation goes on beside it. Inputs of up to :data:`SHORT_LANE` tokens have a
context of their own (when the main one is larger): a long input's decode, seconds
on a CPU, never holds a short one (another key's few words) behind it.

Example::

    embedder = LlamaEmbedder.create(runner, n_ctx=2048)
    vectors = embedder.embed([tokens_a, tokens_b])
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from sluice.core.backend import Vector
from sluice.core.errors import ModelLoadFailed
from sluice.engine.embed_batch import EmbedBatcher
from sluice.engine.llama_runner import LlamaRunner, _llama
from sluice.engine.runner import DecodeError

log = logging.getLogger("sluice.llama")

_MAX_SEQS = 64  # inputs in one decode (llama.cpp's n_seq_max)
SHORT_LANE = 512  # tokens: inputs up to this many have a context of their own


def embedder_bytes(runner: LlamaRunner, n_ctx: int) -> int:
    """What an embedder of ``n_ctx`` tokens holds (its short lane's context too),
    known before it is made. The memory guard counts it."""
    short = _context_bytes(runner, SHORT_LANE) if n_ctx > SHORT_LANE else 0
    return _context_bytes(runner, n_ctx) + short


def _context_bytes(runner: LlamaRunner, n_ctx: int) -> int:
    """One pooled context of ``n_ctx`` tokens: its KV cells (f16 K and V in every
    layer), the attention mask of a full batch and the pooled outputs."""
    meta, arch = runner.meta, runner.architecture

    def num(key: str, default: int = 0) -> int:
        value = meta(f"{arch}.{key}")
        try:
            return int(value) if value is not None else default
        except ValueError:
            return default

    n_embd = int(_llama().llama_model_n_embd(runner.model))
    heads = num("attention.head_count", 1) or 1
    head_dim = n_embd // heads
    kv_heads = num("attention.head_count_kv", heads)
    k = num("attention.key_length", head_dim)
    v = num("attention.value_length", head_dim)
    kv = num("block_count") * n_ctx * kv_heads * (k + v) * 2
    return kv + n_ctx * n_ctx * 4 + n_ctx * n_embd * 4 * 4


class _Lane:
    """One pooled context and the batcher that shares its decodes."""

    def __init__(self, runner: LlamaRunner, ctx: Any, n_ctx: int) -> None:
        self._L = _llama()
        self._ctx = ctx
        self.n_ctx = n_ctx  # tokens per decode, and so per input
        self.n_embd = int(self._L.llama_model_n_embd(runner.model))
        self._mem = self._L.llama_get_memory(ctx)
        self._batch = self._L.llama_batch_init(n_ctx, 0, 1)
        self.batcher = EmbedBatcher(self._decode, max_tokens=n_ctx, max_seqs=_MAX_SEQS)

    @classmethod
    def create(cls, runner: LlamaRunner, n_ctx: int, threads: int) -> tuple[_Lane, str]:
        """The context (blocking: llama.cpp allocates its buffers) and its pooling."""
        L = _llama()
        declared = runner.meta(f"{runner.architecture}.pooling_type")
        cparams = L.llama_context_default_params()
        cparams.embeddings = True
        if declared not in (None, "0"):  # the GGUF's own (an embedding model)
            cparams.pooling_type = L.LLAMA_POOLING_TYPE_UNSPECIFIED
            pooling = {"1": "mean", "2": "cls", "3": "last", "4": "rank"}.get(declared, declared)
        else:
            cparams.pooling_type = L.LLAMA_POOLING_TYPE_MEAN
            pooling = "mean"
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_ctx
        cparams.n_ubatch = n_ctx  # a sequence is pooled within one ubatch
        cparams.n_seq_max = _MAX_SEQS
        cparams.kv_unified = True
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        ctx = L.llama_init_from_model(runner.model, cparams)
        if not ctx:
            raise ModelLoadFailed(
                "llama.cpp could not create an embedding context (out of memory?)"
            )
        return cls(runner, ctx, n_ctx), pooling

    def _decode(self, group: list[list[int]]) -> list[Vector]:
        L, batch = self._L, self._batch
        i = 0
        for seq, tokens in enumerate(group):
            for pos, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = True  # pooling reads every position
                i += 1
        batch.n_tokens = i
        L.llama_memory_clear(self._mem, True)
        rc = L.llama_decode(self._ctx, batch)
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc} (embeddings)")
        vectors = []
        for seq in range(len(group)):
            ptr = L.llama_get_embeddings_seq(self._ctx, seq)
            if not ptr:
                raise DecodeError(f"no pooled embedding for sequence {seq}")
            vec = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_embd,)
            )
            v = vec.astype(np.float64)  # a copy: the next decode reuses the buffer
            norm = float(np.linalg.norm(v))
            vectors.append((v / norm if norm > 0 else v).astype(np.float32))
        return vectors

    def close(self) -> None:
        if self._ctx:
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self._ctx)
            self._ctx = None


class LlamaEmbedder:
    """A pooled embedding context on a loaded runner's model (and its short lane)."""

    def __init__(self, runner: LlamaRunner, main: _Lane, short: _Lane | None, pooling: str) -> None:
        self._main = main
        self._short = short
        self.n_ctx = main.n_ctx  # tokens one input may have
        self.n_embd = main.n_embd
        self.pooling = pooling  # "mean", or what the GGUF declares
        self.bytes = embedder_bytes(runner, main.n_ctx)

    @classmethod
    def create(cls, runner: LlamaRunner, n_ctx: int, threads: int) -> LlamaEmbedder:
        """The embedding contexts (blocking: llama.cpp allocates their buffers)."""
        main, pooling = _Lane.create(runner, n_ctx, threads)
        short = None
        if n_ctx > SHORT_LANE:
            try:
                short, _ = _Lane.create(runner, SHORT_LANE, threads)
            except BaseException:
                main.close()
                raise
        return cls(runner, main, short, pooling)

    def embed(self, inputs: Sequence[list[int]]) -> list[Vector]:
        """One L2-normalized vector per input (token ids; each 1 to ``n_ctx`` of them,
        which the caller checked); concurrent calls share decodes (``EmbedBatcher``),
        short inputs in their own lane."""
        short = self._short
        if short is None:
            return self._main.batcher.embed(inputs)
        fits = [len(t) <= short.n_ctx for t in inputs]
        if all(fits):
            return short.batcher.embed(inputs)
        if not any(fits):
            return self._main.batcher.embed(inputs)
        out: list[Vector | None] = [None] * len(inputs)
        for lane, mine in ((short, True), (self._main, False)):
            where = [i for i, f in enumerate(fits) if f is mine]
            for i, vector in zip(where, lane.batcher.embed([inputs[i] for i in where])):
                out[i] = vector
        return [v for v in out if v is not None]

    def close(self) -> None:
        """Free the contexts (the model's users have finished: ``LocalModel.close``)."""
        self._main.close()
        if self._short is not None:
            self._short.close()
