"""What the model registry keeps per model name: the loaded instance, a load in flight,
the entry that holds both, and the lease a request takes (see ``registry.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sluice.core.backend import Backend, LoadOptions, MemoryRoom, Progress
from sluice.core.model import ModelSpec

log = logging.getLogger("sluice.registry")

State = Literal["not_loaded", "loading", "loaded", "unloading"]


class LoadedModel(Backend, Protocol):
    """What a loader returns: a backend the registry can close."""

    def close(self) -> None:
        """Blocking: end in-flight requests (a ``ModelUnloaded`` frame) and free the memory."""

    def load_config(self) -> dict[str, Any]:
        """The effective configuration for listings, e.g. ``{"context_length": 4096}``."""

    def extra_bytes(self) -> int:
        """Memory it holds now beyond its load's estimate: the RAM prompt cache's
        states, an embedding context made since."""

    def reclaim(self, nbytes: int) -> int:
        """Free up to ``nbytes`` it holds without unloading (its prompt cache's least
        recently used states), from any thread; the bytes freed."""

    def reclaimable_bytes(self) -> int:
        """What :meth:`reclaim` could free now."""

    def bind_memory(self, room: MemoryRoom) -> None:
        """From now on, keep what it takes after the load within ``room``."""


# Both get the options with the spec's values filled in (None: the server's setting).
# A loader blocks, and calls progress(0..1) from its own thread.
Loader = Callable[[ModelSpec, LoadOptions, Progress], LoadedModel]
Estimator = Callable[[ModelSpec, LoadOptions], int]  # the bytes a load needs


@dataclass(frozen=True, slots=True)
class ModelStatus:
    name: str
    state: State
    in_use: int  # open leases
    last_used: float | None  # wall-clock time (time.time()) of the last acquire or release
    load_seconds: float | None
    estimate_bytes: int | None  # known once the model was sized (loaded, or a load tried)
    load_config: dict[str, Any] | None
    loads: int = 0  # loads completed since the server started
    ttl: float | None = None  # a loaded model's idle TTL in seconds (0: never unloads)


@dataclass(frozen=True, slots=True)
class LoadResult:
    spec: ModelSpec
    loaded_now: bool  # this call started or joined the load
    seconds: float  # how long the load took; 0.0 if the model was already loaded


def effective_options(spec: ModelSpec, options: LoadOptions | None) -> LoadOptions:
    """Options with the spec's values filled in, so equal configurations compare equal."""
    options = options or LoadOptions()
    return LoadOptions(
        ctx=options.ctx if options.ctx is not None else spec.ctx,
        parallel=options.parallel if options.parallel is not None else spec.parallel,
    )


def describe_options(options: LoadOptions) -> str:
    ctx = options.ctx if options.ctx is not None else "default"
    parallel = options.parallel if options.parallel is not None else "default"
    return f"context_length={ctx}, parallel={parallel}"


def close_quietly(model: LoadedModel) -> None:
    try:
        model.close()
    except Exception:
        log.exception("closing an abandoned model failed")


@dataclass(slots=True, eq=False)
class Instance:
    """One loaded copy of a model. Leases point here, so a release after an unload is harmless."""

    spec: ModelSpec
    model: LoadedModel
    options: LoadOptions
    estimate: int
    load_seconds: float
    leases: int = 0
    ttl: float | None = None  # set by acquire(ttl=...); None: the spec's, else the registry's
    # Set by an explicit load(ttl=...) (0: stays loaded): a request's ttl does not change it.
    ttl_pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)
    last_used_wall: float = field(default_factory=time.time)

    def touch(self) -> None:
        self.last_used = time.monotonic()
        self.last_used_wall = time.time()


@dataclass(slots=True, eq=False)
class Load:
    """A load in flight: the one task every waiter awaits, and their progress callbacks."""

    spec: ModelSpec
    options: LoadOptions
    estimate: int
    subscribers: list[Progress] = field(default_factory=list)
    last: float = -1.0
    task: asyncio.Task[Instance] | None = None

    def deliver(self, value: float) -> None:
        """On the loop: pass a new high-water mark to every subscriber."""
        value = min(max(float(value), 0.0), 1.0)
        if value <= self.last:
            return
        self.last = value
        for callback in list(self.subscribers):
            try:
                callback(value)
            except Exception:  # one broken subscriber must not starve the others
                log.exception("a load progress callback failed")


@dataclass(slots=True, eq=False)
class Entry:
    """Everything the registry knows about one model name."""

    spec: ModelSpec
    instance: Instance | None = None
    loading: Load | None = None
    unloading: asyncio.Task[None] | None = None
    # Waiters between a load's end and taking their lease: the fresh model is
    # not idle for them, so neither LRU nor TTL may take it away.
    pending: int = 0
    loads: int = 0  # loads completed since the server started

    def state(self) -> State:
        if self.loading is not None:
            return "loading"
        if self.unloading is not None:
            return "unloading"
        return "loaded" if self.instance is not None else "not_loaded"

    def idle(self) -> bool:
        return (
            self.instance is not None
            and self.instance.leases == 0
            and self.pending == 0
            and self.loading is None
        )

    def holds(self) -> bool:
        return self.instance is not None or self.loading is not None

    def last_used(self) -> float:
        return self.instance.last_used if self.instance is not None else 0.0

    def held(self) -> int:
        """Bytes this model holds or is about to hold: its load's estimate, and what it
        took since (prompt cache, embedding context), so the guard counts both."""
        # Read once each: other threads ask (the engines' prompt caches, through
        # _SharedBudget) while the loop may be clearing them.
        loading, instance = self.loading, self.instance
        if loading is not None:
            return loading.estimate
        if instance is None:
            return 0
        return instance.estimate + instance.model.extra_bytes()

    def activity(self) -> str:
        if self.loading is not None:
            return "loading"
        n = (self.instance.leases if self.instance else 0) + self.pending
        return f"{n} request{'s' if n != 1 else ''} in flight"


class Lease:
    """A request's hold on a loaded model: while open, neither TTL nor LRU unloads the model.

    An explicit unload still closes it (its in-flight requests end with an error
    frame); releasing afterwards is harmless. Release on the event loop.
    """

    __slots__ = ("_instance", "_on_release", "_released", "load_seconds", "loaded_now")

    def __init__(
        self, instance: Instance, loaded_now: bool, on_release: Callable[[], None]
    ) -> None:
        self._instance = instance
        self._on_release = on_release
        self._released = False
        self.loaded_now = loaded_now  # this acquire started or joined a load
        self.load_seconds = instance.load_seconds if loaded_now else None

    @property
    def spec(self) -> ModelSpec:
        return self._instance.spec

    @property
    def model(self) -> LoadedModel:
        return self._instance.model

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._instance.leases -= 1
        self._instance.touch()
        self._on_release()
