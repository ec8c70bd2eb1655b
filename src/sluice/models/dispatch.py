"""The dispatcher: a model name or alias -> the slot that serves it.

A slot is a local model (the registry loads it just in time) or an upstream
server (``upstream/backend.py``). Local names win over an upstream's: they are known
up front, where an upstream's are partly discovered from its ``/v1/models``
(an upstream model shadowed so stays reachable through its aliases). A name
nobody serves goes to the default local model unless names are strict.

Every lease opens metered streams: the slot's live figures are taken on the
streaming path, local and upstream alike, and each stream is a request in
flight (``flights.py``) until it ends.

Example::

    dispatcher = Dispatcher(registry, [slot], metrics)
    await dispatcher.start()
    lease = await dispatcher.acquire("qwen")
    try:
        stream = await lease.open(request)     # metered; stream.meta names the slot
        ...
    finally:
        lease.release()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from sluice.core.backend import Backend, Embeddings, LoadOptions, Progress, ResponseStream
from sluice.core.errors import ModelNotFound, SluiceError, spec_for
from sluice.core.model import ModelSpec
from sluice.core.request import GenerationRequest
from sluice.metrics import Metrics, OpenAIChunkTap, RequestMeter, metered
from sluice.models.flights import CALLER, Flights, Waiting
from sluice.models.images import ImageFetcher
from sluice.models.limits import Gate
from sluice.models.registry import ModelRegistry
from sluice.upstream.affinity import affinity_key
from sluice.upstream.backend import Passthrough, UpstreamModel, UpstreamSlot
from sluice.upstream.resume import Resumable

log = logging.getLogger("sluice.router")


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    slot: UpstreamSlot
    model: str  # the upstream's name for it

    def backend(self) -> UpstreamModel:
        return self.slot.model(self.model)


class _Releasable(Protocol):
    def release(self) -> None: ...


class SlotLease:
    """A request's hold on a slot; :meth:`open` starts a metered response."""

    def __init__(
        self,
        backend: Backend,
        slot: str,
        metrics: Metrics,
        kind: Literal["local", "upstream"],
        release: _Releasable | None = None,
        *,
        flights: Flights | None = None,
        loaded_now: bool = False,
        load_seconds: float | None = None,
        images: ImageFetcher | None = None,
    ) -> None:
        self.backend = backend
        self._images = images
        self._flights = flights
        self.slot = slot
        self._metrics = metrics
        self._kind = kind
        self._release = release
        self.loaded_now = loaded_now
        self.load_seconds = load_seconds

    async def open(self, request: GenerationRequest) -> ResponseStream:
        if self._fetches_images:  # a local model that sees: its image URLs fetched first
            request = await self._images.resolve(request)  # type: ignore[union-attr]
        with self._meter() as meter:
            stream = await self.backend.open(request)
        live = metered(stream, meter)
        if self._flights is not None:
            self._flights.track(live, self.slot)
        return live

    @property
    def _fetches_images(self) -> bool:
        """Image URLs are fetched for a local model with a projector only: one without
        says so (a 400) and nothing is fetched for it."""
        return self._images is not None and bool(getattr(self.backend, "sees_images", False))

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The backend's count of ``request``'s prompt (its image URLs fetched first)."""
        if self._fetches_images:
            request = await self._images.resolve(request)  # type: ignore[union-attr]
        return await self.backend.count_prompt_tokens(request)

    async def embed(
        self, inputs: list[str] | list[list[int]], *, truncate: bool, dimensions: int | None
    ) -> Embeddings:
        """The backend's embeddings, metered like a generation (no tokens out)."""
        with self._meter() as meter:
            result = await self.backend.embed(inputs, truncate=truncate, dimensions=dimensions)
        meter.finish(prompt_tokens=result.prompt_tokens, completion_tokens=0)
        return result

    @contextlib.contextmanager
    def _meter(self) -> Iterator[RequestMeter]:
        """A request meter for this slot, finished as failed if the body raises."""
        meter = self._metrics.slot(self.slot, self._kind).request()
        if isinstance(self.backend, UpstreamModel):
            meter.model = self.backend.name  # usage is by the upstream's name for the model
        try:
            yield meter
        except SluiceError as exc:
            # A refused request (4xx) is the client's; a failing slot (5xx) is the slot's.
            meter.finish(error=spec_for(exc).status >= 500)
            raise
        except BaseException:
            meter.finish(error=True)
            raise

    async def close(self, stream: ResponseStream) -> None:
        """Close ``stream`` (aborting what still runs) and release the slot."""
        try:
            await stream.aclose()
        finally:
            self.release()

    def release(self) -> None:
        if self._release is not None:
            self._release.release()
            self._release = None


