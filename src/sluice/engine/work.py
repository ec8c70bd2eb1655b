"""The engine's state: its configuration and statistics, one sequence's work, a slot,
and the commands other threads put on its queue (see ``engine.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.engine.prompt_cache import MIN_TOKENS
from sluice.engine.reasoning import ReasoningTrack
from sluice.engine.runner import Sampler
from sluice.engine.speculate import Acceptance, PromptLookup
from sluice.engine.text import SequenceText, Utf8Assembler
from sluice.engine.types import EngineRequest, EventSink, SlotState


@dataclass(frozen=True, slots=True)
class EngineConfig:
    n_parallel: int = 4
    max_queue: int = 16
    # While other sequences are generating, a long prompt's prefill gets this many
    # times the time they use (measured: see PrefillPacer), in chunks of about
    # prefill_chunk_seconds, so they run at about 1 / (1 + prefill_budget) of
    # their speed while it lasts. Prompts that fit in one batch are prefilled
    # whole, at once, ahead of it.
    prefill_budget: float = 0.5
    prefill_chunk_seconds: float = 0.5
    # Engine steps of output a response may have delivered but not yet consumed
    # (a client that is not reading); past it, its sequences are not decoded
    # until the consumer has taken half of it.
    stream_buffer: int = 256
    # RAM for the KV states of prompts whose slot was taken (see prompt_cache);
    # 0 turns the prompt cache off.
    cache_ram_bytes: int = 0
    cache_min_tokens: int = MIN_TOKENS  # shorter sequences are not saved
    # Fewer decode steps (see speculate.py): the longest prompt-lookup draft (0: off),
    # and tokens a grammar forces decoded without sampling. A request may lower or
    # turn off either (SamplingParams.max_draft, .jump_forward).
    max_draft: int = 16
    jump_forward: bool = True


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot published by the engine thread after every step."""

    slots: int
    active: int
    idle: int
    queued: int
    prefilling: int
    generating: int
    steps: int
    tokens_generated: int
    prompt_tokens_processed: int
    cached_tokens: int
    paused: int = 0  # sequences in slots waiting for their client to read (backpressure)
    prompt_cache_entries: int = 0  # saved prompt states in RAM
    prompt_cache_bytes: int = 0
    prompt_cache_hits: int = 0  # entries restored into a slot
    drafted_tokens: int = 0  # prompt-lookup draft tokens decoded for verification
    accepted_tokens: int = 0  # of those, kept (the sampler chose them)
    forced_tokens: int = 0  # tokens a grammar forced, decoded without sampling
    reasoning_closed: int = 0  # reasoning blocks closed by force when their budget ran out


@dataclass(slots=True)
class Work:
    """One sequence's lifetime in the engine, queued or in a slot."""

    req: EngineRequest
    sink: EventSink
    sampler: Sampler
    key: int
    text: SequenceText
    submitted: float
    admitted_order: int = 0
    prompt_done: int = 0  # prompt tokens already in the KV cache
    cached: int = 0  # of those, reused from an earlier request
    generated: int = 0
    next_token: int | None = None  # sampled, still to be decoded
    t_admit: float = 0.0
    t_first: float = 0.0
    echo_utf8: Utf8Assembler = field(default_factory=Utf8Assembler)
    paused: bool = False  # its sink's backlog went over the bound; left out of batches
    # Fewer steps: tokens a grammar forced after next_token (already in the output,
    # decoded with it), this step's draft, the draft source and its record.
    forced: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    lookup: PromptLookup | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    shadow: int | None = None  # the token a draft would have started with, not drafted
    max_draft: int = 0
    jump: bool = False
    reasoning: ReasoningTrack | None = None  # the request's reasoning block, if it may have one


@dataclass(slots=True)
class Slot:
    seq: int
    state: SlotState = SlotState.IDLE
    cache: list[int] = field(default_factory=list)  # tokens whose KV is cached
    work: Work | None = None
    unsaved: bool = False  # idle, holding what a request left: see Engine._save_idle


@dataclass(frozen=True, slots=True)
class Add:
    works: list[Work]


@dataclass(frozen=True, slots=True)
class Abort:
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Wake:
    """A paused request's consumer caught up: only ends a wait for commands."""


WAKE = Wake()
