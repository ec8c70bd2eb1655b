"""The HTTP application: ``create_app(settings)``; lifespan owns the model registry.

Example::

    app = create_app(Settings.from_env())
    uvicorn.run(app, host="127.0.0.1", port=8080)
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.config import Settings, default_store_path
from sluice.config.file import ConfigFile
from sluice.core.errors import (
    InternalError,
    InvalidRequest,
    NotFound,
    SluiceError,
)
from sluice.dialects import flights, ops, usage
from sluice.dialects.anthropic import format as anthropic_format
from sluice.dialects.anthropic import routes as anthropic
from sluice.dialects.gateway import routes as gateway
from sluice.dialects.gemini import format as gemini_format
from sluice.dialects.gemini import routes as gemini
from sluice.dialects.lmstudio import chat as lmstudio_chat
from sluice.dialects.lmstudio import routes as lmstudio
from sluice.dialects.ollama import format as ollama_format
from sluice.dialects.ollama import routes as ollama
from sluice.dialects.ollama.routes import NOT_SERVED
from sluice.dialects.openai import embeddings as openai_embeddings
from sluice.dialects.openai import media as openai_media
from sluice.dialects.openai import routes as openai
from sluice.dialects.responses import format as responses_format
from sluice.dialects.responses import routes as responses
from sluice.engine.runner import ModelRunner
from sluice.local.model import LocalModel
from sluice.models.flights import CALLER, Caller
from sluice.models.limits import Counters, Limiter, MemoryCounters, StreamLeases
from sluice.models.usage import UsageLedger
from sluice.server.auth import ADMIN, STATE_KEY, USER, ApiKeys, BearerAuth, names_line
from sluice.server.respond import Handler, errors_as
from sluice.server.sse import RawSend, error_response
from sluice.server.state import ServerState, build_state
from sluice.store import open_store
from sluice.web import WebPage

log = logging.getLogger("sluice.api")

# Ollama's paths (beside LM Studio's /api/v1/...): their errors are {"error": "..."}.
OLLAMA_PATHS = (
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/api/ps",
    "/api/embed",
    "/api/embeddings",
    "/api/pull",
    "/api/delete",
    "/api/create",
    "/api/copy",
    "/api/push",
)

# Error shapes by path prefix, for what answers before a route does (the keys, an
# unknown route or method): a client gets errors in the dialect it speaks.
_ERROR_SHAPES: tuple[tuple[str, Callable[[SluiceError], Response]], ...] = (
    ("/v1/messages", anthropic_format.error_response),
    ("/v1/responses", responses_format.error_response),
    (gemini.PREFIX, gemini_format.error_response),
    *((path, ollama_format.error_response) for path in OLLAMA_PATHS),
)


# The dialect of a path, as the requests in flight name it: the first prefix that matches.
_DIALECTS: tuple[tuple[str, str], ...] = (
    ("/v1/messages", "anthropic"),
    ("/v1/responses", "responses"),
    ("/v1beta/", "gemini"),
    ("/c1/", "gateway"),
    ("/api/v1/", "lmstudio"),
    ("/api/", "ollama"),
    ("/v1/", "openai"),
)


def dialect_of(path: str) -> str:
    if gemini.is_v1_method(path):
        return "gemini"
    return next((name for prefix, name in _DIALECTS if path.startswith(prefix)), "sluice")


class _NameCaller:
    """Sets :data:`~sluice.models.flights.CALLER` for the request: its key's name (set by
    ``BearerAuth``, outside), its dialect and its key's limits; what it opens is in flight
    under them."""

    def __init__(self, app: ASGIApp, limiter: Limiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = str(scope.get("state", {}).get(STATE_KEY, ""))
        await _serve_as(
            self.limiter, key, dialect_of(scope["path"]), self.app, scope, receive, send
        )


async def _serve_as(
    limiter: Limiter,
    key: str,
    dialect: str,
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    """``app`` answers the request as ``key``'s in ``dialect`` (:data:`CALLER`). A key with
    limits gets a gate (``models/limits.py``): its rate-limit headers go out with the
    answer, and it is released once the answer has been sent."""
    gate = limiter.gate(key, dialect) if limiter else None
    token = CALLER.set(Caller(key, dialect, gate))
    try:
        if gate is None:
            await app(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start" and gate.headers:
                extra = [(k.encode(), v.encode()) for k, v in gate.headers.items()]
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        await app(scope, receive, send_with_limits)
    finally:
        CALLER.reset(token)
        if gate is not None:
            gate.release()


class _FastLane:
    """OpenAI's chat and text completions, the routes a gateway serves most, straight to
    their handlers: without Starlette's router, its two exception middlewares and its
    request wrapper, which cost a request about as much as the handler itself (measured
    with ``benchmarks/fanout.py``). ``errors_as`` answers their errors as the app's
    handlers would (the OpenAI shape); the caller is named as :class:`_NameCaller`
    does. Any other request goes to the app."""

    def __init__(self, app: Starlette, limiter: Limiter) -> None:
        self.app = app
        self.limiter = limiter
        self.handlers: dict[str, Handler] = {
            "/v1/chat/completions": errors_as(error_response)(openai.chat_completions),
            "/v1/completions": errors_as(error_response)(openai.completions),
        }

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handlers[scope["path"]](Request(scope, receive, send))
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.handlers.get(scope["path"])
            if handler is not None:
                scope["app"] = self.app  # request.app: the state
                key = str(scope.get("state", {}).get(STATE_KEY, ""))
                await _serve_as(self.limiter, key, "openai", self._answer, scope, receive, send)
                return
        await self.app(scope, receive, send)


def render_error_for(path: str) -> Callable[[SluiceError], Response]:
    """The error renderer of the dialect served at ``path`` (OpenAI's by default)."""
    if gemini.is_v1_method(path):
        return gemini_format.error_response
    for prefix, render in _ERROR_SHAPES:
        if path == prefix or path.startswith(prefix + "/"):
            return render
    return error_response


# Model management: only an admin key may (server.auth.BearerAuth refuses the rest
# before anything else is read). Chat that loads a model just in time is normal use.
_MANAGEMENT = {
    ("POST", "/api/v1/models/load"): "Loading a model",
    ("POST", "/api/v1/models/unload"): "Unloading a model",
    ("POST", "/api/v1/models/download"): "Downloading a model",
    ("POST", "/api/pull"): "Pulling a model",
    ("DELETE", "/api/delete"): "Deleting a model",
    **{("POST", f"/api/{verb}"): "Managing models" for verb in NOT_SERVED},
}
_DOWNLOAD_STATUS = "/api/v1/models/download/status/"


def management(method: str, path: str) -> str | None:
    """What ``method path`` does if it manages models (only an admin key may), else None."""
    what = _MANAGEMENT.get((method, path))
    if what is None and method == "GET" and path.startswith(_DOWNLOAD_STATUS):
        return "A download's status"
    return what


# What a background response left generating by a stopped server reads as, once restarted.
UNFINISHED = {
    "code": "server_error",
    "message": "The server stopped while this response was generating; it was not finished. "
    "Create it again.",
}


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ledger(state: ServerState, limiter: Limiter) -> UsageLedger:
    """The usage ledger on the state's store, fed by every request's meter; the limits
    charged from it, and counted by the store when several instances share it."""
    store = state.store
    if getattr(store, "shared", False):
        limiter.counters = cast(Counters, store)
        limiter.leases = cast(StreamLeases, store)
        limiter.shared = True
    ledger = UsageLedger(store, limiter)
    limiter.spent = ledger.spent
    metrics = state.metrics
    metrics.caller = lambda: CALLER.get().key
    metrics.on_end = ledger.record
    return ledger


def create_app(
    settings: Settings,
    runner_factory: Callable[[Settings], ModelRunner] | None = None,
    *,
    startup_progress: Callable[[str, float], None] | None = None,
) -> Starlette:
    """The ASGI app. ``runner_factory`` lets tests put a scripted runner in the real engine;
    ``startup_progress(model, fraction)`` hears the default model's load (on the loop)."""

    # The config file is read once, here; each package is handed its table.
    config = ConfigFile.read(settings.config) if settings.config else None
    keys = ApiKeys.from_settings(settings, config=config)
    # Limits per key: counted in memory until the store says it shares its counters.
    limiter = Limiter(keys.limits, MemoryCounters())
    page = WebPage.load()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state = build_state(settings, runner_factory, config, auth_required=bool(keys))
        registry = state.registry
        try:
            # The default model loads before the server takes requests, as it always did,
            # and stays loaded (no idle TTL) unless it is unloaded on request.
            default = registry.resolve(None)
            report = startup_progress
            progress = (lambda f: report(default.name, f)) if report is not None else None
            await registry.load(default.name, progress=progress, ttl=0)
            await registry.start()
            await state.dispatcher.start()  # a first health check finds upstreams' models
            state._store = await open_store(settings.store or default_store_path())
            state.usage = _ledger(state, limiter)
            await state.usage.start()
            ended = await state._store.end_unfinished_responses(UNFINISHED)
            if ended:
                log.warning(
                    "%d background response(s) left unfinished by a stopped server are now failed",
                    ended,
                )
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
        # What startup made (modules, templates, schemas, the model's objects: over a
        # hundred thousand) lives as long as the server: frozen out of the collector's
        # full passes, each of which walked them all (~90 ms, in the middle of a burst
        # of requests: the gateway's fan-out benchmark saw them as a third of its time).
        gc.collect()
        gc.freeze()
        # And what a burst of streams makes (frames, generators, ASGI messages: mostly
        # freed by reference counting) must not trigger the older generations' passes
        # in its middle: young passes every 50,000 net allocations instead of 700, a full
        # one a hundred times rarer. Measured on the fan-out benchmark at 512 streams:
        # first frame p99 222 ms against 234 ms at the default (201 ms with no collector).
        gc.set_threshold(50_000, 20, 100)
        try:
            yield
        finally:
            await state.downloads.close()  # a running download keeps its .part to resume
            await state.runs.close()  # background responses end (stored as cancelled)
            await state.dispatcher.close()
            await state.mcp.close()  # plugin servers stop (stdio children end)
            if state.usage is not None:
                await state.usage.close()  # after the streams: every request counted
            await limiter.settle()  # the ended streams' leases dropped
            await state.store.close()  # after the streams: their turns are recorded first
            await registry.close()
            state.offload.close()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        render = render_error_for(request.url.path)
        if exc.status_code == 404:
            return render(NotFound(f"No route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            err = InvalidRequest(f"Method {request.method} is not allowed on {request.url.path}")
            resp = render(err)
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
        return render_error_for(request.url.path)(exc)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not the client's fault: still the OpenAI error shape, never a
        # text/plain page. (Starlette logs the traceback after this answers.)
        error = InternalError(f"Internal error: {type(exc).__name__}")
        return render_error_for(request.url.path)(error)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
            Route("/v1/completions", openai.completions, methods=["POST"]),
            Route("/v1/messages", anthropic.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            Route("/v1/responses", responses.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
            Route(
                "/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]
            ),
            Route(f"{gemini.PREFIX}/models", gemini.list_models, methods=["GET"]),
            Route(f"{gemini.PREFIX}/models/{{rest:path}}", gemini.model_method, methods=["POST"]),
            Route(f"{gemini.PREFIX}/models/{{model:path}}", gemini.get_model, methods=["GET"]),
            # Gemini's methods under /v1 too (its model list is /v1beta's: GET /v1/models
            # is OpenAI's).
            Route("/v1/models/{rest:path}", gemini.model_method, methods=["POST"]),
            Route("/v1/models", openai.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", openai.get_model, methods=["GET"]),
            Route("/c1/chat", gateway.chat, methods=["POST"]),
            Route("/c1/conversations", gateway.list_conversations, methods=["GET"]),
            Route(
                "/c1/conversations/{conversation_id}",
                gateway.get_conversation,
                methods=["GET"],
            ),
            Route(
                "/c1/conversations/{conversation_id}",
                gateway.delete_conversation,
                methods=["DELETE"],
            ),
            Route(
                "/c1/conversations/{conversation_id}",
                gateway.update_conversation,
                methods=["PATCH"],
            ),
            Route("/v1/info", ops.catalog, methods=["GET"]),
            Route("/v1/requests", flights.list_requests, methods=["GET"]),
            Route("/v1/usage", usage.usage, methods=["GET"]),
            Route("/v1/requests/{request_id}/cancel", flights.cancel_request, methods=["POST"]),
            Route("/metrics", ops.metrics, methods=["GET"]),
            Route("/health", ops.health, methods=["GET"]),
            Route("/api/v1/chat", lmstudio_chat.chat, methods=["POST"]),
            Route("/api/chat", ollama.chat, methods=["POST"]),
            Route("/api/generate", ollama.generate, methods=["POST"]),
            Route("/api/tags", ollama.tags, methods=["GET"]),
            Route("/api/show", ollama.show, methods=["POST"]),
            Route("/api/version", ollama.version, methods=["GET"]),
            Route("/api/ps", ollama.ps, methods=["GET"]),
            Route("/api/embed", ollama.embed, methods=["POST"]),
            Route("/api/pull", ollama.pull, methods=["POST"]),
            Route("/api/delete", ollama.delete, methods=["DELETE"]),
            *(Route(f"/api/{verb}", ollama.not_served, methods=["POST"]) for verb in NOT_SERVED),
            Route("/api/embeddings", ollama.embeddings_legacy, methods=["POST"]),
            Route("/v1/embeddings", openai_embeddings.embeddings, methods=["POST"]),
            *(
                Route(f"/v1{path}", openai_media.media, methods=["POST"])
                for path in openai_media.WHAT
            ),
            *lmstudio.ROUTES,
            *page.routes,  # the chat page: / and /ui/...
        ],
        lifespan=lifespan,
        middleware=[Middleware(_NameCaller, limiter=limiter)],
        exception_handlers={
            HTTPException: on_http_error,
            SluiceError: on_sluice_error,
            Exception: on_unexpected,
        },
    )
    log.info(names_line(keys.names))
    admins = [n for n in keys.names if keys.role(n) == ADMIN]
    if keys:
        log.info("admin keys (may manage models): %s", ", ".join(admins) or "none")
    open_admin = is_loopback(settings.host) or settings.allow_unauthenticated_admin
    fast = _FastLane(app, limiter)
    if not keys and open_admin:
        return RawSend(fast)  # type: ignore[return-value]
    if not keys:
        log.warning(
            "no API keys on %s: model management (load, unload, download, delete) is "
            "refused; give keys, or --allow-unauthenticated-admin",
            settings.host,
        )
    # The page's files hold nothing secret: it loads, then asks for a key.
    public = {"/health", *page.paths}
    return RawSend(  # type: ignore[return-value]
        BearerAuth(
            fast,
            keys,
            render_error_for,
            public=public,
            admin_only=management,
            open_role=ADMIN if open_admin else USER,
        )
    )
