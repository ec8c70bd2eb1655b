"""MCP sessions for :mod:`sluice.tools.mcp`: the ``mcp.json`` servers, the address
checks of ephemeral servers, and one long-lived task per session (the SDK's context
managers are entered and exited in that task; calls come from any task).

Example::

    servers = load_mcp_config("mcp.json")                   # {"calc": StdioServer(...)}
    conn = McpConnection("mcp/calc", servers["calc"])
    tools = await conn.start(timeout=30)                     # McpConnectionError
    result = await conn.call("add", {"a": 1, "b": 2}, timeout=30)   # ToolCallFailed
    await conn.stop()
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpcore2
import httpx2
import mcp_types as types
from mcp import Client, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sluice import __version__
from sluice.core import addresses
from sluice.core.errors import IntegrationNotAllowed, McpConnectionError

log = logging.getLogger("sluice.mcp")

_MAX_PAGES = 100  # tools/list pages followed before giving up (a paginator that never ends)
_STOP_GRACE = 5.0  # seconds a session gets to close cleanly before it is cancelled
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


class ToolCallFailed(Exception):
    """A tool call that did not produce an output: the server failed, timed out, or
    answered more than the output limit. The message is what the model is told."""


# -- configuration -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StdioServer:
    """An MCP server run as a child process, spoken to over its stdin/stdout."""

    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # merged over the SDK's safe defaults
    cwd: str | None = None


@dataclass(frozen=True, slots=True)
class HttpServer:
    """An MCP server at a streamable HTTP endpoint."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    public_only: bool = False  # every connection re-checks the addresses (ephemeral servers)


ServerConfig = StdioServer | HttpServer


def load_mcp_config(path: str) -> dict[str, ServerConfig]:
    """The servers of an ``mcp.json`` (``{"mcpServers": {label: ...}}``) by label.

    Raises :class:`McpConnectionError` naming the file and the field at fault.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise McpConnectionError(f"MCP config {path}: cannot be read: {exc}") from exc

    def bad(where: str, what: str) -> McpConnectionError:
        return McpConnectionError(f"MCP config {path}: {where} {what}")

    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise bad("mcpServers", "must be an object of servers by label")
    out: dict[str, ServerConfig] = {}
    for label, entry in servers.items():
        where = f"mcpServers.{label}"
        if not label or "/" in label:
            raise bad(where, "is not a usable label (empty or with '/')")
        if not isinstance(entry, dict):
            raise bad(where, "must be an object")
        if "command" in entry:
            command, args = entry["command"], entry.get("args", [])
            env, cwd = entry.get("env") or {}, entry.get("cwd")
            if not isinstance(command, str) or not command:
                raise bad(f"{where}.command", "must be a non-empty string")
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise bad(f"{where}.args", "must be an array of strings")
            if not _str_map(env):
                raise bad(f"{where}.env", "must be an object of strings")
            if cwd is not None and not isinstance(cwd, str):
                raise bad(f"{where}.cwd", "must be a string")
            out[label] = StdioServer(command, tuple(args), dict(env), cwd)
        elif "url" in entry:
            url, headers = entry["url"], entry.get("headers") or {}
            if not isinstance(url, str) or not is_http_url(url):
                raise bad(f"{where}.url", "must be an http(s) URL")
            if not _str_map(headers) or not valid_headers(headers):
                raise bad(f"{where}.headers", "must be an object of valid header names and values")
            out[label] = HttpServer(url, dict(headers))
        else:
            raise bad(where, "needs a 'command' (stdio) or a 'url' (streamable HTTP)")
    return out


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def valid_headers(headers: dict[str, str]) -> bool:
    """Header names are HTTP tokens; values have no line breaks or NULs."""
    return all(
        _HEADER_NAME.match(k) and not any(c in v for c in "\r\n\0") for k, v in headers.items()
    )


def is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


# -- addresses of ephemeral servers ----------------------------------------------------


async def public_addresses(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, all of them public (:mod:`sluice.core.addresses`).

    Raises :class:`IntegrationNotAllowed` naming the host when any address is loopback,
    private, link-local, reserved, multicast or unspecified; ``OSError`` when the name
    does not resolve.
    """
    try:
        return await addresses.public_addresses(host, port)
    except addresses.NotPublic as exc:
        raise IntegrationNotAllowed(f"MCP server host {exc}", param="integrations") from exc


