"""The seam between the engine loop and a model: :class:`ModelRunner`.

The engine loop (scheduling, slots, text, stop strings, cancellation) is the
same for the real llama.cpp runner and for the scripted runner the tests use,
so every boundary case the tests script runs through the real loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sluice.core.backend import Vector
from sluice.core.events import TokenLogprob
from sluice.core.request import SamplingParams
from sluice.engine.types import MediaSpan


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """A run of tokens of one sequence in one decode, at positions pos0.."""

    seq: int
    tokens: list[int]
    pos0: int
    logits_last: bool = True  # compute logits for the last token
    logits_all: bool = False  # compute logits for every token (echo + logprobs)
    n_logits: int = 1  # with logits_last: logits for this many tokens at the end (a draft)
    # An image's rows (``tokens`` are its placeholders): decoded from its embeddings.
    media: MediaSpan | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    path: str
    n_ctx_train: int
    n_params: int
    size_bytes: int
    description: str
    chat_template: str | None
    bos_token: str
    eos_token: str
    add_bos: bool
    # the GGUF's recommended sampling (SamplerDefaults.from_gguf): field -> value
    sampling: dict[str, float] = field(default_factory=dict)


class DecodeError(Exception):
    """``llama_decode`` failed for a whole batch."""


class Sampler(Protocol):
    """An opaque, per-request sampler chain."""


class Embedder(Protocol):
    """A model's pooled embedding context (worker threads; one batch at a time)."""

    n_ctx: int  # tokens one input may have
    n_embd: int  # the vectors' dimension
    pooling: str  # mean | cls | last | ...
    bytes: int  # the memory it holds (its KV cells and its batch's buffers), estimated

    def embed(self, inputs: Sequence[list[int]]) -> Sequence[Vector | Sequence[float]]:
        """One L2-normalized vector per input (token ids)."""
        ...

    def close(self) -> None: ...


class ModelRunner(Protocol):
    """Everything the engine loop needs from a model.

    Only the engine thread calls :meth:`decode`, :meth:`sample`,
    :meth:`logprobs`, :meth:`keep_prefix`, :meth:`move_sequence`,
    :meth:`save_seq` and :meth:`load_seq`; ``tokenize``, ``token_bytes``
    and ``new_sampler`` read immutable model data and are safe from any thread.
    """

    info: ModelInfo
    n_ctx_seq: int  # context per sequence
    n_seq_max: int  # number of sequences (slots) the context holds
    n_batch: int  # max tokens per decode
    n_vocab: int
    dense_sequences: bool  # decoding is fastest when active sequence ids are consecutive
    # A state load_seq restored can be cut to any shorter prefix with keep_prefix. Not with
    # sliding-window attention: llama.cpp saves only the window's cells of those layers.
    trim_after_restore: bool
    control_texts: tuple[str, ...]  # texts of the control tokens (<|im_end|>, ...)
    # keep_prefix can drop any suffix of a sequence's cache (not a recurrent model's):
    # speculation drops the rows of a rejected draft.
    can_rewind: bool
    # The smallest prompt chunk worth prefilling beside generating sequences: below
    # it the cost per token rises steeply (see scheduler.PrefillPacer). A chunk that
    # does not end its prompt is a multiple of it (a partial tile costs a whole one).
    min_prefill_chunk: int

    def tokenize(
        self, text: str, *, add_special: bool, parse_special: bool = True
    ) -> list[int]: ...

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """A token's bytes; control tokens are empty unless ``special``."""
        ...

    def is_eog(self, token: int) -> bool: ...

    def new_sampler(self, params: SamplingParams, prompt: list[int]) -> Sampler: ...

    def free_sampler(self, sampler: Sampler) -> None: ...

    def keep_prefix(self, seq: int, n_keep: int) -> int:
        """Drop a sequence's cached positions from ``n_keep`` on; returns how many remain."""
        ...

    def move_sequence(self, src: int, dst: int) -> None:
        """Move a sequence's whole KV cache to another (empty) sequence id."""
        ...

    def save_seq(self, seq: int) -> bytearray:
        """A sequence's KV cache as bytes, for :meth:`load_seq` into any sequence id later.

        Empty when it cannot be saved right now (a move onto or off it is still
        pending): the caller then keeps nothing.
        """
        ...

    def load_seq(self, seq: int, data: bytearray) -> int:
        """Replace a sequence's KV cache with one :meth:`save_seq` returned.

        Returns how many positions the sequence now holds; 0 when the state
        could not be restored (the sequence is then empty).
        """
        ...

    def decode(self, entries: list[BatchEntry]) -> None:
        """One forward pass over all entries; raises :class:`DecodeError`."""
        ...

    def sample(self, sampler: Sampler, row: int) -> int:
        """Sample from the logits of batch row ``row`` of the last decode."""
        ...

    def force(self, sampler: Sampler, limit: int) -> list[int]:
        """The tokens ``sampler``'s grammar allows as the only continuation (at most
        ``limit``), taken by the grammar and the chain as if sampled; [] without one."""
        ...

    def force_tokens(self, sampler: Sampler, tokens: list[int]) -> bool:
        """Take ``tokens`` as the next output without sampling them (a reasoning
        budget's closer): the grammar, the chain and a lazy grammar's trigger see them
        as if sampled. False, with nothing taken, if the grammar refuses them."""
        ...

    def logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob: ...

    def new_embedder(self, n_ctx: int) -> Embedder:
        """An embedding context on this model (blocking; any thread but the engine's)."""
        ...

    def embedder_bytes(self, n_ctx: int) -> int:
        """The memory :meth:`new_embedder` would take (its ``bytes``), before making it."""
        ...

    def grammar_bytes(self) -> tuple[int, bool]:
        """The memory of the grammar tokenizer :meth:`new_sampler` makes on the first
        request with a grammar, and whether it is made yet."""
        ...

    def close(self) -> None: ...
