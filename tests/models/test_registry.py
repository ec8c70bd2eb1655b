"""The model registry at its boundary: a fake loader and estimator stand in for llama.cpp.

The fake loader counts its calls, sends scripted progress, and can be held
open on a ``threading.Event`` (as a slow load would be) or fail once; the
fake model records which thread closed it and can hold its close open too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sluice.core.backend import MemoryRoom
from sluice.core.errors import (
    InsufficientMemory,
    ModelLoadFailed,
    ModelNotFound,
    ModelTooLarge,
    RequestCancelled,
    ServerBusy,
    ShuttingDown,
)
from sluice.metrics import Metrics
from sluice.models.catalog import ModelSpec
from sluice.models.dispatch import Dispatcher
from sluice.models.flights import CALLER, Caller
from sluice.models.memory import mem_available
from sluice.models.registry import LoadOptions, ModelRegistry, Progress

GiB = 1 << 30
SPECS = [
    ModelSpec("alpha", "/models/alpha.gguf", aliases=("a", "Alpha-Chat")),
    ModelSpec("beta", "/models/beta.gguf"),
    ModelSpec("gamma", "/models/gamma.gguf"),
    ModelSpec("delta", "/models/delta.gguf"),
]


class FakeModel:
    def __init__(self, spec: ModelSpec, options: LoadOptions, hold_close: threading.Event) -> None:
        self.spec = spec
        self.options = options
        self.closed = threading.Event()
        self.close_thread: int | None = None
        self._hold_close = hold_close

    def close(self) -> None:
        self.close_thread = threading.get_ident()
        assert self._hold_close.wait(5)
        self.closed.set()

    def load_config(self) -> dict[str, Any]:
        return {"context_length": self.options.ctx or 4096, "parallel": self.options.parallel or 4}

    extra = 0  # bytes taken since the load that stay (an embedding context)
    cache = 0  # bytes of saved prompt states, which reclaim() gives back
    room: MemoryRoom | None = None

    def extra_bytes(self) -> int:
        return self.extra + self.cache

    def reclaim(self, nbytes: int) -> int:
        freed = min(nbytes, self.cache)
        self.cache -= freed
        return freed

    def reclaimable_bytes(self) -> int:
        return self.cache

    def bind_memory(self, room: MemoryRoom) -> None:
        self.room = room


class FakeLoader:
    def __init__(self) -> None:
        self.calls: list[tuple[str, LoadOptions]] = []
        self.threads: list[int] = []
        self.models: list[FakeModel] = []
        self.gates: dict[str, threading.Event] = {}
        self.failures: dict[str, Exception] = {}  # raised once, by the next load of that name
        self.steps: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {}  # before/after gate
        self.hold_close = threading.Event()
        self.hold_close.set()

    def hold(self, name: str) -> threading.Event:
        gate = self.gates[name] = threading.Event()
        return gate

    def count(self, name: str) -> int:
        return sum(1 for called, _ in self.calls if called == name)

    def __call__(self, spec: ModelSpec, options: LoadOptions, progress: Progress) -> FakeModel:
        self.calls.append((spec.name, options))
        self.threads.append(threading.get_ident())
        before, after = self.steps.get(spec.name, ((), ()))
        for value in before:
            progress(value)
        gate = self.gates.get(spec.name)
        if gate is not None:
            assert gate.wait(5)
        for value in after:
            progress(value)
        failure = self.failures.pop(spec.name, None)
        if failure is not None:
            raise failure
        model = FakeModel(spec, options, self.hold_close)
        self.models.append(model)
        return model


class FakeEstimator:
    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    def __call__(self, spec: ModelSpec, options: LoadOptions) -> int:
        return self.sizes.get(spec.name, GiB)


@pytest.fixture
def loader() -> FakeLoader:
    return FakeLoader()


@pytest.fixture
def estimator() -> FakeEstimator:
    return FakeEstimator()


@pytest.fixture
async def make(
    loader: FakeLoader, estimator: FakeEstimator
) -> AsyncIterator[Callable[..., ModelRegistry]]:
    made: list[ModelRegistry] = []

    def build(**kwargs: Any) -> ModelRegistry:
        specs = kwargs.pop("specs", SPECS)
        settings: dict[str, Any] = {
            "default": "alpha",
            "loader": loader,
            "estimator": estimator,
            "budget_bytes": 16 * GiB,
            "available_memory": lambda: None,
        }
        registry = ModelRegistry(lambda: list(specs), **{**settings, **kwargs})
        made.append(registry)
        return registry

    yield build
    for gate in loader.gates.values():
        gate.set()
    loader.hold_close.set()
    for registry in made:
        await registry.close()


async def until(check: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def state(registry: ModelRegistry, name: str) -> str:
    return next(s.state for s in registry.status() if s.name == name)


async def use(registry: ModelRegistry, name: str) -> None:
    (await registry.acquire(name)).release()
    await asyncio.sleep(0.002)  # distinct last-used times for LRU


# -- names -------------------------------------------------------------------


async def test_resolve_by_name_or_alias_in_any_case_and_falls_back_to_default(
    make: Callable[..., ModelRegistry],
) -> None:
    registry = make(default="beta")
    assert registry.resolve("ALPHA").name == "alpha"
    assert registry.resolve("alpha-chat").name == "alpha"
    assert registry.resolve("A").name == "alpha"
    assert registry.resolve(None).name == "beta"
    assert registry.resolve("no-such-model").name == "beta"
    assert [s.name for s in registry.known()] == ["alpha", "beta", "gamma", "delta"]


async def test_strict_names_refuse_an_unknown_name(make: Callable[..., ModelRegistry]) -> None:
    registry = make(strict_names=True)
    with pytest.raises(ModelNotFound, match="no-such-model"):
        registry.resolve("no-such-model")
    assert registry.resolve(None).name == "alpha"  # no name at all still means the default


async def test_a_miss_rereads_the_specs_once(loader: FakeLoader, estimator: FakeEstimator) -> None:
    specs = list(SPECS)
    reads = 0

    def read() -> list[ModelSpec]:
        nonlocal reads
        reads += 1
        return list(specs)

    registry = ModelRegistry(
        read, default="alpha", loader=loader, estimator=estimator, budget_bytes=GiB * 16
    )
    before = reads
    assert registry.resolve("beta").name == "beta"
    assert reads == before  # a hit reads nothing
    specs.append(ModelSpec("fresh", "/models/fresh.gguf"))  # downloaded since
    assert registry.resolve("Fresh").name == "fresh"
    assert reads == before + 1
    assert registry.resolve("ghost").name == "alpha"
    assert reads == before + 2


# -- single flight -------------------------------------------------------------


async def test_concurrent_acquires_share_one_load(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("alpha")
    waiters = [asyncio.create_task(registry.acquire("alpha")) for _ in range(8)]
    await until(lambda: loader.count("alpha") == 1)
    await asyncio.sleep(0.02)
    assert state(registry, "alpha") == "loading"
    gate.set()
    leases = await asyncio.gather(*waiters)
    assert loader.count("alpha") == 1
    assert len({id(lease.model) for lease in leases}) == 1
    assert all(lease.loaded_now and lease.load_seconds is not None for lease in leases)
    assert next(s for s in registry.status() if s.name == "alpha").in_use == 8
    leases[0].release()
    leases[0].release()  # idempotent
    assert next(s for s in registry.status() if s.name == "alpha").in_use == 7
    again = await registry.acquire("a")
    assert not again.loaded_now and again.load_seconds is None
    assert again.model is leases[0].model and loader.count("alpha") == 1


async def test_a_cancelled_waiter_does_not_cancel_the_load(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("alpha")
    gone = asyncio.create_task(registry.acquire("alpha"))
    stays = asyncio.create_task(registry.acquire("alpha"))
    await until(lambda: loader.count("alpha") == 1)
    gone.cancel()
    await asyncio.sleep(0.01)
    gate.set()
    lease = await stays
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert not lease.model.closed.is_set()  # type: ignore[attr-defined]
    assert loader.count("alpha") == 1


async def test_a_load_whose_only_waiter_left_still_completes(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("beta")
    gone = asyncio.create_task(registry.acquire("beta"))
    await until(lambda: loader.count("beta") == 1)
    gone.cancel()
    await asyncio.sleep(0.01)
    gate.set()
    await until(lambda: state(registry, "beta") == "loaded")
    assert registry.get_loaded("beta") is loader.models[0]
    assert not (await registry.acquire("beta")).loaded_now


async def test_a_failed_load_raises_one_typed_error_to_every_waiter_then_retries(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("alpha")
    loader.failures["alpha"] = OSError("bad magic")
    waiters = [asyncio.create_task(registry.acquire("alpha")) for _ in range(3)]
    await until(lambda: loader.count("alpha") == 1)
    gate.set()
    errors = await asyncio.gather(*waiters, return_exceptions=True)
    error = errors[0]
    assert isinstance(error, ModelLoadFailed)
    assert errors[1] is error and errors[2] is error  # one error, raised to every waiter
    assert isinstance(error.__cause__, OSError) and "bad magic" in error.message
    assert state(registry, "alpha") == "not_loaded"
    lease = await registry.acquire("alpha")
    assert lease.loaded_now and loader.count("alpha") == 2


async def test_a_typed_loader_error_reaches_the_waiter_unchanged(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    loader.failures["alpha"] = ModelTooLarge("no room on the GPU")
    with pytest.raises(ModelTooLarge, match="no room on the GPU"):
        await registry.acquire("alpha")


# -- progress and threads --------------------------------------------------------


async def test_progress_reaches_every_waiter_on_the_loop_strictly_increasing(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("alpha")
    loader.steps["alpha"] = ((0.1, 0.2, 0.2, 0.15), (0.5, 0.4, 0.9))
    loop_thread = threading.get_ident()
    first: list[tuple[float, int]] = []
    late: list[tuple[float, int]] = []
    a = asyncio.create_task(
        registry.acquire("alpha", progress=lambda p: first.append((p, threading.get_ident())))
    )
    await until(lambda: len(first) == 2)
    b = asyncio.create_task(
        registry.acquire("alpha", progress=lambda p: late.append((p, threading.get_ident())))
    )
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(a, b)
    assert [p for p, _ in first] == [0.1, 0.2, 0.5, 0.9, 1.0]
    assert [p for p, _ in late] == [0.5, 0.9, 1.0]  # from when it joined
    assert {t for _, t in first + late} == {loop_thread}


async def test_a_loader_that_reports_completion_is_not_sent_it_twice(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    loader.steps["alpha"] = ((0.5, 1.0), ())
    seen: list[float] = []
    await registry.acquire("alpha", progress=seen.append)
    assert seen == [0.5, 1.0]


async def test_load_and_close_run_off_the_event_loop(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    await registry.acquire("alpha")
    await registry.unload("alpha")
    loop_thread = threading.get_ident()
    assert loader.threads[0] != loop_thread
    assert loader.models[0].close_thread not in (None, loop_thread)


# -- memory guard -------------------------------------------------------------------


async def test_a_model_larger_than_the_budget_is_refused_before_loading(
    make: Callable[..., ModelRegistry], loader: FakeLoader, estimator: FakeEstimator
) -> None:
    registry = make(budget_bytes=16 * GiB)
    estimator.sizes["alpha"] = 20 * GiB
    with pytest.raises(ModelTooLarge) as caught:
        await registry.acquire("alpha")
    assert "20.0 GiB" in caught.value.message and "16.0 GiB" in caught.value.message
    assert loader.calls == []


async def test_the_least_recently_used_idle_model_makes_room(
    make: Callable[..., ModelRegistry], loader: FakeLoader, estimator: FakeEstimator
) -> None:
    registry = make(budget_bytes=3 * GiB)
    estimator.sizes["gamma"] = 2 * GiB
    await use(registry, "alpha")
    await use(registry, "beta")
    await use(registry, "alpha")  # beta is now the least recently used
    await registry.acquire("gamma")
    alpha, beta = loader.models[:2]
    assert beta.closed.is_set() and not alpha.closed.is_set()
    assert [state(registry, n) for n in ("alpha", "beta", "gamma")] == [
        "loaded",
        "not_loaded",
        "loaded",
    ]


async def test_memory_held_by_models_in_use_is_insufficient_memory(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(budget_bytes=2 * GiB)
    await registry.acquire("alpha")
    await registry.acquire("beta")
    with pytest.raises(InsufficientMemory) as caught:
        await registry.acquire("gamma")
    assert "'alpha'" in caught.value.message and "'beta'" in caught.value.message
    assert caught.value.headers()["Retry-After"]
    assert loader.count("gamma") == 0
    assert not any(m.closed.is_set() for m in loader.models)


async def test_available_ram_counts_with_what_evictions_free(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    free = {"bytes": 4 * GiB}
    registry = make(budget_bytes=100 * GiB, available_memory=lambda: free["bytes"])
    await use(registry, "alpha")
    free["bytes"] = GiB // 2  # other processes took the rest
    lease = await registry.acquire("beta")  # fits only once alpha's 1 GiB is freed
    assert loader.models[0].closed.is_set()
    with pytest.raises(InsufficientMemory, match="RAM") as caught:
        await registry.acquire("gamma")
    assert "'beta'" in caught.value.message
    lease.release()


# -- max loaded ------------------------------------------------------------------------


async def test_max_loaded_evicts_the_least_recently_used_idle_model(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(max_loaded=2)
    await use(registry, "alpha")
    await use(registry, "beta")
    await use(registry, "alpha")
    await registry.acquire("gamma")
    assert loader.models[1].closed.is_set() and not loader.models[0].closed.is_set()
    assert sum(s.state == "loaded" for s in registry.status()) == 2


async def test_max_loaded_with_every_model_in_use_is_server_busy(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(max_loaded=2)
    await registry.acquire("alpha")
    await registry.acquire("beta")
    with pytest.raises(ServerBusy) as caught:
        await registry.acquire("gamma")
    assert type(caught.value) is ServerBusy  # not a memory problem
    assert "--max-loaded-models" in caught.value.message
    assert loader.count("gamma") == 0


# -- TTL -------------------------------------------------------------------------------


async def test_an_idle_model_unloads_after_its_ttl(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(ttl=0.2)
    await registry.start()  # nothing loaded: the reaper sleeps until something changes
    lease = await registry.acquire("alpha")
    await asyncio.sleep(0.35)
    assert state(registry, "alpha") == "loaded"  # leased: never expires
    lease.release()
    released = time.monotonic()
    await until(loader.models[0].closed.is_set)
    assert time.monotonic() - released >= 0.19
    assert state(registry, "alpha") == "not_loaded"


async def test_the_reaper_sleeps_until_the_next_deadline(
    make: Callable[..., ModelRegistry], loader: FakeLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = make(ttl=0.5)
    sweeps = 0
    sweep = registry._unload_expired

    def counted() -> float | None:
        nonlocal sweeps
        sweeps += 1
        return sweep()

    monkeypatch.setattr(registry, "_unload_expired", counted)
    await registry.start()
    await use(registry, "alpha")
    await until(loader.models[0].closed.is_set)
    assert sweeps <= 5  # start, load, release, deadline (no fast polling)


async def test_a_fresh_model_is_not_reaped_before_its_waiters_take_their_leases(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    # The load's end wakes the reaper before the waiters resume; with a TTL this
    # short only the waiters' claim keeps the model from unloading at once.
    registry = make(ttl=1e-6)
    await registry.start()
    lease = await asyncio.wait_for(registry.acquire("alpha"), 2)
    assert loader.count("alpha") == 1 and not lease.model.closed.is_set()  # type: ignore[attr-defined]
    lease.release()
    await until(loader.models[0].closed.is_set)


async def test_a_spec_ttl_overrides_the_registry_ttl(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    specs = [
        dataclasses.replace(SPECS[0], ttl=0.2),
        dataclasses.replace(SPECS[1], ttl=0),  # never
    ]
    registry = make(specs=specs, ttl=3600.0)
    quick = make(specs=specs, ttl=0.2)
    await registry.start()
    await quick.start()
    await use(registry, "alpha")
    await use(quick, "beta")
    await until(loader.models[0].closed.is_set)
    await asyncio.sleep(0.3)
    assert not loader.models[1].closed.is_set()


async def test_acquire_ttl_sets_the_models_ttl(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(ttl=3600.0)
    forever = make(ttl=0.2)
    await registry.start()
    await forever.start()
    (await registry.acquire("alpha", ttl=0.2)).release()
    (await forever.acquire("beta", ttl=0)).release()
    await until(loader.models[0].closed.is_set)
    await asyncio.sleep(0.3)
    assert not loader.models[1].closed.is_set()


# -- unload -----------------------------------------------------------------------------


async def test_unload_closes_a_model_in_use_and_a_late_release_is_harmless(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    lease = await registry.acquire("alpha")
    await registry.unload("Alpha-Chat")
    assert loader.models[0].closed.is_set()
    assert state(registry, "alpha") == "not_loaded"
    lease.release()
    lease.release()
    again = await registry.acquire("alpha")
    assert again.loaded_now and again.model is not lease.model
    assert next(s for s in registry.status() if s.name == "alpha").in_use == 1


async def test_unload_of_an_unknown_or_unloaded_model_is_not_found(
    make: Callable[..., ModelRegistry],
) -> None:
    registry = make()
    await registry.acquire("alpha")
    with pytest.raises(ModelNotFound):
        await registry.unload("no-such-model")  # never the default model
    with pytest.raises(ModelNotFound):
        await registry.unload("beta")
    assert state(registry, "alpha") == "loaded"


async def test_unload_during_a_load_waits_for_it_then_unloads(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("alpha")
    waiter = asyncio.create_task(registry.acquire("alpha"))
    await until(lambda: loader.count("alpha") == 1)
    unload = asyncio.create_task(registry.unload("alpha"))
    await asyncio.sleep(0.02)
    assert not unload.done()
    gate.set()
    await unload
    assert loader.models[0].closed.is_set()
    assert state(registry, "alpha") == "not_loaded"
    await waiter


async def test_a_request_during_an_unload_waits_then_loads_again(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    await use(registry, "alpha")
    loader.hold_close.clear()
    unload = asyncio.create_task(registry.unload("alpha"))
    await until(lambda: state(registry, "alpha") == "unloading")
    request = asyncio.create_task(registry.acquire("alpha"))
    await asyncio.sleep(0.02)
    assert not request.done() and loader.count("alpha") == 1
    loader.hold_close.set()
    await unload
    lease = await request
    assert lease.loaded_now and loader.count("alpha") == 2
    assert lease.model is loader.models[1] and not loader.models[1].closed.is_set()


# -- load options ------------------------------------------------------------------------


async def test_loading_with_other_options_reloads_an_idle_model(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    first = await registry.load("alpha")
    assert first.loaded_now and first.spec.name == "alpha"
    again = await registry.load("alpha")
    assert not again.loaded_now and again.seconds == 0.0
    assert loader.count("alpha") == 1
    bigger = await registry.load("alpha", LoadOptions(ctx=2048))
    assert bigger.loaded_now and loader.calls[-1][1].ctx == 2048
    assert loader.models[0].closed.is_set()
    row = next(s for s in registry.status() if s.name == "alpha")
    assert row.load_config == {"context_length": 2048, "parallel": 4}
    lease = await registry.acquire("alpha")  # no options: whatever is loaded
    assert lease.model is loader.models[1] and loader.count("alpha") == 2


async def test_other_options_for_a_model_in_use_are_server_busy(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    await registry.acquire("alpha")
    with pytest.raises(ServerBusy, match="in use"):
        await registry.load("alpha", LoadOptions(ctx=2048))
    assert not loader.models[0].closed.is_set() and loader.count("alpha") == 1


async def test_load_reports_its_time_and_never_falls_back_to_the_default(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("beta")
    load = asyncio.create_task(registry.load("beta"))
    await until(lambda: loader.count("beta") == 1)
    await asyncio.sleep(0.05)
    gate.set()
    assert (await load).seconds >= 0.05
    with pytest.raises(ModelNotFound):
        await registry.load("no-such-model")
    assert loader.count("alpha") == 0


# -- status and shutdown ---------------------------------------------------------------


async def test_status_lists_every_known_model(
    make: Callable[..., ModelRegistry], loader: FakeLoader, estimator: FakeEstimator
) -> None:
    registry = make()
    estimator.sizes["alpha"] = 3 * GiB
    gate = loader.hold("alpha")
    waiter = asyncio.create_task(registry.acquire("alpha"))
    await until(lambda: loader.count("alpha") == 1)
    assert state(registry, "alpha") == "loading"
    gate.set()
    await waiter
    rows = {s.name: s for s in registry.status()}
    assert list(rows) == ["alpha", "beta", "gamma", "delta"]
    alpha = rows["alpha"]
    assert (alpha.state, alpha.in_use, alpha.estimate_bytes) == ("loaded", 1, 3 * GiB)
    assert alpha.load_config == {"context_length": 4096, "parallel": 4}
    assert alpha.load_seconds is not None and alpha.last_used is not None
    assert abs(alpha.last_used - time.time()) < 5
    beta = rows["beta"]
    assert (beta.state, beta.in_use, beta.last_used, beta.load_config) == (
        "not_loaded",
        0,
        None,
        None,
    )
    assert registry.get_loaded("a") is loader.models[0]
    assert registry.get_loaded("beta") is None and registry.get_loaded("nope") is None


async def test_close_unloads_everything_and_refuses_new_work(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    await registry.start()
    await use(registry, "alpha")
    await registry.acquire("beta")
    await registry.close()
    assert all(m.closed.is_set() for m in loader.models) and len(loader.models) == 2
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "model ttl reaper"]
    with pytest.raises(ShuttingDown):
        await registry.acquire("alpha")
    with pytest.raises(ShuttingDown):
        await registry.load("gamma")


async def test_close_during_a_load_unloads_it_and_fails_the_waiter(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    gate = loader.hold("alpha")
    waiter = asyncio.create_task(registry.acquire("alpha"))
    await until(lambda: loader.count("alpha") == 1)
    closing = asyncio.create_task(registry.close())
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.wait_for(closing, 2)
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(waiter, 2)
    assert loader.models[0].closed.is_set()


def test_mem_available_reads_proc_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000 kB\nMemAvailable:    2048 kB\n")
    assert mem_available(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:  8000 kB\n")
    assert mem_available(meminfo) is None
    assert mem_available(tmp_path / "missing") is None


async def test_memory_a_model_took_since_its_load_counts_in_the_budget(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(budget_bytes=3 * GiB)  # each model's estimate: 1 GiB
    await use(registry, "alpha")
    await use(registry, "beta")
    # alpha's embedding context took 1.5 GiB: 3.5 GiB held, so gamma needs room,
    # and alpha (least recently used) goes.
    loader.models[0].extra = 3 * GiB // 2
    assert registry.status()[0].estimate_bytes == GiB + 3 * GiB // 2
    await registry.acquire("gamma")
    alpha, beta = loader.models[:2]
    assert alpha.closed.is_set() and not beta.closed.is_set()


async def test_saved_prompt_states_make_room_before_a_model_is_unloaded(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(budget_bytes=4 * GiB)  # each model's estimate: 1 GiB
    await use(registry, "alpha")
    await use(registry, "beta")
    alpha, beta = loader.models
    alpha.cache, beta.cache = GiB, GiB  # 4 GiB held: the budget is full
    assert alpha.room is not None and alpha.room.free() == 0
    await use(registry, "gamma")
    # 1 GiB had to go: alpha's states (the least recently used model), no model.
    assert (alpha.cache, beta.cache) == (0, GiB)
    assert not alpha.closed.is_set() and not beta.closed.is_set()
    assert alpha.room.free() == 0
    # With every state gone and still no room, the least recently used model goes.
    beta.cache = 0
    alpha.extra = 2 * GiB
    await use(registry, "delta")
    assert alpha.closed.is_set() and not beta.closed.is_set()


async def test_the_room_a_model_sees_is_what_no_model_holds(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(budget_bytes=4 * GiB)
    await use(registry, "alpha")
    alpha = loader.models[0]
    assert alpha.room is not None and alpha.room.free() == 3 * GiB
    alpha.cache = GiB // 2
    assert alpha.room.free() == 5 * GiB // 2
    await use(registry, "beta")
    assert alpha.room.free() == 3 * GiB // 2
    # Any thread may ask (the engine thread does, when it keeps a state).
    free = await asyncio.to_thread(alpha.room.free)
    assert free == 3 * GiB // 2
    assert await asyncio.to_thread(alpha.room.reclaim, GiB) == GiB // 2
    assert alpha.cache == 0


async def test_a_reservation_drops_states_only_when_that_makes_it_fit(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(budget_bytes=4 * GiB)
    await use(registry, "alpha")
    await use(registry, "beta")
    alpha = loader.models[0]
    alpha.cache = GiB  # 1 GiB free, 1 GiB of states
    assert alpha.room is not None
    held: list[int] = []
    # More than free + states: refused, and nothing dropped for nothing.
    assert alpha.room.reserve(3 * GiB, held.append) == 2 * GiB
    assert held == [] and alpha.cache == GiB
    # Fits once states go: they go, and the bytes are held before the lock is let go.
    assert alpha.room.reserve(3 * GiB // 2, held.append) >= 3 * GiB // 2
    assert held == [3 * GiB // 2] and alpha.cache == GiB // 2


async def test_two_reservations_at_once_never_both_take_the_last_room(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make(budget_bytes=4 * GiB)
    await use(registry, "alpha")
    await use(registry, "beta")
    alpha, beta = loader.models  # 2 GiB free
    barrier = threading.Barrier(2)

    def reserve(model: FakeModel) -> bool:
        def hold(nbytes: int) -> None:
            time.sleep(0.05)  # a slow bookkeeping step widens any race
            model.extra += nbytes

        assert model.room is not None
        barrier.wait()
        return model.room.reserve(3 * GiB // 2, hold) >= 3 * GiB // 2

    results = await asyncio.gather(
        asyncio.to_thread(reserve, alpha), asyncio.to_thread(reserve, beta)
    )
    assert sorted(results) == [False, True]
    assert alpha.extra + beta.extra == 3 * GiB // 2


async def test_a_request_waiting_for_a_load_is_in_flight_and_can_be_cancelled(
    make: Callable[..., ModelRegistry], loader: FakeLoader
) -> None:
    registry = make()
    dispatcher = Dispatcher(registry, [], Metrics())
    gate = loader.hold("beta")
    token = CALLER.set(Caller("alice", "openai"))
    try:
        first = asyncio.create_task(dispatcher.acquire("beta"))
        second = asyncio.create_task(dispatcher.acquire("beta"))
        await asyncio.sleep(0.05)
    finally:
        CALLER.reset(token)
    entries = dispatcher.flights.list(None)
    assert [(e["model"], e["state"], e["key"]) for e in entries] == [
        ("beta", "queued", "alice")
    ] * 2
    flight = dispatcher.flights.get(entries[0]["id"])
    assert flight is not None and dispatcher.flights.cancel(flight, by="admin")
    with pytest.raises(RequestCancelled):
        await first
    assert len(dispatcher.flights) == 1  # the other still waits; the load goes on
    gate.set()
    lease = await second
    assert lease.slot == "beta" and len(dispatcher.flights) == 0
    lease.release()
    # Loaded: an acquire passes through without leaving anything listed.
    (await dispatcher.acquire("beta")).release()
    assert len(dispatcher.flights) == 0
