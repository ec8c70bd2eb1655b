"""The model registry: the lifecycle of every local model in one server process.

A model loads just in time on first use, once however many requests wait for
it (each waiter sees the load's progress), and unloads on request, after an
idle TTL, or to make room for another (least recently used first). A load
that would not fit the memory budget is refused with a typed error before it
starts. The registry does not know llama.cpp: a ``Loader`` does the blocking
load and returns a ``LoadedModel``; an ``Estimator`` says how many bytes a
load needs.

All registry state lives on the event loop. Loads, closes and estimates run
on their own daemon threads (as in ``offload.py``: a long C call must never
keep the process from exiting, nor hold a worker of the shared default
executor for the seconds a load takes) and report back with
``call_soon_threadsafe``.

Example::

    registry = ModelRegistry(lambda: specs, default="smollm2", loader=load_local,
                             estimator=estimate_bytes, budget_bytes=8 << 30)
    await registry.start()
    lease = await registry.acquire("smollm2", progress=lambda p: print(f"{p:.0%}"))
    try:
        ...  # use lease.model
    finally:
        lease.release()
    await registry.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sluice.core.backend import LoadOptions, Progress
from sluice.core.errors import (
    ModelLoadFailed,
    ModelNotFound,
    ServerBusy,
    ShuttingDown,
    SluiceError,
)
from sluice.core.model import ModelSpec
from sluice.local.offload import post_to_loop, run_in_thread
from sluice.models.entries import (
    Entry,
    Estimator,
    Instance,
    Lease,
    Load,
    LoadedModel,
    Loader,
    LoadResult,
    ModelStatus,
    close_quietly,
    describe_options,
    effective_options,
)
from sluice.models.memory import RETRY_AFTER, mem_available, plan_room

log = logging.getLogger("sluice.registry")

T = TypeVar("T")


class ModelRegistry:
    """Resolves model names, loads just in time, and unloads on request, TTL or for room."""

    def __init__(
        self,
        specs: Callable[[], list[ModelSpec]],
        *,
        default: str,
        loader: Loader,
        estimator: Estimator,
        budget_bytes: int,
        max_loaded: int = 4,
        ttl: float = 3600.0,
        strict_names: bool = False,
        available_memory: Callable[[], int | None] = mem_available,
    ) -> None:
        if max_loaded < 1:
            raise ValueError("max_loaded must be at least 1")
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self._read_specs = specs
        self._default = default
        self._loader = loader
        self._estimator = estimator
        self._budget = budget_bytes
        self._max_loaded = max_loaded
        self._ttl = ttl
        self._strict = strict_names
        self._available = available_memory
        self._specs: list[ModelSpec] = []
        self._index: dict[str, ModelSpec] = {}
        self._entries: dict[str, Entry] = {}
        self._estimates: dict[tuple[ModelSpec, LoadOptions], int] = {}
        self._wake = asyncio.Event()  # something changed that may move a TTL deadline
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self._room = _SharedBudget(self)
        self._refresh()

    # -- names ---------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelSpec:
        """The spec for a name or alias (any case); ``None`` or unknown: the default."""
        if name is not None:
            spec = self._lookup(name)
            if spec is not None:
                return spec
            if self._strict:
                raise ModelNotFound(name)
        spec = self._lookup(self._default)
        if spec is None:
            raise ModelNotFound(self._default)
        return spec

    def find(self, name: str) -> ModelSpec | None:
        """The spec a name or alias (any case) names, as last read: no rescan, no
        default. Cheap enough to ask per request (the dispatcher does)."""
        return self._index.get(name.lower())

    def known(self) -> list[ModelSpec]:
        """Every model that can be served, re-read so a new download shows up."""
        self._refresh()
        return list(self._specs)

    def _refresh(self) -> None:
        self._specs = list(self._read_specs())
        index: dict[str, ModelSpec] = {}
        # Aliases first, so a model's own name wins over another model's alias.
        for spec in self._specs:
            for alias in spec.aliases:
                index.setdefault(alias.lower(), spec)
        for spec in self._specs:
            index[spec.name.lower()] = spec
        self._index = index

    def _lookup(self, name: str) -> ModelSpec | None:
        spec = self._index.get(name.lower())
        if spec is None:  # the file may have been downloaded since the last read
            self._refresh()
            spec = self._index.get(name.lower())
        return spec

    def named(self, name: str) -> ModelSpec:
        """The spec a name or alias names, else :class:`ModelNotFound` (404): explicit
        load and unload, and lookups (``/api/show``), never fall back to the default."""
        spec = self._lookup(name)
        if spec is None:
            raise ModelNotFound(name)
        return spec

    def _entry(self, spec: ModelSpec) -> Entry:
        entry = self._entries.get(spec.name.lower())
        if entry is None:
            entry = self._entries[spec.name.lower()] = Entry(spec)
        elif entry.instance is None and entry.loading is None:
            entry.spec = spec  # the config may have changed since the last load
        return entry

    # -- using models ----------------------------------------------------------

    async def acquire(
        self,
        name: str | None,
        *,
        options: LoadOptions | None = None,
        progress: Progress | None = None,
        ttl: float | None = None,
    ) -> Lease:
        """A lease on the model, loading it first if needed; release it when done.

        ``options`` None takes whatever instance is loaded; other options than the
        loaded instance's reload it when idle (``ServerBusy`` when in use). ``ttl``
        sets this model's idle TTL from now on, like LM Studio's per-request ttl,
        unless an explicit :meth:`load` set it.
        """
        return await self._acquire(self.resolve(name), options, progress, ttl, pin=False)

    async def load(
        self,
        name: str,
        options: LoadOptions | None = None,
        progress: Progress | None = None,
        *,
        ttl: float | None = None,
    ) -> LoadResult:
        """Load a model explicitly (no fallback to the default) and hold no lease.

        ``ttl`` (0: never unload when idle) holds against later requests' ttl.
        """
        lease = await self._acquire(self.named(name), options, progress, ttl, pin=ttl is not None)
        lease.release()
        return LoadResult(lease.spec, lease.loaded_now, lease.load_seconds or 0.0)

    async def _acquire(
        self,
        spec: ModelSpec,
        options: LoadOptions | None,
        progress: Progress | None,
        ttl: float | None,
        *,
        pin: bool,
    ) -> Lease:
        entry = self._entry(spec)
        wanted = None if options is None else effective_options(spec, options)
        joined = False
        # Every await below lets the state move on, so each turn looks again.
        while True:
            self._check_open()
            if entry.unloading is not None:
                await asyncio.wait({entry.unloading})
            elif entry.loading is not None:
                load = entry.loading
                assert load.task is not None
                if wanted is not None and load.options != wanted:
                    await asyncio.wait({load.task})  # then reload it below, if idle
                    continue
                instance = await self._join(entry, load, progress)
                joined = True
                self._check_open()
                if entry.instance is instance:
                    return self._lease(instance, joined, ttl, pin)
            elif entry.instance is not None:
                instance = entry.instance
                if wanted is None or instance.options == wanted:
                    return self._lease(instance, joined, ttl, pin)
                if not entry.idle():
                    raise ServerBusy(
                        f"Model '{spec.name}' is in use with other load options "
                        f"({describe_options(instance.options)}); it can reload with "
                        f"{describe_options(wanted)} once idle.",
                        retry_after=RETRY_AFTER,
                    )
                self._unload(entry)
            else:
                fresh = wanted if wanted is not None else effective_options(spec, None)
                await self._begin_load(entry, spec, fresh)

    async def _join(self, entry: Entry, load: Load, progress: Progress | None) -> Instance:
        assert load.task is not None
        entry.pending += 1
        if progress is not None:
            load.subscribers.append(progress)
        try:
            # Shielded: a waiter whose client went away must not cancel everyone's load.
            return await asyncio.shield(load.task)
        finally:
            entry.pending -= 1
            if progress is not None:
                load.subscribers.remove(progress)

    def _lease(self, instance: Instance, loaded_now: bool, ttl: float | None, pin: bool) -> Lease:
        instance.leases += 1
        instance.touch()
        if ttl is not None and (pin or not instance.ttl_pinned):
            instance.ttl = ttl
            instance.ttl_pinned = pin
        return Lease(instance, loaded_now, self._wake.set)

    def _check_open(self) -> None:
        if self._closed:
            raise ShuttingDown("The server is shutting down; no model can be loaded.")

    # -- loading ---------------------------------------------------------------

    async def _begin_load(self, entry: Entry, spec: ModelSpec, options: LoadOptions) -> None:
        need = await self._estimate(spec, options)
        if self._closed or entry.state() != "not_loaded":
            return  # the state moved on while sizing: the caller looks again
        try:
            victims = self._make_room(spec, need)
        except BaseException:
            self._room.pending = 0
            raise
        for victim in victims:
            log.info(
                "unloading '%s' (least recently used) to load '%s'", victim.spec.name, spec.name
            )
            self._unload(victim)
        # Wait for every unload in progress, not only ours: their memory is not free yet.
        unloads = [e.unloading for e in self._entries.values() if e.unloading is not None]
        load = Load(spec, options, need)
        entry.loading = load
        self._room.pending = 0
        load.task = asyncio.create_task(self._load(entry, load, unloads), name=f"load {spec.name}")
        # Retrieved here so a failed load nobody waits for any more logs no warning.
        load.task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _estimate(self, spec: ModelSpec, options: LoadOptions) -> int:
        key = (spec, options)
        need = self._estimates.get(key)
        if need is None:
            # Off the loop: sizing reads the file's metadata.
            try:
                need = await run_in_thread(
                    lambda: self._estimator(spec, options), "sluice-estimate"
                )
            except SluiceError:
                raise
            except Exception as exc:
                raise ModelLoadFailed(f"Could not size model '{spec.name}': {exc}") from exc
            self._estimates[key] = need
        return need

    def _make_room(self, spec: ModelSpec, need: int) -> list[Entry]:
        """The idle models to unload so ``need`` fits; raises if it cannot fit now.

        Saved prompt states go first: they are a cache, cheaper to lose than a
        loaded model."""
        holders = [e for e in self._entries.values() if e.holds()]
        over = sum(h.held() for h in holders) + need - self._budget
        # Counted as held until the load is (the caches must not refill the room).
        self._room.pending = need
        if over > 0 and need <= self._budget:  # (too large for any room: nothing to drop)
            freed = self._room.reclaim(over)
            if freed:
                log.info(
                    "dropped %d MiB of saved prompt states to load '%s'", freed >> 20, spec.name
                )
        return plan_room(
            spec.name,
            need,
            holders,
            budget=self._budget,
            max_loaded=self._max_loaded,
            available=self._available(),
        )

    async def _load(self, entry: Entry, load: Load, unloads: list[asyncio.Task[None]]) -> Instance:
        spec = load.spec
        loop = asyncio.get_running_loop()

        def progress(value: float) -> None:  # on the load thread
            post_to_loop(loop, lambda: load.deliver(value))

        try:
            if unloads:
                await asyncio.wait(unloads)
            started = time.monotonic()
            model = await run_in_thread(
                lambda: self._loader(spec, load.options, progress),
                f"sluice-load-{spec.name}",
                abandon=close_quietly,
            )
            seconds = time.monotonic() - started
        except BaseException as exc:
            entry.loading = None
            if isinstance(exc, SluiceError) or not isinstance(exc, Exception):
                raise
            raise ModelLoadFailed(f"Could not load model '{spec.name}': {exc}") from exc
        # Every progress call was posted before the result, so this comes last.
        load.deliver(1.0)
        instance = Instance(spec, model, load.options, load.estimate, seconds)
        model.bind_memory(self._room)
        entry.instance = instance
        entry.loading = None
        entry.loads += 1
        log.info("loaded '%s' in %.2f s", spec.name, seconds)
        self._wake.set()
        return instance

    # -- unloading -------------------------------------------------------------

    async def unload(self, name: str) -> None:
        """Unload now, even with requests in flight (they end with an error frame)."""
        spec = self.named(name)
        entry = self._entries.get(spec.name.lower())
        if entry is not None and entry.loading is not None and entry.loading.task is not None:
            await asyncio.wait({entry.loading.task})  # let the load finish, then unload it
        if entry is not None and entry.unloading is not None:
            await asyncio.wait({entry.unloading})
            return
        if entry is None or entry.instance is None:
            raise ModelNotFound(name)
        await asyncio.wait({self._unload(entry)})

    def _unload(self, entry: Entry) -> asyncio.Task[None]:
        instance = entry.instance
        assert instance is not None
        entry.instance = None

        async def close() -> None:
            try:
                await run_in_thread(instance.model.close, f"sluice-unload-{instance.spec.name}")
            except Exception:  # the instance is gone from the registry either way
                log.exception("closing '%s' failed", instance.spec.name)
            else:
                log.info("unloaded '%s'", instance.spec.name)
            finally:
                entry.unloading = None

        task = asyncio.create_task(close(), name=f"unload {instance.spec.name}")
        entry.unloading = task
        return task

    # -- TTL -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the TTL reaper."""
        if self._reaper is None and not self._closed:
            self._reaper = asyncio.create_task(self._reap(), name="model ttl reaper")

    async def _reap(self) -> None:
        while not self._closed:
            self._wake.clear()
            delay = self._unload_expired()
            # Sleep to the next deadline; a release or a load wakes us to recompute.
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that
            # arrives as the event is set, and the reaper would never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    def _unload_expired(self) -> float | None:
        """Unload idle models past their TTL; seconds until the next deadline."""
        now = time.monotonic()
        next_due: float | None = None
        for entry in self._entries.values():
            instance = entry.instance
            if instance is None or not entry.idle():
                continue
            ttl = self._ttl_of(instance)
            if ttl <= 0:
                continue
            left = instance.last_used + ttl - now
            if left <= 0:
                log.info("unloading '%s': idle for %g s", instance.spec.name, ttl)
                self._unload(entry)
            else:
                next_due = left if next_due is None else min(next_due, left)
        return next_due

    def _ttl_of(self, instance: Instance) -> float:
        if instance.ttl is not None:
            return instance.ttl
        return instance.spec.ttl if instance.spec.ttl is not None else self._ttl

    # -- listing and shutdown --------------------------------------------------

    def status(self) -> list[ModelStatus]:
        """One row per known model, plus any loaded model whose spec has since vanished."""
        rows = [self._status(spec) for spec in self.known()]
        listed = {row.name.lower() for row in rows}
        for key, entry in self._entries.items():
            if key not in listed and entry.state() != "not_loaded":
                rows.append(self._status(entry.spec))
        return rows

    def _status(self, spec: ModelSpec) -> ModelStatus:
        entry = self._entries.get(spec.name.lower())
        instance = entry.instance if entry is not None else None
        estimate = entry.held() if entry is not None and entry.holds() else None
        return ModelStatus(
            name=spec.name,
            state=entry.state() if entry is not None else "not_loaded",
            in_use=instance.leases if instance is not None else 0,
            last_used=instance.last_used_wall if instance is not None else None,
            load_seconds=instance.load_seconds if instance is not None else None,
            estimate_bytes=(
                estimate
                if estimate is not None
                else self._estimates.get((spec, effective_options(spec, None)))
            ),
            load_config=instance.model.load_config() if instance is not None else None,
            loads=entry.loads if entry is not None else 0,
            ttl=self._ttl_of(instance) if instance is not None else None,
        )

    def get_loaded(self, name: str) -> LoadedModel | None:
        spec = self._index.get(name.lower())
        entry = self._entries.get(spec.name.lower()) if spec is not None else None
        instance = entry.instance if entry is not None else None
        return instance.model if instance is not None else None

    async def close(self) -> None:
        """Stop the reaper, let loads in flight finish, and unload every model."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        while busy := list(_in_flight(self._entries.values())):
            await asyncio.wait(busy)
        unloads = [self._unload(e) for e in self._entries.values() if e.instance is not None]
        if unloads:
            await asyncio.wait(unloads)


class _SharedBudget:
    """The memory budget as a loaded model sees it (``MemoryRoom``), from any thread:
    the models' prompt caches grow only into what no model holds, and give it back
    when a load or an embedding context needs it."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self.pending = 0  # a load being planned, not yet in its entry
        self._reserving = threading.Lock()  # one reservation looks at a time

    def free(self) -> int:
        registry = self._registry
        # A copy first: the loop may add an entry meanwhile (tuple() holds the GIL).
        held = sum(e.held() for e in tuple(registry._entries.values()))
        return registry._budget - held - self.pending

    def reclaim(self, nbytes: int) -> int:
        freed = 0
        for instance in self._instances():
            if freed >= nbytes:
                break
            freed += instance.model.reclaim(nbytes - freed)
        return freed

    def reserve(self, nbytes: int, hold: Callable[[int], None]) -> int:
        with self._reserving:
            free = self.free()
            if nbytes <= free:
                hold(nbytes)
                return free
            # Saved states go only when that makes it fit: never for nothing.
            reclaimable: int = sum(i.model.reclaimable_bytes() for i in self._instances())
            if nbytes > free + reclaimable:
                return free + reclaimable
            self.reclaim(nbytes - free)
            free = self.free()
            if nbytes <= free:
                hold(nbytes)
            return free

    def _instances(self) -> list[Any]:
        """The loaded instances, least recently used first (a copy: any thread)."""
        instances = [e.instance for e in tuple(self._registry._entries.values())]
        return sorted((i for i in instances if i), key=lambda i: i.last_used)


def _in_flight(entries: Iterable[Entry]) -> Iterable[asyncio.Task[Any]]:
    for entry in entries:
        if entry.loading is not None and entry.loading.task is not None:
            yield entry.loading.task
        if entry.unloading is not None:
            yield entry.unloading
