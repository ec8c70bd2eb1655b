"""The HTTP application: ``create_app(settings)``; lifespan owns the engine.

Example::

    app = create_app(Settings.from_env())
    uvicorn.run(app, host="127.0.0.1", port=8080)
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.api import routes
from sluice.api.sse import error_response
from sluice.catalog import resolve_model
from sluice.config import Settings
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.runner import ModelRunner
from sluice.errors import (
    AuthenticationFailed,
    InternalError,
    InvalidRequest,
    NotFound,
    SluiceError,
)
from sluice.protocol.body import BodyLimits
from sluice.serving.completions import CompletionService, ServiceOptions
from sluice.serving.offload import Offload
from sluice.serving.templates import ChatTemplate
from sluice.serving.tools import ToolLimits

log = logging.getLogger("sluice.api")


@dataclass(slots=True)
class ServerState:
    settings: Settings
    engine: Engine
    service: CompletionService
    offload: Offload  # worker threads for parsing, templates, tokenization, grammars
    limits: BodyLimits
    draining: bool = False  # after SIGTERM: running requests finish, new ones get 503


def load_runner(settings: Settings) -> ModelRunner:
    """The real llama.cpp runner for ``settings.model``."""
    from sluice.engine.llama_runner import LlamaRunner, LlamaRunnerConfig

    resolved = resolve_model(settings.model)
    template = None
    if settings.chat_template:
        template = Path(settings.chat_template).read_text(encoding="utf-8")
    return LlamaRunner.load(
        LlamaRunnerConfig(
            model_path=str(resolved.path),
            model_id=resolved.id,
            n_parallel=settings.parallel,
            n_ctx=settings.ctx,
            n_batch=settings.batch,
            n_threads=settings.threads,
            chat_template=template,
        )
    )


def build_state(settings: Settings, runner: ModelRunner) -> ServerState:
    engine = Engine(
        runner,
        EngineConfig(
            n_parallel=settings.parallel,
            max_queue=settings.queue,
            stream_buffer=settings.stream_buffer,
        ),
    )
    info = runner.info
    template = ChatTemplate(
        info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token, model_id=info.id
    )
    service = CompletionService(
        engine,
        template,
        ServiceOptions(
            strict_model_names=settings.strict_model_names,
            default_max_tokens=settings.default_max_tokens,
            tool_format=settings.tool_format,
            prompt_special_tokens=settings.prompt_special_tokens,
            tool_limits=ToolLimits(
                max_tools=settings.max_tools,
                max_schema_bytes=settings.max_schema_bytes,
                max_grammar_repeat=settings.max_grammar_repeat,
                max_grammar_alternatives=settings.max_grammar_alternatives,
            ),
        ),
    )
    limits = BodyLimits(
        max_json_depth=settings.max_json_depth,
        max_number_digits=settings.max_number_digits,
        max_messages=settings.max_messages,
        max_stop=settings.max_stop,
        max_stop_length=settings.max_stop_length,
        max_logit_bias=settings.max_logit_bias,
    )
    return ServerState(settings, engine, service, Offload(settings.prepare_workers), limits)


def create_app(
    settings: Settings, runner_factory: Callable[[Settings], ModelRunner] = load_runner
) -> Starlette:
    """The ASGI app. ``runner_factory`` lets tests put a scripted runner in the real engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runner = runner_factory(settings)
        state = build_state(settings, runner)
        state.engine.start()
        app.state.sluice = state
        log.info(
            "serving %s (ctx %d per sequence, %d slots)",
            runner.info.id,
            runner.n_ctx_seq,
            state.engine.stats.slots,
        )
        try:
            yield
        finally:
            state.engine.stop()
            state.offload.close()
            runner.close()

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
            Route("/health", routes.health, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={
            HTTPException: on_http_error,
            SluiceError: on_sluice_error,
            Exception: on_unexpected,
        },
    )
    if settings.api_key:
        return BearerAuth(app, settings.api_key)  # type: ignore[return-value]
    return app


class BearerAuth:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*``; ``/health`` stays open."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.key):
                resp = error_response(
                    AuthenticationFailed("Missing or invalid API key (Authorization: Bearer ...).")
                )
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
