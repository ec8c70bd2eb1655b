"""Command line: ``sluice serve`` (no logic here beyond wiring)."""

from __future__ import annotations

import argparse
import logging
import sys

from sluice.catalog import PACKAGED
from sluice.config import Settings


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = Settings()
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a GGUF model over OpenAI-compatible HTTP/SSE. Every flag can also be "
        "set as an environment variable SLUICE_<FLAG> (e.g. SLUICE_PORT=9000).",
    )
    p.add_argument(
        "--model",
        help=f"packaged model name ({', '.join(sorted(PACKAGED))}) or path to a .gguf file "
        f"(default: {d.model})",
    )
    p.add_argument("--host", help=f"address to bind (default: {d.host})")
    p.add_argument("--port", type=int, help=f"port to bind (default: {d.port})")
    p.add_argument(
        "--parallel", type=int, help=f"sequences decoded together (slots) (default: {d.parallel})"
    )
    p.add_argument("--ctx", type=int, help=f"context tokens per sequence (default: {d.ctx})")
    p.add_argument("--threads", type=int, help="CPU threads for llama.cpp (default: all cores)")
    p.add_argument("--batch", type=int, help=f"max tokens per decode step (default: {d.batch})")
    p.add_argument(
        "--queue", type=int, help=f"requests that may wait for a slot (default: {d.queue})"
    )
    p.add_argument(
        "--api-key", help="require 'Authorization: Bearer <key>' on /v1/* (default: none)"
    )
    p.add_argument("--chat-template", help="Jinja chat template file overriding the model's own")
    p.add_argument(
        "--tool-format",
        choices=["hermes", "llama3", "mistral", "generic"],
        help="how the model writes tool calls (default: detected from its chat template; "
        "'generic' for templates without tool support)",
    )
    p.add_argument(
        "--strict-model-names",
        action="store_true",
        default=None,
        help="answer 404 for an unknown 'model' instead of serving the loaded one",
    )
    p.add_argument("--log-level", help=f"debug, info, warning, error (default: {d.log_level})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sluice", description="sluice: a streaming-first LLM server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from sluice.api.app import create_app

    try:
        settings = Settings.from_env(
            model=args.model,
            host=args.host,
            port=args.port,
            parallel=args.parallel,
            ctx=args.ctx,
            threads=args.threads,
            batch=args.batch,
            queue=args.queue,
            api_key=args.api_key,
            chat_template=args.chat_template,
            strict_model_names=args.strict_model_names,
            tool_format=args.tool_format,
            log_level=args.log_level,
        )
    except ValueError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # End in-flight streams with an error frame now, rather than letting
            # the graceful-shutdown timeout cut them off without a word.
            state = getattr(app.state, "sluice", None)
            if state is not None:
                state.engine.begin_shutdown()
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )
    Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