class Dispatcher:
    """Resolves names to slots: local models through the registry, upstream models."""

    def __init__(
        self,
        registry: ModelRegistry,
        upstreams: Sequence[UpstreamSlot],
        metrics: Metrics,
        images: ImageFetcher | None = None,
    ) -> None:
        self.registry = registry
        self.upstreams = list(upstreams)
        self.metrics = metrics
        self.images = images  # fetches image URLs for local models
        self.flights = Flights(metrics.clock)
        for slot in self.upstreams:
            metrics.slot(slot.name, "upstream")

    async def start(self) -> None:
        for slot in self.upstreams:
            await slot.start()
        self._warn_shadowed()

    async def close(self) -> None:
        for slot in self.upstreams:
            await slot.close()

    def known(self) -> list[ModelSpec]:
        """Every local model the caller may use (``registry.known``, re-read), for the
        model lists: a key limited to some models sees only those."""
        gate = CALLER.get().gate
        specs = self.registry.known()
        if gate is None or gate.limits.models is None:
            return specs
        return [spec for spec in specs if self._may_use(gate, spec.name)]

    def upstream_models(self) -> list[tuple[str, UpstreamSlot, str]]:
        """(public id, slot, upstream name) for every upstream model the caller can reach.

        A model shadowed by a local model of the same name is listed under its first
        alias, or not at all when it has none. A key limited to some models sees those.
        """
        gate = CALLER.get().gate
        listed = None if gate is None else gate.limits.models
        return [
            (public, slot, model)
            for public, slot, model in self._upstream_models()
            if listed is None or any(slot.lookup(name) == model for name in listed)
        ]

    def _upstream_models(self) -> list[tuple[str, UpstreamSlot, str]]:
        out: list[tuple[str, UpstreamSlot, str]] = []
        for slot in self.upstreams:
            models = slot.models()
            for model in models:
                public: str | None = model
                if self.registry.find(model) is not None:
                    aliases = slot.aliases_of(model)
                    public = aliases[0] if aliases else None
                if public is not None:
                    out.append((public, slot, model))
            # An alias of a name the upstream does not list (one of its own aliases, say)
            # still answers: listed under the alias.
            listed = {m.lower() for m in models}
            for alias, target in slot.spec.aliases.items():
                if target.lower() not in listed:
                    out.append((alias, slot, target))
        return out

    def _warn_shadowed(self) -> None:
        for slot in self.upstreams:
            for model in slot.models():
                if self.registry.find(model) is not None:
                    log.warning(
                        "upstream '%s' serves '%s', which is also a local model's name: "
                        "the local model answers to it (give the upstream one an alias)",
                        slot.name,
                        model,
                    )

    def upstream(self, name: str | None) -> UpstreamTarget | None:
        """The upstream target for ``name``, or None when a local model answers it.

        Called from the parsing worker threads too: it only reads tables that are
        replaced whole, never changed in place (the registry's name index, the
        replicas' model tuples, the config's aliases).
        """
        if name is None or not self.upstreams or self.registry.find(name) is not None:
            return None
        for slot in self.upstreams:
            model = slot.lookup(name)
            if model is not None:
                return UpstreamTarget(slot, model)
        return None

    async def passthrough(
        self,
        target: UpstreamTarget,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        tap: type[OpenAIChunkTap] = OpenAIChunkTap,
        prefix: str = "/v1",
        conversation: Mapping[str, Any] | None = None,
        session: Mapping[str, str] | None = None,
        key_ids: bool = False,
        resume: bool = False,
        resumable: Callable[[], Resumable] | None = None,
    ) -> Passthrough:
        """``target``'s answer to a body in its own dialect, forwarded unchanged (see
        ``UpstreamModel.passthrough``), in flight until it ends.

        Cache affinity among the slot's replicas: ``conversation`` is the parsed body
        and ``session`` the request's headers, which name the conversation
        (``upstream.affinity.affinity_key``); with ``key_ids`` (Responses) the answer's
        id names it too, and a ``previous_response_id`` goes where that id was answered.
        ``resume``: ``conversation`` is an OpenAI chat or completions stream, or an
        Anthropic Messages one, whose answer another replica may continue if this one
        drops it (mid-stream failover); ``resumable``: the partial of another dialect's
        stream that continues it so (``upstream.resume.ChatContinued``).
        """
        await self.admit(target)
        slot = target.slot.name
        key: str | None = None
        if conversation is not None and target.slot.pool.keyed:
            previous = conversation.get("previous_response_id") if key_ids else None
            if isinstance(previous, str) and previous:
                key = "r:" + previous
            else:
                key = affinity_key(conversation, session)
        return await target.backend().passthrough(
            path,
            body,
            headers,
            tap=tap,
            on_start=lambda a: self.flights.track(a, slot),
            prefix=prefix,
            key=key,
            key_ids=key_ids,
            resume=conversation if resume or resumable else None,
            resumable=resumable,
        )

    async def admit(self, target: UpstreamTarget) -> None:
        """The caller's key may use ``target`` now (``models/limits.py``): else the
        dialect's unknown-model answer, or a 429. Free for a key without limits."""
        gate = CALLER.get().gate
        if gate is None:
            return
        slot = target.slot
        if gate.limits.models is not None and not any(
            slot.lookup(name) == target.model for name in gate.limits.models
        ):
            raise ModelNotFound(target.model)
        await gate.admit()

    def _may_use(self, gate: Gate, model: str) -> bool:
        """Whether a name in ``gate``'s list names the local model ``model``."""
        listed = gate.limits.models
        if listed is None:
            return True
        found = (self.registry.find(name) for name in listed)
        return any(spec is not None and spec.name == model for spec in found)

    def native(self, name: object, api: str) -> UpstreamTarget | None:
        """The upstream target for ``name`` when its slot speaks ``api`` itself
        (``native_apis``): a request in that dialect then passes through unchanged."""
        target = self.upstream(name) if isinstance(name, str) else None
        if target is None or api not in target.slot.spec.native_apis:
            return None
        return target

    async def open(
        self,
        request: GenerationRequest,
        *,
        ttl: float | None = None,
        progress: Progress | None = None,
    ) -> tuple[SlotLease, ResponseStream]:
        """Acquire the slot serving ``request.model`` and open a metered stream on it.

        Every error knowable before the first byte is raised here, the lease
        already released; otherwise the caller releases it after closing the stream.
        """
        lease = await self.acquire(request.model, ttl=ttl, progress=progress)
        try:
            return lease, await lease.open(request)
        except BaseException:
            lease.release()
            raise

    async def acquire(
        self,
        name: str | None,
        *,
        ttl: float | None = None,
        progress: Progress | None = None,
        options: LoadOptions | None = None,
    ) -> SlotLease:
        """A lease on the slot serving ``name``; a local model loads first if needed
        (with ``options``, or reloads with them when idle: see ``ModelRegistry.acquire``)."""
        target = self.upstream(name)
        if target is not None:
            await self.admit(target)
            return SlotLease(
                target.backend(),
                target.slot.name,
                self.metrics,
                "upstream",
                flights=self.flights,
            )
        # In flight (queued) while the model loads: listed, and cancellable.
        spec = self.registry.resolve(name)
        gate = CALLER.get().gate
        if gate is not None:  # before the model loads: a refused request loads nothing
            if not self._may_use(gate, spec.name):
                raise ModelNotFound(name or spec.name)
            await gate.admit()
        waiting = Waiting(spec.name, self.metrics.clock)
        self.flights.track(waiting, spec.name)
        try:
            lease = await waiting.wait(
                lambda: self.registry.acquire(name, ttl=ttl, progress=progress, options=options)
            )
        finally:
            waiting.end()
        return SlotLease(
            lease.model,
            lease.spec.name,
            self.metrics,
            "local",
            lease,
            flights=self.flights,
            loaded_now=lease.loaded_now,
            load_seconds=lease.load_seconds,
            images=self.images,
        )
