"""What every backend implements: ``open(request) -> ResponseStream``.

Routes, wrappers and formatters see only this protocol, so they cannot tell
a local llama.cpp model from an upstream server.

Example::

    stream = await backend.open(request)   # raises a SluiceError before any byte
    try:
        async for event in stream:
            ...
    finally:
        await stream.aclose()              # aborts the work if it is still running
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from sluice.core.events import Event
from sluice.core.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """Dialect-neutral facts about a response, known when it opens."""

    model: str  # the name of the model that answers
    choices: int
    # The choices whose prompt counts in usage: with n > 1, choices share a prompt.
    prompt_owners: frozenset[int]
    logprobs: bool = False
    # Who answers: the slot (a local model's name, an upstream's name) and, for an
    # upstream, the replica's base URL. Every dialect names them in a response header.
    slot: str = ""
    replica: str | None = None


class ResponseStream(Protocol):
    meta: StreamMeta

    def __aiter__(self) -> AsyncIterator[Event]:
        """The events: ``Start`` per choice, deltas, ``Finish`` per choice (or an
        ``ErrorEvent``, which ends the stream)."""
        ...

    async def aclose(self) -> None:
        """Abort whatever still runs (idempotent)."""
        ...


class Backend(Protocol):
    async def open(self, request: GenerationRequest) -> ResponseStream:
        """Validate and start ``request``; every error knowable before the first
        byte is raised here as a :class:`~sluice.core.errors.SluiceError`."""
        ...

    async def embed(
        self, inputs: list[str] | list[list[int]], *, truncate: bool, dimensions: int | None
    ) -> Embeddings:
        """Embed texts (or token ids): :class:`Embeddings`, in order. An input over the
        model's window is cut to it with ``truncate``, else a 400; ``dimensions``
        keeps the first that many and normalizes again (Matryoshka-style)."""
        ...

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The tokens ``request``'s prompt takes on this model (chat template and
        tools included), without generating: Anthropic's ``count_tokens``."""
        ...


Vector = npt.NDArray[np.float32]  # one embedding


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input (L2-normalized), and the tokens they took."""

    # A row per input, float32 (what the models compute): JSON writes each value in
    # the shortest form that reads back as the same float32, base64 its bytes.
    vectors: npt.NDArray[np.float32]
    prompt_tokens: int


Progress = Callable[[float], None]  # a load's progress, 0.0 to 1.0


class MemoryRoom(Protocol):
    """A loaded model's view of the memory budget it shares with the other models
    (``--memory-budget-mb``): what it takes after its load (the RAM prompt cache's
    states, an embedding context) must fit in it too. Safe from any thread."""

    def free(self) -> int:
        """Bytes of the budget no model holds now (may be negative when over)."""
        ...

    def reclaim(self, nbytes: int) -> int:
        """Drop up to ``nbytes`` of saved prompt states, least recently used model
        first; the bytes freed."""
        ...

    def reserve(self, nbytes: int, hold: Callable[[int], None]) -> int:
        """Take ``nbytes`` more, atomically among the models: if they fit what is free
        plus the saved prompt states, drop as many states as needed and call
        ``hold(nbytes)`` (its owner then counts them as held) before another
        reservation may look. Returns the bytes that could be made free: at least
        ``nbytes`` when reserved; when less, nothing was dropped or held."""
        ...


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """Per-load overrides on top of the spec (LM Studio's ``context_length``, ``parallel``)."""

    ctx: int | None = None
    parallel: int | None = None
