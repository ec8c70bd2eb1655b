"""Which tokens of a llama.cpp vocabulary are control tokens, read in bulk at load.

The runner needs one fact about the whole vocabulary at load: which tokens are
control (or unknown) tokens. Asked token by token through the C API that is a
ctypes call per token, for Gemma's 262,144 tokens a good part of what llama.cpp
itself takes to load the model. llama.cpp already holds every token's attributes
in the token table it fills when it loads a vocabulary, which an exported,
non-public accessor of ``llama_vocab`` points into. It is read in bulk, once the
layout checks out against the C API (element addresses, and the attributes,
scores and text lengths of tokens spread over the vocabulary); a build without
that symbol (another C++ ABI or platform) or with another layout gets the
token-by-token scan, whose results are the same.
"""

from __future__ import annotations

import ctypes
import logging
import math
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger("sluice.llama")

_TOKEN_DATA_SYMBOL = "_ZNK11llama_vocab14get_token_dataEi"  # const token_data & (id) const
_TOKEN_DATA_SIZE = 40  # struct token_data { std::string text; float score; int32 attr; }
_CHECK_TOKENS = 64  # tokens spread over the vocabulary whose bulk values are checked


def _check_tokens(n_vocab: int) -> list[int]:
    step = max(1, n_vocab // _CHECK_TOKENS)
    return sorted({0, 1, n_vocab - 1, *range(0, n_vocab, step)} - {n_vocab})


def _accessor(L: Any, symbol: str) -> Any:
    lib = getattr(getattr(L, "llama_cpp", None), "_lib", None)
    if lib is None:
        return None
    try:
        fn = lib[symbol]  # a new function object: the bindings' own stay untouched
    except (AttributeError, KeyError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    fn.restype = ctypes.c_void_p
    return fn


def _array_base(L: Any, symbol: str, vocab: Any, checks: list[int], stride: int) -> int | None:
    """Where the accessor's per-token elements start, if they are one array of
    ``stride``-byte rows (checked on ``checks``); None otherwise."""
    get = _accessor(L, symbol)
    if get is None:
        return None
    base = get(vocab, 0)
    if not base or any(get(vocab, t) != base + t * stride for t in checks):
        return None
    return int(base)


def _table(base: int, n: int, stride: int) -> npt.NDArray[np.int32]:
    """``n`` rows of ``stride`` bytes at ``base`` as int32 words: a view of llama.cpp's
    memory (copy what you keep)."""
    raw = (ctypes.c_char * (n * stride)).from_address(base)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=np.int32).reshape(n, stride // 4)


def _int64_column(table: npt.NDArray[np.int32], word: int) -> npt.NDArray[np.int64]:
    return table[:, word : word + 2].copy().view(np.int64)[:, 0]


def _bulk_attrs(L: Any, vocab: Any, n_vocab: int) -> npt.NDArray[np.int32] | None:
    """Every token's attributes from llama.cpp's token table; None if unverified."""
    checks = _check_tokens(n_vocab)
    base = _array_base(L, _TOKEN_DATA_SYMBOL, vocab, checks, _TOKEN_DATA_SIZE)
    if base is None:
        return None
    table = _table(base, n_vocab, _TOKEN_DATA_SIZE)
    attrs = table[:, 9].copy()  # int32 after the 32-byte string and the float score
    sample = table[checks]
    scores = sample[:, 8].view(np.float32)
    text_len = _int64_column(sample, 2)  # the string's size, after its data pointer
    for i, t in enumerate(checks):
        score = float(L.llama_vocab_get_score(vocab, t))
        if int(attrs[t]) != int(L.llama_vocab_get_attr(vocab, t)):
            return None
        if not (float(scores[i]) == score or (math.isnan(score) and math.isnan(scores[i]))):
            return None
        if int(text_len[i]) != len(L.llama_vocab_get_text(vocab, t) or b""):
            return None
    return attrs


def control_ids(L: Any, vocab: Any, n_vocab: int) -> list[int]:
    """The ids of control and unknown tokens."""
    control = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN
    attrs = _bulk_attrs(L, vocab, n_vocab) if n_vocab else None
    if attrs is not None:
        ids: list[int] = np.flatnonzero(attrs & control).tolist()
        return ids
    if n_vocab:
        log.debug("vocabulary tables: bulk read unavailable, scanning token by token")
    get_attr = L.llama_vocab_get_attr
    return [t for t in range(n_vocab) if get_attr(vocab, t) & control]
