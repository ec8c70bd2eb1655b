"""The HTTP application: ``create_app(settings)``; lifespan owns the model registry.

Example::

    app = create_app(Settings.from_env())
    uvicorn.run(app, host="127.0.0.1", port=8080)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sluice import catalog
from sluice.api import conversations, info, lmstudio, lmstudio_chat, metrics, routes
from sluice.api.keys import ApiKeys, BearerAuth, names_line
from sluice.api.sse import error_response
from sluice.catalog import ModelSpec
from sluice.config import Settings, default_models_dir, default_store_path
from sluice.engine.runner import ModelRunner
from sluice.errors import (
    InternalError,
    InvalidRequest,
    NotFound,
    SluiceError,
)
from sluice.gguf_info import estimate_memory, read_gguf_info
from sluice.protocol.body import BodyLimits
from sluice.router.config import load_upstreams
from sluice.router.pool import UpstreamPool
from sluice.serving.dispatch import Dispatcher
from sluice.serving.downloads import DownloadManager
from sluice.serving.local import LocalModel, ModelSettings
from sluice.serving.mcp import McpManager
from sluice.serving.metrics import Metrics
from sluice.serving.offload import Offload
from sluice.serving.registry import LoadOptions, ModelRegistry, Progress
from sluice.serving.upstream import UpstreamSlot
from sluice.store import ConversationStore, SQLiteStore

log = logging.getLogger("sluice.api")


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
    )


def memory_budget(settings: Settings) -> int:
    """Bytes all loaded models may take: the setting, else 90% of physical memory."""
    if settings.memory_budget_mb > 0:
        return settings.memory_budget_mb * 2**20
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * 0.9)


def build_state(
    settings: Settings, runner_factory: Callable[[Settings], ModelRunner] | None = None
) -> ServerState:
    """The server's state. ``runner_factory`` (tests): one model, ``settings.model``,
    whose runner it makes (e.g. a scripted runner in the real engine)."""
    offload = Offload(settings.prepare_workers)
    if runner_factory is None:
        specs = catalog.discover(settings)
        default = catalog.default_spec(settings, specs).name

        def known() -> list[ModelSpec]:
            return catalog.discover(settings)

        def loader(spec: ModelSpec, options: LoadOptions, progress: Progress) -> LocalModel:
            return LocalModel.load(spec, options, settings, offload, progress)

        def estimate(spec: ModelSpec, options: LoadOptions) -> int:
            from sluice.engine.llama_runner import gpu_offload_supported

            ms = ModelSettings.of(spec, options, settings)
            info = read_gguf_info(catalog.resolve_source(spec))
            return estimate_memory(
                info,
                ctx_per_seq=ms.ctx,
                parallel=ms.parallel,
                batch=ms.batch,
                # Layers on a GPU take no host RAM, but only where llama.cpp can offload.
                gpu_layers=ms.gpu_layers if gpu_offload_supported() else 0,
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
    downloads = DownloadManager(models_dir.expanduser())
    meters = Metrics()
    upstreams = [
        UpstreamSlot(spec, UpstreamPool(spec), meters.slot(spec.name, "upstream"))
        for spec in (load_upstreams(settings.config) if settings.config else [])
    ]
    dispatcher = Dispatcher(registry, upstreams, meters)
    return ServerState(
        settings,
        registry,
        offload,
        body_limits(settings),
        downloads,
        dispatcher,
        meters,
        McpManager(settings),
        bool(ApiKeys.from_settings(settings)),
    )


def create_app(
    settings: Settings, runner_factory: Callable[[Settings], ModelRunner] | None = None
) -> Starlette:
    """The ASGI app. ``runner_factory`` lets tests put a scripted runner in the real engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state = build_state(settings, runner_factory)
        registry = state.registry
        try:
            # The default model loads before the server takes requests, as it always did,
            # and stays loaded (no idle TTL) unless it is unloaded on request.
            default = registry.resolve(None)
            await registry.load(default.name, ttl=0)
            await registry.start()
            await state.dispatcher.start()  # a first health check finds upstreams' models
            state._store = await SQLiteStore.open(settings.store or default_store_path())
        except BaseException:
            if state._store is not None:
                await state._store.close()
            await state.dispatcher.close()
            await state.mcp.close()
            await registry.close()
            await state.downloads.close()
            state.offload.close()
            raise
        app.state.sluice = state
        model = registry.get_loaded(default.name)
        if isinstance(model, LocalModel):
            log.info(
                "serving %s (ctx %d per sequence, %d slots); %d models known",
                default.name,
                model.runner.n_ctx_seq,
                model.stats.slots,
                len(registry.known()),
            )
        try:
            yield
        finally:
            await state.downloads.close()  # a running download keeps its .part to resume
            await state.dispatcher.close()
            await state.mcp.close()  # plugin servers stop (stdio children end)
            await state.store.close()  # after the streams: their turns are recorded first
            await registry.close()
            state.offload.close()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error_response(NotFound(f"No route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            err = InvalidRequest(f"Method {request.method} is not allowed on {request.url.path}")
            resp = error_response(err)
            resp.status_code = 405
            return resp
        return JSONResponse(
            {
                "error": {
                    "message": str(exc.detail),
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            },
            exc.status_code,
        )

    async def on_sluice_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SluiceError)
        return error_response(exc)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not the client's fault: still the OpenAI error shape, never a
        # text/plain page. (Starlette logs the traceback after this answers.)
        return error_response(InternalError(f"Internal error: {type(exc).__name__}"))

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"]),
            Route("/c1/chat", conversations.chat, methods=["POST"]),
            Route("/c1/conversations", conversations.list_conversations, methods=["GET"]),
            Route(
                "/c1/conversations/{conversation_id}",
                conversations.get_conversation,
                methods=["GET"],
            ),
            Route(
                "/c1/conversations/{conversation_id}",
                conversations.delete_conversation,
                methods=["DELETE"],
            ),
            Route("/v1/info", info.catalog, methods=["GET"]),
            Route("/metrics", metrics.metrics, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/api/v1/chat", lmstudio_chat.chat, methods=["POST"]),
            *lmstudio.ROUTES,
        ],
        lifespan=lifespan,
        exception_handlers={
            HTTPException: on_http_error,
            SluiceError: on_sluice_error,
            Exception: on_unexpected,
        },
    )
    keys = ApiKeys.from_settings(settings)
    log.info(names_line(keys.names))
    if keys:
        return BearerAuth(app, keys)  # type: ignore[return-value]
    return app
