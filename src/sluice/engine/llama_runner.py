"""The real model runner: llama.cpp through llama-cpp-python's low-level API.

This module and its parts (``llama_sampling``: the samplers; ``llama_vocab``: the
control-token table; ``llama_embed``: pooled contexts) are the only ones that touch
the bindings. One context holds
``n_parallel`` sequences, each with its own KV stream of ``n_ctx`` tokens
(``kv_unified=False``: a sequence attends only to its own cells, which is
measurably faster for a batch of unrelated sequences than one shared buffer).

Example::

    runner = LlamaRunner.load(LlamaRunnerConfig(model_path="model.gguf", n_parallel=4))
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.errors import ModelLoadFailed
from sluice.core.request import SamplerDefaults
from sluice.engine.attention import unfused
from sluice.engine.llama_sampling import TOKEN_DATA, SamplingMixin, token_data_array
from sluice.engine.llama_vocab import control_ids
from sluice.engine.llg_gate import Grammars
from sluice.engine.runner import BatchEntry, DecodeError, ModelInfo
from sluice.engine.text import literal_regex

log = logging.getLogger("sluice.llama")

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback: Any = None  # kept alive for the life of the process

_DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed per sampler
_TOKENIZE_PIECE = 8192  # characters: longer texts are tokenized in pieces (see tokenize)
_PIECE_BUF = 256  # bytes: token_bytes's buffer (a longer piece comes out empty)
# llama.cpp's CPU flash attention runs a sequence's chunk of this many tokens or more
# through its tiled kernel (GGML_FA_TILE_Q in ggml-cpu/common.h), smaller ones row by row
# at up to 2x the cost per token (measured: scheduler.PrefillPacer). The tiled kernel pads
# a last partial tile to a whole one: 140 rows cost what 192 do (measured, 2,000 tokens
# in, 1 thread: 1310 ms vs 1070 for 128), so chunks are whole tiles.
_FA_TILE_Q = 64


def _llama() -> Any:
    import llama_cpp

    return llama_cpp


# The short llama.cpp calls of the engine thread, bound a second time through
# ctypes.PyDLL so that they keep the GIL. Through llama-cpp-python's ctypes.CDLL
# every call releases the GIL, and a thread that releases it while another one runs
# Python gets it back only when that one blocks or after the 5 ms switch interval:
# measured, a 3.8 MiB llama_state_seq_get_data took 0.2 ms alone and 10.4 ms beside
# one busy Python thread (the prompt-cache save of every slot that a burst of
# requests is admitted into, while the event loop and the workers prepare the
# others). llama_decode, tokenization (worker threads) and the sampler chains keep
# releasing it: they run long enough for the others to use it.
_GIL_HELD = (
    "llama_get_logits_ith",
    "llama_memory_seq_cp",
    "llama_memory_seq_pos_max",
    "llama_memory_seq_rm",
    "llama_sampler_accept",
    "llama_state_seq_get_data",
    "llama_state_seq_get_size",
    "llama_state_seq_set_data",
    "llama_token_to_piece",
    "llama_vocab_is_eog",
)
# A state copy bigger than this releases the GIL after all: holding it through a
# copy of tens of MiB would stall the event loop for milliseconds.
_GIL_HELD_STATE_BYTES = 8 << 20


def _gil_held(L: Any) -> Any:
    """``_GIL_HELD``'s functions with llama-cpp-python's signatures, keeping the GIL."""
    lib = ctypes.PyDLL(L.llama_cpp._lib._name)  # already loaded: the same handle
    bound = types.SimpleNamespace()
    for name in _GIL_HELD:
        original = getattr(L, name)
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = original.argtypes, original.restype
        setattr(bound, name, fn)
    return bound


def _init_backend() -> None:
    """Initialise llama.cpp once per process and route its log to ``logging``."""
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        L = _llama()
        levels = {2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}

        def forward(level: int, text: bytes, _user: Any) -> None:
            py_level = levels.get(level, logging.DEBUG)
            if log.isEnabledFor(py_level):
                log.log(py_level, "%s", text.decode("utf-8", "replace").rstrip())

        _log_callback = L.llama_log_callback(forward)
        L.llama_log_set(_log_callback, ctypes.c_void_p(0))
        L.llama_backend_init()
        info = L.llama_print_system_info().decode()
        if "AMX_INT8 = 1" in info:
            log.warning(
                "this llama-cpp-python build has AMX kernels, which are known to crash on "
                "some quantizations; reinstall it with CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON' "
                "(see README) if decoding segfaults"
            )
        _backend_ready = True


def gpu_offload_supported() -> bool:
    """Whether this llama.cpp build can put layers on a GPU (CUDA, Metal, ...)."""
    return bool(_llama().llama_supports_gpu_offload())


@dataclass(frozen=True, slots=True)
class LlamaRunnerConfig:
    model_path: str
    model_id: str = ""
    n_parallel: int = 4
    n_ctx: int = 4096  # per sequence
    n_batch: int = 512
    n_threads: int = 0  # 0: all cores
    n_gpu_layers: int = 0  # layers offloaded to a GPU (needs a GPU build of llama.cpp)
    flash_attn: str = "auto"  # "on", "off", or "auto" (see engine.attention)
    chat_template: str | None = None  # overrides the GGUF's own
    mmproj_path: str | None = None  # a projector (images): llama_media.Projector


def _flash_attn_type(L: Any, choice: str) -> int:
    """llama.cpp's ``flash_attn_type`` for the ``--flash-attn`` choice (engine.attention)."""
    if unfused(choice):
        return int(L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    if choice == "on":
        return int(L.LLAMA_FLASH_ATTN_TYPE_ENABLED)
    return int(L.LLAMA_FLASH_ATTN_TYPE_AUTO)


def _c_bytes(data: bytearray) -> Any:
    """A ``uint8_t *`` view of a bytearray's own memory (no copy)."""
    return (ctypes.c_uint8 * len(data)).from_buffer(data)


class LlamaRunner(SamplingMixin):
    """A :class:`~sluice.engine.runner.ModelRunner` on llama.cpp."""

    def __init__(self, config: LlamaRunnerConfig, model: Any, ctx: Any) -> None:
        L = _llama()
        self._L = L
        self._Q = _gil_held(L)  # the engine thread's short calls (see _GIL_HELD)
        self.config = config
        self._model = model
        self._ctx = ctx
        self._vocab = L.llama_model_get_vocab(model)
        self._mem = L.llama_get_memory(ctx)
        self.n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_seq = int(L.llama_n_ctx_seq(ctx))
        self.n_seq_max = int(L.llama_n_seq_max(ctx))
        self.n_batch = int(L.llama_n_batch(ctx))
        self.dense_sequences = True  # per-sequence KV streams: see Engine._compact
        self.min_prefill_chunk = _FA_TILE_Q
        # A sequence's saved state holds, for sliding-window layers, only the cells its
        # last position still attends to: cut shorter, the window before the cut is
        # missing (measured on Gemma 3: logits off by up to 28 against a fresh prefill).
        # Recurrent states cannot be cut at all.
        recurrent = bool(L.llama_model_is_recurrent(model) or L.llama_model_is_hybrid(model))
        self.trim_after_restore = not (int(L.llama_model_n_swa(model)) > 0 or recurrent)
        # A recurrent state cannot forget its last tokens: no speculation on it.
        self.can_rewind = not recurrent
        # Sequences a move touched since the last decode. A move across KV streams
        # copies the cells' tensors only at the next decode (llama_memory_seq_cp), and
        # llama.cpp's state save/restore does not apply pending copies: a save would read
        # the stream before the copy, and a restore would be overwritten by it.
        self._unsettled: set[int] = set()
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._logits_row = ctypes.c_float * self.n_vocab
        # The candidate array of constrained sampling (engine thread).
        self._cand = np.zeros(self.n_vocab, dtype=TOKEN_DATA)
        self._cand_ids = np.arange(self.n_vocab, dtype=np.int32)
        self._cand_arr = token_data_array(L, self._cand)
        self._cand_data = self._cand_arr.data

        self.grammar_checks = 0  # tokens checked against a grammar (tests, stats)
        self.grammar_rejections = 0  # of those, rejected: a full pass was needed
        self.forced_tokens = 0  # tokens a grammar forced (jump-forward), not sampled
        self._rows: dict[int, int] | None = None  # batch row -> row of the last llama_decode
        self._piece_buf = ctypes.create_string_buffer(_PIECE_BUF)
        self._pieces: dict[int, bytes] = {}
        self._special_pieces: dict[int, bytes] = {}
        self._eog: list[int] | None = None  # every end-of-generation token, on first use
        control = control_ids(L, self._vocab, self.n_vocab)
        self.control_texts = tuple(text for t in control if (text := self._special_text(t)))
        special = {text: t for t in control if (text := self._special_text(t))}
        self._grammars = Grammars(self._vocab, self.n_vocab, self._eog_tokens, special)
        # Where tokenize may cut a long text: before a control-token text; compiled on
        # first use (only texts over _TOKENIZE_PIECE characters need it).
        self._control_pattern: tuple[re.Pattern[str] | None, int] | None = None
        self._add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self._add_eos = bool(L.llama_vocab_get_add_eos(self._vocab))
        self._bos = int(L.llama_vocab_bos(self._vocab))
        self._eos = int(L.llama_vocab_eos(self._vocab))
        self.info = self._read_info()
        self.n_embd = int(L.llama_model_n_embd(model))
        self.projector: Any = None  # llama_media.Projector: the model sees images
        self._embd_batch: Any = None  # an image's rows (made on the first image)

    # -- loading -------------------------------------------------------------

    @classmethod
    def load(
        cls, config: LlamaRunnerConfig, progress: Callable[[float], None] | None = None
    ) -> LlamaRunner:
        """Load the weights and create the context (blocking, seconds).

        ``progress(fraction)`` is called from this thread as llama.cpp reads the
        tensors (its load callback, scaled to 0..0.9), then at 1.0 once the
        context and the vocabulary tables exist (the rest of the load time).
        """
        _init_backend()
        L = _llama()
        path = Path(config.model_path)
        if not path.is_file():
            raise ModelLoadFailed(f"Model file not found: {path}")
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        callback = None
        if progress is not None:

            def on_progress(fraction: float, _user: Any) -> bool:
                try:
                    progress(0.9 * float(fraction))
                except Exception:  # never let Python errors unwind through C
                    log.exception("load progress callback failed")
                return True  # go on loading

            callback = L.llama_progress_callback(on_progress)
            mparams.progress_callback = callback
        started = time.perf_counter()
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        del callback  # llama.cpp no longer calls it
        if not model:
            raise ModelLoadFailed(f"llama.cpp could not load the model {path}")
        model_loaded = time.perf_counter()
        threads = config.n_threads or os.cpu_count() or 1
        cparams = L.llama_context_default_params()
        cparams.n_ctx = config.n_ctx * config.n_parallel
        cparams.n_seq_max = config.n_parallel
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = False
        cparams.flash_attn_type = _flash_attn_type(L, config.flash_attn)
        cparams.no_perf = True
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            L.llama_model_free(model)
            raise ModelLoadFailed("llama.cpp could not create a context (out of memory?)")
        context_made = time.perf_counter()
        runner = cls(config, model, ctx)
        if config.mmproj_path:
            from sluice.engine.llama_media import Projector

            try:
                runner.projector = Projector.load(
                    config.mmproj_path,
                    model,
                    n_threads=threads,
                    use_gpu=config.n_gpu_layers != 0,
                )
            except BaseException:
                runner.close()
                raise
        log.info(
            "loaded %s: model %.3f s, context %.3f s, vocabulary tables %.3f s; flash attention %s",
            config.model_id or path.stem,
            model_loaded - started,
            context_made - model_loaded,
            time.perf_counter() - context_made,
            config.flash_attn,
        )
        if progress is not None:
            progress(1.0)
        return runner

    def _read_info(self) -> ModelInfo:
        L = self._L
        buf = ctypes.create_string_buffer(512)
        n = L.llama_model_desc(self._model, buf, len(buf))
        template = self.config.chat_template
        if template is None:
            raw = L.llama_model_chat_template(self._model, None)
            template = raw.decode("utf-8", "replace") if raw else None
        path = Path(self.config.model_path)
        return ModelInfo(
            id=self.config.model_id or path.stem,
            path=str(path),
            n_ctx_train=int(L.llama_model_n_ctx_train(self._model)),
            n_params=int(L.llama_model_n_params(self._model)),
            size_bytes=int(L.llama_model_size(self._model)),
            description=buf.raw[: max(n, 0)].decode("utf-8", "replace"),
            chat_template=template,
            bos_token=self._special_text(L.llama_vocab_bos(self._vocab)),
            eos_token=self._special_text(L.llama_vocab_eos(self._vocab)),
            add_bos=bool(L.llama_vocab_get_add_bos(self._vocab)),
            sampling=SamplerDefaults.from_gguf(self.meta),
        )

    @property
    def model(self) -> Any:
        """llama.cpp's model handle (for a second context on the same weights)."""
        return self._model

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or ""

    def new_embedder(self, n_ctx: int) -> Any:
        from sluice.engine.llama_embed import LlamaEmbedder

        threads = self.config.n_threads or os.cpu_count() or 1
        return LlamaEmbedder.create(self, n_ctx, threads)

    def embedder_bytes(self, n_ctx: int) -> int:
        from sluice.engine.llama_embed import embedder_bytes

        return embedder_bytes(self, n_ctx)

    def grammar_bytes(self) -> tuple[int, bool]:
        return self._grammars.tokenizer_bytes, self._grammars.made

    def meta(self, key: str) -> str | None:
        """The GGUF metadata value of ``key`` as text, or None."""
        buf = ctypes.create_string_buffer(128)
        n = self._L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        n = self._L.llama_token_to_piece(self._vocab, token, self._piece_buf, _PIECE_BUF, 0, True)
        return self._piece_buf.raw[: max(n, 0)].decode("utf-8", "replace")

    # -- any thread (read-only model data) -----------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """llama.cpp's tokenization, in pieces for long texts.

        With ``parse_special``, llama.cpp splits a text at control-token texts
        before BPE, and that split is quadratic in their number (measured:
        100,000 ``<|im_end|>`` took 45 s, 20,000 took 1.2 s). Control tokens are
        hard boundaries for BPE, so a long text cut right before a control-token
        text tokenizes to the same tokens piece by piece, with BOS/EOS added once
        around the whole (tests/engine/test_tokenize.py compares the two).
        """
        if len(text) <= _TOKENIZE_PIECE:
            return self._tokenize(text, add_special, parse_special)
        cuts = self._control_cuts(text) if parse_special else []
        if not cuts:
            return self._tokenize(text, add_special, parse_special)
        tokens: list[int] = []
        if add_special and self._add_bos:
            tokens.append(self._bos)
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            tokens += self._tokenize(text[start:end], False, parse_special)
        if add_special and self._add_eos:
            tokens.append(self._eos)
        return tokens

    def _control_cuts(self, text: str) -> list[int]:
        """Offsets, about every ``_TOKENIZE_PIECE`` characters, where a control-token text starts."""
        pattern, max_len = self._control_cut_pattern()
        if pattern is None:
            return []
        cuts: list[int] = []
        target = _TOKENIZE_PIECE
        while target < len(text):
            # Start a little early, so as not to land inside a special text.
            m = pattern.search(text, max(target - max_len, cuts[-1] + 1 if cuts else 1))
            if m is None:
                break
            if m.start() > 0:
                cuts.append(m.start())
            target = max(target, m.start()) + _TOKENIZE_PIECE
        return cuts

    def _control_cut_pattern(self) -> tuple[re.Pattern[str] | None, int]:
        # (Cutting at user-defined tokens, which llama.cpp also splits at, is not safe:
        # Gemma's include runs of newlines, and a cut inside a run changes the split.)
        found = self._control_pattern
        if found is None:  # two threads may both build it: the same value either way
            found = (
                literal_regex(self.control_texts),
                max(map(len, self.control_texts), default=1),
            )
            self._control_pattern = found
        return found

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        arr = (self._L.llama_token * cap)()
        n = self._L.llama_tokenize(
            self._vocab, data, len(data), arr, cap, add_special, parse_special
        )
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            arr = (self._L.llama_token * cap)()
            n = self._L.llama_tokenize(
                self._vocab, data, len(data), arr, cap, add_special, parse_special
            )
        return list(arr[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        cache = self._special_pieces if special else self._pieces
        piece = cache.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(_PIECE_BUF)
            n = self._Q.llama_token_to_piece(self._vocab, token, buf, _PIECE_BUF, 0, special)
            piece = buf.raw[: max(n, 0)]
            cache[token] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        return bool(self._Q.llama_vocab_is_eog(self._vocab, token))

    def _eog_tokens(self) -> list[int]:
        eog = self._eog
        if eog is None:  # two threads may both scan: the same list either way
            is_eog = self._Q.llama_vocab_is_eog  # (a GIL hand-off per call could wait 5 ms)
            eog = [t for t in range(self.n_vocab) if is_eog(self._vocab, t)]
            self._eog = eog
        return eog

    def valid_token(self, token: int) -> bool:
        return 0 <= token < self.n_vocab

    # -- engine thread only --------------------------------------------------

    def keep_prefix(self, seq: int, n_keep: int) -> int:
        L = self._Q
        if n_keep > 0 and L.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            return n_keep
        # Partial removal is not possible on every cache (SWA, recurrent): start over.
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
        return 0

    def move_sequence(self, src: int, dst: int) -> None:
        L = self._Q
        L.llama_memory_seq_rm(self._mem, dst, -1, -1)
        L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # across streams: copied at next decode
        L.llama_memory_seq_rm(self._mem, src, -1, -1)
        self._unsettled.update((src, dst))

    def save_seq(self, seq: int) -> bytearray:
        """llama.cpp's per-sequence state (flags 0: the whole KV of the sequence).

        With per-sequence KV streams (``kv_unified=False``) the state holds the
        cells of that sequence's stream only (positions, then each layer's K and
        V rows), and :meth:`load_seq` can put it into any other sequence's stream.
        llama.cpp writes straight into the returned buffer: a second copy of tens
        of MiB would double the cost of a save.
        """
        if seq in self._unsettled:
            return bytearray()
        size = int(self._Q.llama_state_seq_get_size(self._ctx, seq))
        if size == 0:
            return bytearray()
        data = bytearray(size)
        L = self._Q if size <= _GIL_HELD_STATE_BYTES else self._L
        n = int(L.llama_state_seq_get_data(self._ctx, _c_bytes(data), size, seq))
        if n != size:
            return bytearray()
        return data

    def load_seq(self, seq: int, data: bytearray) -> int:
        L = self._Q
        if seq in self._unsettled or not data:
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            return 0
        copy = L if len(data) <= _GIL_HELD_STATE_BYTES else self._L
        if not copy.llama_state_seq_set_data(self._ctx, _c_bytes(data), len(data), seq):
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            return 0
        return int(L.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def decode(self, entries: list[BatchEntry]) -> None:
        """One step's batch. A prompt chunk that wants no logits (a paced chunk of a long
        prompt) beside other entries goes in a llama_decode of its own, first; an image
        (``entry.media``) goes in one of its own too, after those: its rows are
        embeddings, which llama.cpp takes only in a batch of embeddings.

        Why: with a KV stream per sequence, llama.cpp splits a batch into ubatches that
        take the same number of tokens from each of a run of consecutive sequence ids.
        A 64-token chunk on seq 0 beside generating seqs 1-3 became one ubatch of 1 token
        each, then one of 63 rows: under the 64-row tile of the CPU flash attention, so
        row by row at ~2x the cost (measured under load, 1 thread, 2,400 tokens in: 64
        tokens 1.1 s instead of 0.55). Alone, the chunk is one ubatch of whole tiles.
        The rows of the rest are then counted from 0 again: ``_rows`` maps them.
        """
        images = [e for e in entries if e.media is not None]
        tokens = [e for e in entries if e.media is None] if images else entries
        quiet = [e for e in tokens if not e.logits_last and not e.logits_all]
        split = bool(quiet) and len(quiet) < len(tokens)
        if not images and not split:
            self._rows = None
            self._decode(entries)
            return
        # The entries decoded last (their logits are read): their rows, renumbered.
        rest = [e for e in tokens if e.logits_last or e.logits_all] if split else tokens
        last = {id(e) for e in rest}
        rows: dict[int, int] = {}
        old = new = 0
        for e in entries:
            n = len(e.tokens)
            if id(e) in last:
                if e.logits_last or e.logits_all:
                    for k in range(n) if e.logits_all else range(n - e.n_logits, n):
                        rows[old + k] = new + k
                new += n
            old += n
        self._rows = None
        if split:
            self._decode(quiet)
        for e in images:
            self._decode_image(e)
        if rest:
            self._decode(rest)
        self._rows = rows

    def _decode_image(self, entry: BatchEntry) -> None:
        """An image's rows: its embeddings (the projector encodes it now), decoded with
        causal attention off where the projector says so (Gemma 3)."""
        span = entry.media
        assert span is not None and self.projector is not None
        L = self._L
        rows = span.chunk  # encoded when the request was prepared
        if not isinstance(rows, np.ndarray):
            try:
                rows = self.projector.encode(span.chunk)
            except RuntimeError as exc:
                raise DecodeError(f"the projector could not encode an image: {exc}") from exc
        n = rows.shape[0]
        if n > self.n_batch:
            raise DecodeError(f"an image of {n} rows is over the batch ({self.n_batch})")
        batch = self._embd_batch
        if batch is None:
            batch = self._embd_batch = L.llama_batch_init(self.n_batch, self.n_embd, 1)
        flat = np.ctypeslib.as_array(batch.embd, shape=(self.n_batch * self.n_embd,))
        flat[: rows.size] = rows.reshape(-1)
        pos, n_seq_id, seq_id, logits = batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        for j in range(n):
            pos[j] = entry.pos0 + j
            n_seq_id[j] = 1
            seq_id[j][0] = entry.seq
            logits[j] = False
        batch.n_tokens = n
        if span.non_causal:
            L.llama_set_causal_attn(self._ctx, False)
        try:
            rc = L.llama_decode(self._ctx, batch)
        finally:
            if span.non_causal:
                L.llama_set_causal_attn(self._ctx, True)
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc} for an image")
        self._unsettled.clear()

    def _decode(self, entries: list[BatchEntry]) -> None:
        batch = self._batch
        token, pos, n_seq_id, seq_id, logits = (
            batch.token,
            batch.pos,
            batch.n_seq_id,
            batch.seq_id,
            batch.logits,
        )
        i = 0
        for entry in entries:
            seq = entry.seq
            p = entry.pos0
            # Rows from ``first`` on have logits (the last, or a draft's).
            first = len(entry.tokens) - entry.n_logits if entry.logits_last else len(entry.tokens)
            if entry.logits_all:
                first = 0
            for j, t in enumerate(entry.tokens):
                token[i] = t
                pos[i] = p + j
                n_seq_id[i] = 1
                seq_id[i][0] = seq
                logits[i] = j >= first
                i += 1
        batch.n_tokens = i
        rc = self._L.llama_decode(self._ctx, batch)
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc}")
        self._unsettled.clear()  # the decode applied the pending stream copies

    def close(self) -> None:
        L = self._L
        if self.projector is not None:
            self.projector.close()
            self.projector = None
        if self._ctx:
            if self._embd_batch is not None:
                L.llama_batch_free(self._embd_batch)
                self._embd_batch = None
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)
            self._ctx = None
            self._model = None
