"""Command line: ``sluice serve`` (no logic here beyond wiring)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from sluice.config import Settings, default_models_dir, default_store_path
from sluice.models.catalog import PACKAGED


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
        help="the default model, loaded at start: a packaged model "
        f"({', '.join(sorted(PACKAGED))}), a model of the models folder or the config file, "
        f"or a path to a .gguf file (default: {d.model})",
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
        "--cache-ram",
        dest="cache_ram_mb",
        type=int,
        help="MiB of RAM per loaded model for the KV state of recent prompts, restored when "
        f"a prompt comes back after its slot was reused; 0: off (default: {d.cache_ram_mb})",
    )
    p.add_argument(
        "--prefill-budget",
        type=float,
        help="while other sequences are generating, a long prompt's prefill gets this many "
        "times the time they use (measured), in chunks of about 0.5 s, so they keep about "
        "1 / (1 + this) of their speed and pause at most one chunk at a time; alone, a long "
        "prompt goes in chunks of at most ~1 s; a prompt that fits in one batch (--batch) is "
        f"prefilled whole, at once, ahead of long ones (default: {d.prefill_budget})",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer <key>' on every route but /health; this key is "
        "named 'default'; more named keys: SLUICE_API_KEYS='name:key,...' or the config "
        "file's [keys] table (default: none)",
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
    p.add_argument(
        "--gpu-layers",
        type=int,
        help="layers to offload to a GPU; needs llama-cpp-python built with CUDA or Metal "
        f"(default: {d.gpu_layers})",
    )
    mm = p.add_argument_group("many models (a request's 'model' picks one; it loads on first use)")
    mm.add_argument(
        "--models-dir",
        help="every .gguf file below this folder is a model; downloads go here "
        f"(default: {default_models_dir()})",
    )
    mm.add_argument(
        "--config",
        help="TOML file with [[models]] (name, source, aliases, ctx, ...), [[upstreams]] "
        "(name, urls, api_key_env, models, aliases, timeout) and [keys] "
        '(name = "key" or name = { env = "VAR" }): see the README',
    )
    tl = p.add_argument_group(
        "server-side tools (LM Studio's /api/v1/chat integrations, over MCP; off by default)"
    )
    tl.add_argument(
        "--mcp-config",
        help='an mcp.json ({"mcpServers": {label: {command, args, env} | {url, headers}}}): '
        "the servers requests name as plugin 'mcp/<label>'",
    )
    tl.add_argument(
        "--allow-mcp-plugins",
        action="store_true",
        default=None,
        help="let requests use the --mcp-config servers (they run commands on this machine: "
        "API keys are required, as in LM Studio)",
    )
    tl.add_argument(
        "--allow-ephemeral-mcp",
        action="store_true",
        default=None,
        help="let requests name MCP servers by URL (ephemeral_mcp; public addresses only "
        "unless --mcp-allow-private)",
    )
    tl.add_argument(
        "--mcp-allowed-hosts",
        help="'host,host:port,...': ephemeral MCP servers only on these (default: any public host)",
    )
    tl.add_argument(
        "--mcp-allow-private",
        action="store_true",
        default=None,
        help="let ephemeral MCP servers be on loopback, private or link-local addresses",
    )
    tl.add_argument(
        "--tool-rounds",
        type=int,
        help=f"model -> tools -> model rounds per request (default: {d.tool_rounds})",
    )
    tl.add_argument(
        "--tool-timeout",
        type=float,
        help=f"seconds per tool call, and per MCP server connect (default: {d.tool_timeout})",
    )
    mm.add_argument(
        "--store",
        help="SQLite file of the conversations (/c1) and stored responses "
        f"(default: {default_store_path()})",
    )
    mm.add_argument(
        "--max-loaded-models",
        type=int,
        help="models loaded at once; the least recently used idle one unloads to make room "
        f"(default: {d.max_loaded_models})",
    )
    mm.add_argument(
        "--model-ttl",
        type=float,
        help=f"seconds an idle model stays loaded; 0: until unloaded (default: {d.model_ttl:g})",
    )
    mm.add_argument(
        "--memory-budget-mb",
        type=int,
        help="memory all loaded models may use (weights + KV cache, estimated before a load); "
        "a load that would not fit is refused (default: 90%% of RAM)",
    )
    p.add_argument("--log-level", help=f"debug, info, warning, error (default: {d.log_level})")
    lim = p.add_argument_group("limits (each one answered with a 4xx naming the field)")
    lim.add_argument(
        "--max-body-bytes", type=int, help=f"request body size (default: {d.max_body_bytes})"
    )
    lim.add_argument(
        "--max-json-depth",
        type=int,
        help=f"nesting of arrays and objects in a body (default: {d.max_json_depth})",
    )
    lim.add_argument(
        "--max-number-digits",
        type=int,
        help=f"digits of an integer in a body (default: {d.max_number_digits})",
    )
    lim.add_argument(
        "--max-messages", type=int, help=f"messages per chat request (default: {d.max_messages})"
    )
    lim.add_argument(
        "--max-stop", type=int, help=f"stop strings per request (default: {d.max_stop})"
    )
    lim.add_argument(
        "--max-stop-length",
        type=int,
        help=f"characters per stop string (default: {d.max_stop_length})",
    )
    lim.add_argument(
        "--max-logit-bias", type=int, help=f"logit_bias entries (default: {d.max_logit_bias})"
    )
    lim.add_argument("--max-tools", type=int, help=f"tools per request (default: {d.max_tools})")
    lim.add_argument(
        "--max-schema-bytes",
        type=int,
        help=f"JSON size of a request's tool and response schemas (default: {d.max_schema_bytes})",
    )
    lim.add_argument(
        "--max-grammar-repeat",
        type=int,
        help="sum of the repetition bounds (maxLength, maxItems, ...) a constraint grammar "
        f"may expand (default: {d.max_grammar_repeat})",
    )
    lim.add_argument(
        "--max-grammar-alternatives",
        type=int,
        help="alternatives (enum values, anyOf branches, optional properties, ...) a "
        "constraint grammar may hold open at one point of the output: each costs every "
        f"sampled token a pass over the vocabulary (default: {d.max_grammar_alternatives})",
    )
    p.add_argument(
        "--prompt-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="in /v1/completions prompts, text such as <|im_end|> becomes the control token "
        "(default: on; chat messages are always plain text)",
    )
    p.add_argument(
        "--prepare-workers",
        type=int,
        help="threads that render templates, tokenize and build grammars, off the event loop "
        f"(default: {d.prepare_workers})",
    )
    p.add_argument(
        "--stream-buffer",
        type=int,
        help="engine steps of output held for a client that is not reading; then its "
        f"generation pauses (default: {d.stream_buffer})",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        help="seconds a streaming client may stop reading before its request is aborted "
        f"(default: {d.stall_timeout:g})",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        help="seconds running requests may finish after SIGTERM before they are ended with "
        f"an error frame (default: {d.shutdown_grace:g})",
    )


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
    from sluice.server.state import ServerState

    try:
        known = {f.name for f in fields(Settings)}
        settings = Settings.from_env(
            **{k: v for k, v in vars(args).items() if k in known and v is not None}
        )
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
    try:
        app = create_app(settings)
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
        timeout_graceful_shutdown=math.ceil(grace + _FLUSH_SECONDS),
    )
    try:
        Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