def host_allowed(url: str, allowed_hosts: str) -> bool:
    """Whether the URL's host is on ``"host,host:port,..."`` (hosts without a port: any)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return addresses.host_allowed(parts.hostname or "", port, allowed_hosts)


class _PublicOnlyBackend(addresses.PublicOnlyConnector, httpcore2.AsyncNetworkBackend):
    """Connects only to public addresses, resolved at connect time (no DNS rebinding
    between the check of the request and the connection)."""


def _http_transport(public_only: bool) -> httpx2.AsyncHTTPTransport:
    transport = httpx2.AsyncHTTPTransport()
    pool = getattr(transport, "_pool", None)
    if public_only:
        if isinstance(pool, httpcore2.AsyncConnectionPool) and hasattr(pool, "_network_backend"):
            pool._network_backend = _PublicOnlyBackend(
                httpcore2.AnyIOBackend(),
                connect_error=httpcore2.ConnectError,
                connect_timeout=httpcore2.ConnectTimeout,
                refused=lambda exc: httpcore2.ConnectError(f"MCP server host {exc}"),
            )
        else:  # pragma: no cover (an httpx2 without the pool we know)
            log.warning("cannot check MCP server addresses at connect time")
    return transport


# -- sessions -------------------------------------------------------------------------


def describe(exc: BaseException) -> str:
    """A one-line cause: the first leaf of an exception group, its type and message."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError):
        text = exc.error.message
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line if len(line) <= 300 else line[:299] + "…"


_CLIENT_INFO = types.Implementation(name="sluice", version=__version__)


@asynccontextmanager
async def _open(server: ServerConfig, mode: str) -> AsyncIterator[Client]:
    """A connected, initialized SDK client for the server (``mode="auto"``: the 2026
    ``server/discover`` when the server has it, else the ``initialize`` handshake)."""
    if isinstance(server, StdioServer):
        params = StdioServerParameters(
            command=server.command, args=list(server.args), env=server.env or None, cwd=server.cwd
        )
        stdio = stdio_client(params)
        async with Client(stdio, mode=mode, cache=None, client_info=_CLIENT_INFO) as client:
            yield client
        return
    http = httpx2.AsyncClient(
        headers=server.headers,
        timeout=httpx2.Timeout(30.0, read=300.0),
        transport=_http_transport(server.public_only),
        trust_env=not server.public_only,  # no proxy from the environment: it would connect
    )
    async with http:
        transport = streamable_http_client(server.url, http_client=http)
        async with Client(transport, mode=mode, cache=None, client_info=_CLIENT_INFO) as client:
            yield client


async def _list_tools(client: Client) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools
    raise RuntimeError(f"tools/list did not end after {_MAX_PAGES} pages")


