"""``sluice ps``: the requests in flight on a running server, and ``--cancel ID``.

Example::

    sluice ps                         # one table of what is generating now
    sluice ps --watch                 # the same, refreshed every second (Ctrl-C quits)
    sluice ps --cancel chatcmpl-1f2e  # stop one (your key's, or any with an admin key)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from sluice.clients.models import add_server_args, call, talk

WATCH_SECONDS = 1.0
_STATE_STYLE = {"queued": "yellow", "prefilling": "cyan", "generating": "green"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ps",
        help="list the requests in flight on a running server, or cancel one",
        description="The requests a running sluice server is generating now (GET "
        "/v1/requests): your key's own, or everyone's with an admin key.",
    )
    add_server_args(p)
    p.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    p.add_argument("--cancel", metavar="ID", help="cancel the request with this id")


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    shown = console or Console()

    def work(client: httpx.Client) -> int:
        if args.cancel:
            entry = call(client, f"/v1/requests/{args.cancel}/cancel", {})
            shown.print(f"cancelled {entry['id']} ({entry['model']})", highlight=False)
            return 0
        if not args.watch:
            shown.print(table(_requests(client)))
            return 0
        with Live(table(_requests(client)), console=shown, auto_refresh=False) as live:
            while True:
                time.sleep(WATCH_SECONDS)
                live.update(table(_requests(client)), refresh=True)

    try:
        return talk(args, shown, work)
    except KeyboardInterrupt:
        return 0


def _requests(client: httpx.Client) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = call(client, "/v1/requests")["data"]
    return data


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


def table(requests: list[dict[str, Any]]) -> Table | str:
    """The requests as a table (``"no requests in flight"`` when there are none)."""
    if not requests:
        return "no requests in flight"
    out = Table(box=None, header_style="bold")
    for column in ("id", "model", "slot", "dialect", "state", "prompt", "out", "tok/s", "age"):
        justify = "right" if column in ("prompt", "out", "tok/s", "age") else "left"
        out.add_column(column, justify=justify)  # type: ignore[arg-type]
    show_key = any(r.get("key") for r in requests)
    if show_key:
        out.add_column("key")
    for r in requests:
        state = str(r.get("state", "?"))
        style = _STATE_STYLE.get(state)
        rate = r.get("tokens_per_second")
        row = [
            str(r.get("id", "?")),
            str(r.get("model", "?")),
            str(r.get("slot", "?")),
            str(r.get("dialect", "?")),
            f"[{style}]{state}[/{style}]" if style else state,
            str(r.get("prompt_tokens", 0)),
            str(r.get("generated_tokens", 0)),
            "-" if rate is None else f"{rate:.1f}",
            _age(float(r.get("age_seconds", 0))),
        ]
        if show_key:
            row.append(str(r.get("key") or "-"))
        out.add_row(*row)
    return out
