"""The server's state: everything a route needs, built once per app by the lifespan.

Routes reach it through :func:`server_state`, the one typed accessor; no route
module imports the app.

Example::

    state = server_state(raw_request)
    stream = await state.dispatcher.open(request)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starlette.requests import Request

from sluice.config import Settings, default_models_dir
from sluice.config.file import ConfigFile
from sluice.core.backend import LoadOptions, Progress
from sluice.core.model import ModelSpec
from sluice.engine.runner import ModelRunner
from sluice.local.budget import ReasoningBudgets
from sluice.local.model import LocalModel, ModelSettings
from sluice.local.offload import Offload
from sluice.metrics import Metrics
from sluice.models import catalog
from sluice.models.dispatch import Dispatcher
from sluice.models.downloads import DownloadManager
from sluice.models.gguf import estimate_memory, read_gguf_info
from sluice.models.images import ImageFetcher
from sluice.models.registry import ModelRegistry
from sluice.models.usage import UsageLedger
from sluice.server.body import read_request_body
from sluice.server.jsonbody import BodyLimits, parse_json_body
from sluice.server.runs import Runs
from sluice.store import ConversationStore
from sluice.tools.mcp import McpManager
from sluice.upstream.backend import UpstreamSlot
from sluice.upstream.config import upstreams_of
from sluice.upstream.pool import UpstreamPool


@dataclass(slots=True)
class ServerState:
    settings: Settings
    registry: ModelRegistry  # every model the server knows; loads them just in time
    offload: Offload  # worker threads for parsing, templates, tokenization, grammars
    limits: BodyLimits
    downloads: DownloadManager  # GGUF downloads into the models folder
    dispatcher: Dispatcher  # model names -> slots: local models and upstream servers
    metrics: Metrics  # live per-slot figures (/metrics, /v1/info)
    mcp: McpManager  # MCP servers for server-side tools (LM Studio's integrations)
    auth_required: bool  # API keys are configured (MCP plugins need it, as in LM Studio)
    # conversations and stored responses; opened by the lifespan, before any request
    _store: ConversationStore | None = None
    draining: bool = False
    # Responses generating beyond their request (background, resumable streams)
    runs: Runs = field(default_factory=Runs)
    # requests and tokens per key, model and day (GET /v1/usage); opened with the store
    usage: UsageLedger | None = None

    @property
    def store(self) -> ConversationStore:
        assert self._store is not None, "the store opens in the lifespan, before any request"
        return self._store  # after SIGTERM: running requests finish, new ones get 503

    def begin_shutdown(self) -> None:
        """End the running requests of every loaded model with ``shutting_down``."""
        for status in self.registry.status():
            model = self.registry.get_loaded(status.name)
            if isinstance(model, LocalModel):
                model.begin_shutdown()


def body_limits(settings: Settings) -> BodyLimits:
    return BodyLimits(
        max_json_depth=settings.max_json_depth,
        max_number_digits=settings.max_number_digits,
        max_messages=settings.max_messages,
        max_stop=settings.max_stop,
        max_stop_length=settings.max_stop_length,
        max_logit_bias=settings.max_logit_bias,
        max_embedding_inputs=settings.max_embedding_inputs,
    )


def memory_budget(settings: Settings) -> int:
    """Bytes all loaded models may take: the setting, else 90% of physical memory."""
    if settings.memory_budget_mb > 0:
        return settings.memory_budget_mb * 2**20
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * 0.9)


def projector_bytes(path: str | None) -> int:
    """What a projector holds: its weights, and the image encoder's compute buffers
    (estimated at a quarter of the weights, at least 32 MiB: llama.cpp sizes them when
    it loads the projector, for the largest image it takes)."""
    if path is None:
        return 0
    try:
        size = os.stat(path).st_size
    except OSError:
        return 0  # the load says what is wrong with it
    return size + max(32 * 2**20, size // 4)


def build_state(
    settings: Settings,
    runner_factory: Callable[[Settings], ModelRunner] | None = None,
    config: ConfigFile | None = None,
    auth_required: bool = False,
) -> ServerState:
    """The server's state. ``runner_factory`` (tests): one model, ``settings.model``,
    whose runner it makes (e.g. a scripted runner in the real engine). ``config``: the
    config file, read once by the app; each package gets its table."""
    offload = Offload(settings.prepare_workers)
    if runner_factory is None:
        specs = catalog.discover(settings, config)
        default = catalog.default_spec(settings, specs).name

        def known() -> list[ModelSpec]:
            return catalog.discover(settings, config)

        def loader(spec: ModelSpec, options: LoadOptions, progress: Progress) -> LocalModel:
            return LocalModel.load(
                with_projector(catalog.resolved(spec)), options, settings, offload, progress
            )

        def with_projector(spec: ModelSpec) -> ModelSpec:
            """``spec`` with its projector found (``--mmproj`` is the default model's)."""
            return replace(spec, mmproj=catalog.projector_of(spec, settings))

        def estimate(spec: ModelSpec, options: LoadOptions) -> int:
            from sluice.engine.llama_runner import gpu_offload_supported

            if spec.replay is not None:
                return 0  # recorded answers: no weights, no KV cache
            ms = ModelSettings.of(spec, options, settings)
            info = read_gguf_info(catalog.resolve_source(spec))
            return projector_bytes(catalog.projector_of(spec, settings)) + estimate_memory(
                info,
                ctx_per_seq=ms.ctx,
                parallel=ms.parallel,
                batch=ms.batch,
                # Layers on a GPU take no host RAM, but only where llama.cpp can offload.
                gpu_layers=ms.gpu_layers if gpu_offload_supported() else 0,
                flash_attn=ms.flash_attn,
            )

    else:
        factory = runner_factory
        only = ModelSpec(name=settings.model, source=settings.model)
        default = only.name

        def known() -> list[ModelSpec]:
            return [only]

        def loader(spec: ModelSpec, options: LoadOptions, progress: Progress) -> LocalModel:
            return LocalModel(spec.name, factory(settings), settings, offload)

        def estimate(spec: ModelSpec, options: LoadOptions) -> int:
            return 0

    ReasoningBudgets.from_settings(settings)  # a bad --reasoning-efforts: refused now
    registry = ModelRegistry(
        known,
        default=default,
        loader=loader,
        estimator=estimate,
        max_loaded=settings.max_loaded_models,
        ttl=settings.model_ttl,
        budget_bytes=memory_budget(settings),
        strict_names=settings.strict_model_names,
    )
    models_dir = Path(settings.models_dir) if settings.models_dir else default_models_dir()
    downloads = DownloadManager(
        models_dir.expanduser(),
        allow_private=settings.download_allow_private,
        allowed_hosts=settings.download_allowed_hosts,
    )
    meters = Metrics()

    def decoding() -> dict[str, tuple[int, int, int]]:
        out = {}
        for status in registry.status():
            model = registry.get_loaded(status.name)
            stats = getattr(model, "stats", None)
            if stats is not None:
                out[status.name] = (
                    stats.drafted_tokens,
                    stats.accepted_tokens,
                    stats.forced_tokens,
                )
        return out

    meters.decoding = decoding
    upstreams = [
        UpstreamSlot(spec, UpstreamPool(spec), meters.slot(spec.name, "upstream"))
        for spec in (upstreams_of(config) if config is not None else [])
    ]
    meters.affinity = lambda: {
        slot.name: (slot.pool.affinity.stats(), slot.pool.affinity.conversations)
        for slot in upstreams
        if slot.pool.keyed
    }
    dispatcher = Dispatcher(registry, upstreams, meters, ImageFetcher(settings))
    return ServerState(
        settings,
        registry,
        offload,
        body_limits(settings),
        downloads,
        dispatcher,
        meters,
        McpManager(settings),
        auth_required,
    )


def server_state(raw_request: Request) -> ServerState:
    """The state of the app serving ``raw_request`` (set by the lifespan)."""
    state: ServerState = raw_request.app.state.sluice
    return state


async def read_json(raw_request: Request) -> dict[str, Any] | None:
    """The request's body as a JSON object: read within ``--max-body-bytes`` and parsed
    on a worker (:class:`InvalidRequest` naming what is wrong); None if the client left
    first."""
    state = server_state(raw_request)
    raw = await read_request_body(
        raw_request, state.settings.max_body_bytes, lambda: state.draining
    )
    if raw is None:
        return None
    return await state.offload.run(lambda: parse_json_body(raw, state.limits))