class McpConnection:
    """One MCP session, owned from connect to close by its own task.

    ``name`` (the plugin id or the server label) is what errors name; ``mode`` is the
    SDK's (``"auto"``, ``"legacy"``: the ``initialize`` handshake only).
    """

    def __init__(self, name: str, server: ServerConfig, mode: str = "auto") -> None:
        self.name = name
        self.server = server
        self.mode = mode
        self.tools: list[types.Tool] = []
        self._client: Client | None = None
        self._broken = False
        self._stop = asyncio.Event()
        self._scope: anyio.CancelScope | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def protocol_version(self) -> str | None:
        """The negotiated MCP version (None until connected)."""
        client = self._client
        return client.protocol_version if client is not None else None

    @property
    def finished(self) -> bool:
        """The session's task has ended (or never started): nothing left to close."""
        return self._task is None or self._task.done()

    @property
    def alive(self) -> bool:
        """Connected, not stopped, and no call has seen the connection closed."""
        return self._client is not None and not self._broken and not self._stop.is_set()

    async def start(self, timeout: float) -> list[types.Tool]:
        """Connect, initialize and list the tools (every page) within ``timeout`` seconds.

        Raises :class:`McpConnectionError` naming the server and the cause.
        """
        ready: asyncio.Future[list[types.Tool]] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        self._task = asyncio.create_task(self._run(ready, timeout), name=f"mcp {self.name}")
        try:
            self.tools = await asyncio.shield(ready)
        except BaseException:
            self.request_stop()
            raise
        return self.tools

    async def _run(self, ready: asyncio.Future[list[types.Tool]], timeout: float) -> None:
        deadline = anyio.current_time() + timeout
        timed_out = f"did not connect and list its tools within {timeout:g} s"
        try:
            # One scope for the connect deadline (lifted once connected) and for stop():
            # the SDK's scopes nest inside it, entered and exited in this task.
            with anyio.CancelScope(deadline=deadline) as self._scope:
                async with _open(self.server, self.mode) as client:
                    tools = await _list_tools(client)
                    self._scope.deadline = math.inf
                    self._client = client
                    ready.set_result(tools)
                    await self._stop.wait()
            if not ready.done():
                cause = "stopped" if self._stop.is_set() else timed_out
                ready.set_exception(McpConnectionError(f"MCP server {self.name}: {cause}"))
        except Exception as exc:  # noqa: BLE001 - handed to start()'s caller, or logged
            if not ready.done():
                late = anyio.current_time() >= deadline and not self._stop.is_set()
                cause = timed_out if late else describe(exc)
                ready.set_exception(McpConnectionError(f"MCP server {self.name}: {cause}"))
            else:
                log.warning("MCP server %s: the session ended: %s", self.name, describe(exc))
        finally:
            self._client = None
            self._broken = True
            if not ready.done():
                ready.cancel()

    async def relist(self, timeout: float) -> list[types.Tool]:
        """List the tools again (a liveness check too); raises whatever failed."""
        client = self._client
        if client is None or not self.alive:
            raise McpConnectionError(f"MCP server {self.name}: not connected")
        with anyio.fail_after(timeout):
            self.tools = await _list_tools(client)
        return self.tools

    async def call(
        self, name: str, arguments: dict[str, Any], timeout: float
    ) -> types.CallToolResult:
        """``tools/call`` within ``timeout`` seconds; :class:`ToolCallFailed` if it fails.

        A cancelled call (or one that times out) is cancelled on the server too: the SDK
        sends ``notifications/cancelled`` (on streamable HTTP at 2026-07-28: it aborts the
        request's POST).
        """
        client = self._client
        if client is None or not self.alive:
            raise ToolCallFailed(f"The MCP server {self.name} is not connected.")
        try:
            with anyio.move_on_after(timeout):
                return await client.call_tool(name, arguments)
        except MCPError as exc:
            if exc.code == types.CONNECTION_CLOSED:
                self._broken = True
                self.request_stop()
            raise ToolCallFailed(f"{name} failed: {exc.error.message}") from exc
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            self._broken = True
            self.request_stop()
            raise ToolCallFailed(f"{name} failed: the connection to {self.name} closed") from exc
        except Exception as exc:
            raise ToolCallFailed(f"{name} failed: {describe(exc)}") from exc
        raise ToolCallFailed(f"{name} timed out after {timeout:g} s")

    def request_stop(self) -> None:
        """Ask the session's task to close it (a connect in progress is cancelled)."""
        self._stop.set()
        if self._client is None and self._scope is not None:
            self._scope.cancel()

    async def stop(self, grace: float = _STOP_GRACE) -> None:
        """Close the session (a stdio server's process ends) and wait for its task.

        A session that does not close within ``grace`` seconds is cancelled. Waiting is
        not cancelled with the caller: the task closes the session either way.
        """
        self.request_stop()
        task = self._task
        if task is None or task.done():
            return
        done, _ = await asyncio.wait({task}, timeout=grace)
        if not done and self._scope is not None:
            log.warning("MCP server %s: did not close within %g s; cancelled", self.name, grace)
            self._scope.cancel()
            await asyncio.wait({task}, timeout=grace)
