"""``sluice models``: list, load, unload and download models on a running server.

A client of the server's LM Studio management API over HTTP (``/api/v1/models``):
it imports nothing of the server. Loads and downloads show ``rich`` progress bars
fed by the server's own progress: a load streams ``model_load.progress`` events
(``Accept: text/event-stream``), a download's job status is polled.

Example::

    sluice models list
    sluice models load gemma-3-270m --context-length 2048
    sluice models download https://huggingface.co/<org>/<repo>/resolve/main/<file>.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

DEFAULT_URL = "http://127.0.0.1:8080"
POLL_SECONDS = 0.25  # between a download's status reads


class CommandError(Exception):
    """What went wrong, in words for the terminal (the command exits with 1)."""


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``--url`` and ``--api-key``: the server a client command talks to."""
    p.add_argument(
        "--url",
        default=os.environ.get("SLUICE_URL", DEFAULT_URL),
        help=f"the server (default: $SLUICE_URL, else {DEFAULT_URL})",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("SLUICE_API_KEY"),
        help="its API key, when it has keys (default: $SLUICE_API_KEY)",
    )


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "models",
        help="list, load, unload or download models on a running server",
        description="Manage the models of a running sluice server over its HTTP API.",
    )
    add_server_args(p)
    verbs = p.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="every model the server knows, and its state")
    load = verbs.add_parser("load", help="load a model, with a progress bar")
    load.add_argument("model", help="a model name or alias")
    load.add_argument("--context-length", type=int, help="context tokens per sequence")
    load.add_argument("--parallel", type=int, help="sequences decoded together (slots)")
    load.add_argument("--ttl", type=float, help="idle seconds before it unloads")
    unload = verbs.add_parser("unload", help="unload a loaded model")
    unload.add_argument("model", help="a model name")
    download = verbs.add_parser("download", help="download a GGUF file, with a progress bar")
    download.add_argument("source", metavar="URL", help="the URL of one GGUF file")
    download.add_argument("--sha256", help="the file's expected SHA-256")


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console(stderr=False)

    def work(client: httpx.Client) -> int:
        match args.verb:
            case "list":
                return _list(client, console)
            case "load":
                return _load(client, console, args)
            case "unload":
                call(client, "/api/v1/models/unload", {"instance_id": args.model})
                console.print(f"unloaded {args.model}", highlight=False)
                return 0
            case _:
                return _download(client, console, args)

    try:
        return talk(args, console, work)
    except KeyboardInterrupt:  # the server goes on with a load or a download
        console.print("stopped (the server goes on with what it was asked)")
        return 130


def talk(args: argparse.Namespace, console: Console, work: Callable[[httpx.Client], int]) -> int:
    """``work`` with a client of the server ``args`` name; what fails is one line on
    ``console`` and exit status 1, never a traceback."""
    try:
        with httpx.Client(
            base_url=args.url, headers=auth_headers(args.api_key), timeout=30
        ) as client:
            return work(client)
    except CommandError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
    except httpx.HTTPError as exc:
        console.print(f"[red]error:[/red] cannot reach {args.url}: {exc}", highlight=False)
    except (ValueError, KeyError) as exc:  # an answer that is not the JSON expected
        console.print(f"[red]error:[/red] unexpected answer from {args.url}: {exc}")
    return 1


def call(client: httpx.Client, path: str, body: dict[str, Any] | None = None) -> Any:
    """POST ``body`` (GET without one) and answer the JSON; an error answer is a
    :class:`CommandError` in the server's words."""
    r = client.post(path, json=body) if body is not None else client.get(path)
    if r.status_code >= 400:
        raise CommandError(error_text(r.status_code, r.content))
    return r.json()


def error_text(status: int, content: bytes) -> str:
    try:
        error = json.loads(content)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode("utf-8", "replace")
    return f"{message} (HTTP {status})"


def _size(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _list(client: httpx.Client, console: Console) -> int:
    data = call(client, "/api/v1/models")
    table = Table(box=None, header_style="bold")
    for column in ("model", "state", "size", "context", "params", "quant"):
        table.add_column(column)
    for m in data.get("models") or []:
        loaded = m.get("loaded_instances") or []
        state = "[green]loaded[/green]" if loaded else "not loaded"
        context = (loaded[0].get("config") or {}).get("context_length") if loaded else None
        table.add_row(
            m.get("key", "?"),
            state,
            _size(m.get("size_bytes")),
            str(context or m.get("max_context_length") or "-"),
            str(m.get("params_string") or "-"),
            str((m.get("quantization") or {}).get("name") or "-"),
        )
    console.print(table)
    return 0


def _events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """The SSE events of a streamed answer: (event name, JSON data)."""
    event = ""
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            yield event, json.loads(line[5:])


def _load(client: httpx.Client, console: Console, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"model": args.model, "echo_load_config": True}
    for key, value in (
        ("context_length", args.context_length),
        ("parallel", args.parallel),
        ("ttl", args.ttl),
    ):
        if value is not None:
            body[key] = value
    columns = (TextColumn("loading {task.description}"), BarColumn(), TaskProgressColumn())
    with (
        client.stream(
            "POST", "/api/v1/models/load", json=body, headers={"accept": "text/event-stream"},
            timeout=httpx.Timeout(30, read=None),
        ) as r,
        Progress(*columns, console=console, transient=False) as bar,
    ):  # fmt: skip
        if r.status_code >= 400:
            raise CommandError(error_text(r.status_code, r.read()))
        task = bar.add_task(args.model, total=1.0)
        for event, data in _events(r):
            if event == "model_load.progress":
                bar.update(task, completed=float(data.get("progress") or 0.0))
            elif event == "error":
                error = data.get("error")
                raise CommandError(
                    (error.get("message") if isinstance(error, dict) else error) or "load failed"
                )
            elif event == "model_load.end":
                bar.update(task, completed=1.0)
                seconds = data.get("load_time_seconds") or 0.0
                config = data.get("load_config") or {}
                context = config.get("context_length")
                bar.stop()
                console.print(
                    f"loaded {data.get('instance_id', args.model)} in {seconds:.2f} s"
                    + (f" (context {context})" if context else ""),
                    highlight=False,
                )
                return 0
    raise CommandError("the server ended the load without an answer")


def _download(client: httpx.Client, console: Console, args: argparse.Namespace) -> int:
    body = {"model": args.source, **({"sha256": args.sha256} if args.sha256 else {})}
    job = call(client, "/api/v1/models/download", body)
    if job.get("status") == "already_downloaded":
        console.print(f"already downloaded: {job.get('model') or args.source}", highlight=False)
        return 0
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(str(job.get("model") or args.source), total=job.get("total_size_bytes"))
        while True:
            bar.update(
                task,
                completed=job.get("downloaded_bytes") or 0,
                total=job.get("total_size_bytes"),
            )
            status = job.get("status")
            if status == "completed":
                break
            if status in ("failed", "paused"):
                raise CommandError(job.get("error") or f"the download {status}")
            time.sleep(POLL_SECONDS)
            job = call(client, f"/api/v1/models/download/status/{job['job_id']}")
    console.print(f"downloaded {job.get('model') or args.source}", highlight=False)
    return 0
