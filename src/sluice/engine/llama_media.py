"""A model's projector (mmproj) through llama.cpp's multimodal library, ``mtmd``.

A vision model in llama.cpp is the text model plus a projector GGUF: an image encoder
and a map from its patches into the text model's embedding space. Here:

* :meth:`Projector.pieces` (worker threads, while a request is prepared) turns one
  decoded image into what its prompt holds: text tokens the projector wraps it in
  (Gemma 3's ``<start_of_image>``) and the image's own rows, as an :class:`ImageChunk`
  (``mtmd_tokenize_from_parts``: no marker is parsed out of any text);
* a clip (:class:`~sluice.core.media.Sound`, for a projector with an audio encoder:
  ``Projector.audio``) is resampled to the encoder's rate and tokenized the same way,
  into one chunk per encoder window (30 s for Whisper-style encoders), each decoded
  like an image's rows;
* :meth:`Projector.encode` runs the encoder over one chunk: its ``n x n_embd``
  embeddings, which the runner decodes as an embedding batch on the request's own
  sequence, within the continuous batch. It runs on the worker thread that prepares
  the request (``CompletionService.prepare_chat``), not on the engine thread: a real
  vision encoder takes from a tenth of a second to seconds on a CPU, and the other
  streams keep decoding meanwhile. The last images' embeddings are kept (by the
  image's digest, :data:`KEEP_BYTES` in all): the same image again is not encoded
  again.

Example::

    projector = Projector.load("mmproj.gguf", runner.model, n_threads=2)
    pieces = projector.pieces(picture)     # [[...tokens], ImageChunk(n=16), [...]]
    rows = projector.encode(pieces[1])     # float32 (16, 576)
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.errors import InvalidRequest, ModelLoadFailed
from sluice.core.media import Picture, Sound, resample

log = logging.getLogger("sluice.llama")

_TEXT, _IMAGE, _AUDIO = 0, 1, 2  # mtmd_input_chunk_type
KEEP_BYTES = 64 * 2**20  # encoded images kept for a repeat


def _mtmd() -> Any:
    from llama_cpp import mtmd_cpp

    return mtmd_cpp


class _Chunks:
    """An ``mtmd_input_chunks`` list, freed when the last chunk of it is dropped."""

    def __init__(self, M: Any, ptr: Any) -> None:
        self.ptr = ptr
        weakref.finalize(self, M.mtmd_input_chunks_free, ptr)


@dataclass(frozen=True, slots=True, eq=False)
class ImageChunk:
    """One image's rows (or one piece of a clip's: an audio encoder takes 30 s at a
    time), as the projector tokenized it (kept alive by ``owner``)."""

    n: int  # rows (tokens) it takes in the prompt
    non_causal: bool  # decoded with attention both ways among its rows
    ptr: Any  # the mtmd_input_chunk
    owner: _Chunks
    digest: bytes = b""  # the image's (and its place among the pieces)


class Projector:
    """A loaded projector, tied to one text model."""

    def __init__(self, M: Any, ctx: Any, path: str, size_bytes: int, n_embd: int) -> None:
        self._M = M
        self._ctx = ctx
        self.path = path
        self.size_bytes = size_bytes
        self.n_embd = n_embd  # the text model's embedding width: an image row's
        self.vision = bool(M.mtmd_support_vision(ctx))
        self.audio = bool(M.mtmd_support_audio(ctx))
        self.sample_rate = int(M.mtmd_get_audio_sample_rate(ctx)) if self.audio else 0
        self._lock = threading.Lock()  # the encoder's output buffer is the context's own
        self._kept: OrderedDict[bytes, np.ndarray] = OrderedDict()  # digest -> rows
        self._kept_bytes = 0

    @classmethod
    def load(cls, path: str, model: Any, *, n_threads: int, use_gpu: bool = False) -> Projector:
        """Load ``path`` for ``model`` (llama.cpp's model handle). Raises ModelLoadFailed
        (a projector made for another model: its width is not the model's)."""
        M = _mtmd()
        file = Path(path)
        if not file.is_file():
            raise ModelLoadFailed(f"Projector file not found: {file}")
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = max(1, n_threads)
        params.print_timings = False
        params.warmup = True
        ctx = M.mtmd_init_from_file(str(file).encode(), model, params)
        if not ctx:
            raise ModelLoadFailed(
                f"llama.cpp could not load the projector {file} for this model (one made "
                "for another model? its width must be the model's; see the log)"
            )
        if M.mtmd_decode_use_mrope(ctx):
            M.mtmd_free(ctx)
            raise ModelLoadFailed(
                f"The projector {file} places images with M-RoPE (Qwen2-VL and later), "
                "which sluice does not decode yet"
            )
        import llama_cpp

        n_embd = int(llama_cpp.llama_model_n_embd(model))
        return cls(M, ctx, str(file), file.stat().st_size, n_embd)

    def pieces(self, picture: Picture | Sound, where: str) -> list[list[int] | ImageChunk]:
        """The prompt's pieces for one image or clip: text tokens and its chunks."""
        M = self._M
        if isinstance(picture, Sound):
            if not self.audio:
                raise InvalidRequest(f"{where}: this model's projector takes no audio", param=where)
            samples = resample(picture, self.sample_rate)  # the encoder's rate (16 kHz)
            pcm = samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            bitmap = M.mtmd_bitmap_init_from_audio(len(samples), pcm)
        else:
            if not self.vision:
                raise InvalidRequest(
                    f"{where}: this model's projector takes no images", param=where
                )
            data = (ctypes.c_uint8 * len(picture.rgb)).from_buffer_copy(picture.rgb)
            bitmap = M.mtmd_bitmap_init(picture.width, picture.height, data)
        if not bitmap:
            raise InvalidRequest(f"{where}: the projector could not take this input", param=where)
        chunks = M.mtmd_input_chunks_init()
        try:
            M.mtmd_bitmap_set_id(bitmap, picture.digest.hex().encode())
            part = M.mtmd_input_part()
            part.text = None
            part.bitmap = bitmap
            parts = (ctypes.POINTER(M.mtmd_input_part) * 1)(ctypes.pointer(part))
            rc = int(M.mtmd_tokenize_from_parts(self._ctx, chunks, parts, 1, False))
        finally:
            M.mtmd_bitmap_free(bitmap)
        owner = _Chunks(M, chunks)
        if rc != 0:
            raise InvalidRequest(
                f"{where}: the projector could not read this input (mtmd_tokenize: {rc})",
                param=where,
            )
        out: list[list[int] | ImageChunk] = []
        for i in range(int(M.mtmd_input_chunks_size(chunks))):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            kind = int(M.mtmd_input_chunk_get_type(chunk))
            if kind == _TEXT:
                n = ctypes.c_size_t(0)
                tokens = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                out.append([int(tokens[j]) for j in range(n.value)])
            elif kind in (_IMAGE, _AUDIO):
                n_tokens = int(M.mtmd_input_chunk_get_n_tokens(chunk))
                non_causal = bool(M.mtmd_decode_use_non_causal(self._ctx, chunk))
                digest = picture.digest + i.to_bytes(2, "big")
                out.append(ImageChunk(n_tokens, non_causal, chunk, owner, digest))
            else:
                raise InvalidRequest(f"{where}: not an input this projector takes", param=where)
        return out

    def encode(self, chunk: ImageChunk) -> np.ndarray:
        """The chunk's embeddings, ``(n, n_embd)`` float32 (a worker thread; the encoder
        releases the GIL). Raises RuntimeError if mtmd fails."""
        M = self._M
        with self._lock:
            kept = self._kept.get(chunk.digest) if chunk.digest else None
            if kept is not None:
                self._kept.move_to_end(chunk.digest)
                return kept
            rc = int(M.mtmd_encode_chunk(self._ctx, chunk.ptr))
            if rc != 0:
                raise RuntimeError(f"mtmd_encode_chunk returned {rc}")
            out = M.mtmd_get_output_embd(self._ctx)
            n_embd = self.n_embd
            flat = np.ctypeslib.as_array(out, shape=(chunk.n * n_embd,))
            rows = np.array(flat, dtype=np.float32).reshape(chunk.n, n_embd)
            rows.setflags(write=False)
            if chunk.digest and rows.nbytes <= KEEP_BYTES:
                self._kept[chunk.digest] = rows
                self._kept_bytes += rows.nbytes
                while self._kept_bytes > KEEP_BYTES:
                    _, old = self._kept.popitem(last=False)
                    self._kept_bytes -= old.nbytes
            return rows

    def close(self) -> None:
        if self._ctx:
            self._M.mtmd_free(self._ctx)
            self._ctx = None
