"""Command line: ``sluice serve``, ``sluice models``, ``sluice chat``, ``sluice ps`` (wiring only).

Its flags are made from :class:`~sluice.config.Settings`, one per setting.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from typing import Any

from sluice.clients import chat as chat_client
from sluice.clients import models as models_client
from sluice.clients import ps as ps_client
from sluice.config import GROUPS, Settings, env_var, flag_name, kind, shown_default


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sluice serve``: one flag per setting, in the settings' groups."""
    p = sub.add_parser(
        "serve",
        help="serve models over the OpenAI, Anthropic, Ollama, LM Studio and gateway APIs",
        description="Serve local GGUF models (and upstream servers) over OpenAI's "
        "/v1/chat/completions, /v1/completions, /v1/responses and /v1/embeddings, "
        "Anthropic's /v1/messages, Ollama's /api, LM Studio's /api/v1 API and the /c1 "
        "gateway, with a web chat page at /. Every flag can also be set as an environment variable SLUICE_<NAME> "
        "(e.g. SLUICE_PORT=9000); a flag wins over the environment. Reference: "
        "docs/configuration.md.",
    )
    groups = {key: p.add_argument_group(title, blurb) for key, title, blurb in GROUPS}
    for f in fields(Settings):
        help = f"{f.metadata['help']} (default: {shown_default(f)}; {env_var(f)})"
        # argparse formats help with %: a literal one is doubled.
        options: dict[str, Any] = {"dest": f.name, "help": help.replace("%", "%%")}
        match kind(f):
            case "bool":
                options |= {"action": argparse.BooleanOptionalAction, "default": None}
            case "int":
                options |= {"type": int, "metavar": "N"}
            case "float":
                options |= {"type": float, "metavar": "N"}
        if f.metadata["choices"]:
            options["choices"] = f.metadata["choices"]
        groups[f.metadata["group"]].add_argument(flag_name(f), **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="sluice: a streaming-first LLM server for local GGUF models and the "
        "inference servers behind it, over the OpenAI, Anthropic, Ollama, LM Studio and "
        "gateway APIs",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    models_client.add_parser(sub)
    chat_client.add_parser(sub)
    ps_client.add_parser(sub)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Defaults < ``SLUICE_*`` environment < the flags given (``ValueError`` if bad)."""
    known = {f.name for f in fields(Settings)}
    return Settings.from_env(**{k: v for k, v in vars(args).items() if k in known})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "models":
        return models_client.run(args)
    if args.command == "chat":
        return chat_client.run(args)
    if args.command == "ps":
        return ps_client.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


class _LoadBar:
    """``sluice serve`` on a terminal: a progress bar on stderr while the default model
    loads, fed by llama.cpp's load progress; gone once it is loaded."""

    def __init__(self) -> None:
        self._progress: Any = None
        self._task: Any = None

    def __call__(self, model: str, fraction: float) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        if self._progress is None:
            columns = (TextColumn(f"loading {model}"), BarColumn(), TaskProgressColumn())
            self._progress = Progress(*columns, console=Console(stderr=True), transient=True)
            self._task = self._progress.add_task(model, total=1.0)
            self._progress.start()
        self._progress.update(self._task, completed=fraction)
        if fraction >= 1.0:
            self._progress.stop()


# Seconds uvicorn waits past the grace for the error frames that end the
# requests still running to get out, before it cancels what is left.
_FLUSH_SECONDS = 3.0


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import math
    import socket
    import time
    from types import FrameType

    import uvicorn

    from sluice.server.app import create_app
    from sluice.server.auth import QueryKeyRedactor
    from sluice.server.state import ServerState

    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    grace = settings.shutdown_grace
    if not (math.isfinite(grace) and grace >= 0):
        print(f"sluice: --shutdown-grace must be a number >= 0, not {grace}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    bar = _LoadBar() if sys.stderr.isatty() else None
    try:
        app = create_app(settings, startup_progress=bar)
    except ValueError as exc:  # a bad API key (ConfigError): say so, no traceback
        print(f"sluice: {exc}", file=sys.stderr)
        return 2

    def state() -> ServerState | None:
        return getattr(app.state, "sluice", None)

    class Server(uvicorn.Server):
        """uvicorn's server with sluice's graceful shutdown.

        1st SIGTERM or SIGINT: new requests get 503 ``shutting_down`` (and
        within 0.1 s uvicorn closes its listening socket and idle connections);
        the running ones get ``grace`` seconds to finish, then the engine ends
        the rest with an ``event: error`` frame. uvicorn waits ``grace`` +
        ``_FLUSH_SECONDS`` at most for the connections to close, then cancels
        what is left. 2nd signal: the error frames now, and at most
        ``_FLUSH_SECONDS`` more. 3rd: stop waiting at once.
        """

        signals = 0
        signalled_at: float | None = None
        hurried_at: float | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Runs in the signal handler: flags and a SimpleQueue put only.
            self.signals += 1
            current = state()
            if self.signals == 1:
                self.signalled_at = time.monotonic()
                if current is not None:
                    current.draining = True
            else:
                self.hurried_at = time.monotonic()
            if current is not None and (grace == 0 or self.signals > 1):
                current.begin_shutdown()
            super().handle_exit(sig, frame)  # records the signal, to re-raise it at exit
            if self.signals == 2:
                # uvicorn forces the exit on a second SIGINT, cutting the streams
                # before their error frames are out: end_requests() bounds the wait.
                self.force_exit = False
            elif self.signals > 2:
                self.force_exit = True

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            current = state()
            if current is None:  # stopped before the model was loaded
                await super().shutdown(sockets)
                return
            current.draining = True  # also when the exit did not come from a signal
            start = self.signalled_at if self.signalled_at is not None else time.monotonic()

            async def end_requests() -> None:
                while time.monotonic() < start + grace and self.hurried_at is None:
                    await asyncio.sleep(0.05)
                current.begin_shutdown()
                if self.hurried_at is not None:
                    await asyncio.sleep(self.hurried_at + _FLUSH_SECONDS - time.monotonic())
                    self.force_exit = True  # stop waiting for connections that did not close

            ender = asyncio.create_task(end_requests())
            try:
                await super().shutdown(sockets)  # returns once every connection is closed
            finally:
                ender.cancel()

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # Above info the access log is never written: uvicorn would still format each
        # request's client and path for it (measured: ~1% of a gateway request).
        access_log=settings.log_level in ("debug", "info"),
        timeout_graceful_shutdown=math.ceil(grace + _FLUSH_SECONDS),
    )
    # After uvicorn set its loggers up: a ?key= in a request line is never logged.
    logging.getLogger("uvicorn.access").addFilter(QueryKeyRedactor())
    try:
        Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
