"""Server-side tools over MCP (LM Studio's ``integrations``): what the tool loop sees.

The tool loop (``loop.py``) programs against :class:`ToolSet`; the
:class:`McpManager` builds one per request from the request's integrations:

* plugins (``"mcp/<label>"`` or ``{"type": "plugin", "id": ..., "allowed_tools"?}``):
  servers from the ``mcp.json`` of the settings (stdio or streamable HTTP),
  started once on first use and reused by every request;
* ephemeral servers (``{"type": "ephemeral_mcp", "server_label", "server_url",
  "allowed_tools"?, "headers"?}``): streamable HTTP, connected for this request
  only; only to hosts on ``mcp_allowed_hosts`` (when set) and, unless
  ``mcp_allow_private``, only to public addresses (checked before connecting and
  again at connect time).

Both kinds are refused (:class:`~sluice.core.errors.IntegrationNotAllowed`) unless
their setting allows them. A tool's output is the MCP result's content list as
compact JSON. A ``call`` that times out, or whose task is cancelled (the client
went away), is cancelled on the server too: the SDK sends
``notifications/cancelled`` (on streamable HTTP at MCP 2026-07-28 it aborts the
request's POST instead), and the cancellation propagates at once.

Example::

    manager = McpManager(settings)
    integrations = parse_integrations(body["integrations"])   # InvalidRequest
    tools = await manager.toolset(integrations)     # McpConnectionError, IntegrationNotAllowed
    try:
        specs = tools.specs                         # what the model is offered
        output = await tools.call("add", {"a": 1, "b": 2})   # ToolCallFailed
    finally:
        await tools.aclose()                        # ephemeral sessions end; plugins stay
    await manager.close()                           # at shutdown: every plugin server stops
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import mcp_types as types

from sluice.config import Settings
from sluice.core.errors import IntegrationNotAllowed, InvalidRequest, McpConnectionError
from sluice.tools.mcp_servers import (
    HttpServer,
    McpConnection,
    ServerConfig,
    ToolCallFailed,
    host_allowed,
    is_http_url,
    load_mcp_config,
    public_addresses,
    valid_headers,
)

__all__ = [
    "EphemeralIntegration",
    "Integration",
    "McpManager",
    "PluginIntegration",
    "ToolCallFailed",
    "ToolSet",
    "ToolSpec",
    "parse_integrations",
]

log = logging.getLogger("sluice.mcp")

_PARAM = "integrations"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool offered to the model."""

    name: str
    description: str | None
    input_schema: dict[str, Any]  # JSON Schema of the arguments object
    # LM Studio's provider_info: {"type": "plugin", "plugin_id": "mcp/x"} or
    # {"type": "ephemeral_mcp", "server_label": "x"}
    provider: dict[str, Any]

    def openai_tool(self) -> dict[str, Any]:
        """The tool as an OpenAI function definition (what chat templates take)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolSet(Protocol):
    """The tools of one request."""

    specs: list[ToolSpec]

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool (``name`` is one of ``specs``) within the time limit of the settings.

        Returns LM Studio's raw output string: the MCP result's content list as
        compact JSON (``[{"type":"text","text":"..."}]``); a result the server
        flags as an error (``isError``) is still an output (the model reads it).
        Raises :class:`ToolCallFailed`.
        """
        ...

    async def aclose(self) -> None:
        """End this request's ephemeral sessions (idempotent)."""
        ...


# -- integrations -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PluginIntegration:
    """A server of the ``mcp.json``: plugin id ``"mcp/<label>"``."""

    id: str
    allowed_tools: tuple[str, ...] | None = None  # None: all of the server's tools

    @property
    def label(self) -> str:
        return self.id.removeprefix("mcp/")

    @property
    def provider(self) -> dict[str, Any]:
        return {"type": "plugin", "plugin_id": self.id}


@dataclass(frozen=True, slots=True)
class EphemeralIntegration:
    """A streamable HTTP server given in the request, for this request only."""

    server_label: str
    server_url: str
    allowed_tools: tuple[str, ...] | None = None  # None: all of the server's tools
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def provider(self) -> dict[str, Any]:
        return {"type": "ephemeral_mcp", "server_label": self.server_label}


Integration = PluginIntegration | EphemeralIntegration

_PLUGIN_FIELDS = {"type", "id", "allowed_tools"}
_EPHEMERAL_FIELDS = {"type", "server_label", "server_url", "allowed_tools", "headers"}


def _bad(message: str) -> InvalidRequest:
    return InvalidRequest(message, param=_PARAM)


def parse_integrations(raw: Any) -> list[Integration]:
    """LM Studio's ``integrations`` array (``None``: none); :class:`InvalidRequest`
    (param ``"integrations"``) naming the item and field at fault."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("integrations must be an array")
    out: list[Integration] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        where = f"integrations[{index}]"
        if isinstance(item, str):
            parsed: Integration = PluginIntegration(_nonempty(item, where))
        elif isinstance(item, dict):
            parsed = _parse_object(item, where)
        else:
            raise _bad(f"{where} must be a plugin id (string) or an object")
        key = parsed.id if isinstance(parsed, PluginIntegration) else parsed.server_label
        if key in seen:
            raise _bad(f"{where}: {key!r} is given twice")
        seen.add(key)
        out.append(parsed)
    return out


def _parse_object(item: dict[str, Any], where: str) -> Integration:
    kind = item.get("type")
    if kind not in ("plugin", "ephemeral_mcp"):
        raise _bad(f"{where}.type must be 'plugin' or 'ephemeral_mcp'")
    known = _PLUGIN_FIELDS if kind == "plugin" else _EPHEMERAL_FIELDS
    for key in item:
        if key not in known:
            raise _bad(f"{where}.{key} is not a field of a {kind} integration")
    allowed = _allowed_tools(item.get("allowed_tools"), f"{where}.allowed_tools")
    if kind == "plugin":
        return PluginIntegration(_nonempty(item.get("id"), f"{where}.id"), allowed)
    label = _nonempty(item.get("server_label"), f"{where}.server_label")
    url = item.get("server_url")
    if not isinstance(url, str) or not is_http_url(url):
        raise _bad(f"{where}.server_url must be an http(s) URL")
    headers = item.get("headers")
    if headers is None:
        headers = {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise _bad(f"{where}.headers must be an object of strings")
    if not valid_headers(headers):
        raise _bad(f"{where}.headers has an invalid header name or value")
    return EphemeralIntegration(label, url, allowed, dict(headers))


def _nonempty(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(f"{where} must be a non-empty string")
    return value


def _allowed_tools(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _bad(f"{where} must be an array of tool names")
    return tuple(dict.fromkeys(value))


# -- the tools of a request ---------------------------------------------------------


class _Tools:
    """The :class:`ToolSet` :meth:`McpManager.toolset` returns."""

    def __init__(self, manager: McpManager, settings: Settings) -> None:
        self.specs: list[ToolSpec] = []
        self._manager = manager
        self._timeout = settings.tool_timeout
        self._limit = settings.tool_output_bytes
        self._routes: dict[str, tuple[McpConnection, str | None]] = {}  # name: (conn, plugin)
        self._owned: list[McpConnection] = []  # ephemeral sessions: this request's

    def own(self, conn: McpConnection) -> McpConnection:
        self._owned.append(conn)
        return conn

    def add(self, integration: Integration, conn: McpConnection, tools: list[types.Tool]) -> None:
        plugin = integration.label if isinstance(integration, PluginIntegration) else None
        for tool in tools:
            if tool.name in self._routes:
                log.warning(
                    "MCP tool %r of %s is also offered by %s: the first one is used",
                    tool.name,
                    conn.name,
                    self._routes[tool.name][0].name,
                )
                continue
            self._routes[tool.name] = (conn, plugin)
            self.specs.append(
                ToolSpec(tool.name, tool.description, tool.input_schema, integration.provider)
            )

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """See :meth:`ToolSet.call`."""
        route = self._routes.get(name)
        if route is None:
            raise ToolCallFailed(f"Cannot find tool with name {name}.")
        conn, plugin = route
        if plugin is not None:  # a plugin restarted since: its new session
            current = self._manager._plugins.get(plugin)
            conn = current if current is not None and current.alive else conn
        result = await conn.call(name, arguments, self._timeout)
        output = json.dumps(
            [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in result.content],
            separators=(",", ":"),
            ensure_ascii=False,
        )
        size = len(output.encode("utf-8"))
        if size > self._limit:
            raise ToolCallFailed(
                f"The output of {name} is {size} bytes, over the limit of {self._limit} bytes."
            )
        return output

    async def aclose(self) -> None:
        """See :meth:`ToolSet.aclose`."""
        owned, self._owned = self._owned, []
        if owned:
            await asyncio.gather(*(conn.stop() for conn in owned))


# -- the manager --------------------------------------------------------------------


class McpManager:
    """Builds each request's :class:`ToolSet` and owns the plugin servers."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._config: dict[str, ServerConfig] | None = None
        self._plugins: dict[str, McpConnection] = {}  # by label
        self._locks: dict[str, asyncio.Lock] = {}
        self._sessions: set[McpConnection] = set()  # every plugin session maybe still open
        self._closed = False

    def plugin_servers(self) -> dict[str, ServerConfig]:
        """The ``mcp.json`` servers by label, read on first use (McpConnectionError)."""
        if self._config is None:
            path = self._settings.mcp_config
            self._config = load_mcp_config(path) if path else {}
        return self._config

    def _plugin_config(self, integration: PluginIntegration, where: str) -> ServerConfig:
        servers = self.plugin_servers()
        server = servers.get(integration.label) if integration.id.startswith("mcp/") else None
        if server is None:
            known = ", ".join(f"mcp/{label}" for label in servers) or "none are configured"
            raise _bad(f"{where}: unknown plugin {integration.id!r} (known: {known})")
        return server

    async def toolset(self, integrations: Sequence[Integration]) -> ToolSet:
        """The tools of these integrations, connected (plugins started on first use).

        Raises :class:`IntegrationNotAllowed`, :class:`InvalidRequest` (an unknown
        plugin or allowed tool) and :class:`McpConnectionError`; nothing is left open
        then.
        """
        settings = self._settings
        for index, item in enumerate(integrations):
            where = f"integrations[{index}]"
            if isinstance(item, PluginIntegration):
                if not settings.allow_mcp_plugins:
                    raise IntegrationNotAllowed(
                        f"{where}: MCP plugins are not enabled on this server", param=_PARAM
                    )
                self._plugin_config(item, where)
            else:
                await self._check_ephemeral(item, where)
        tools = _Tools(self, settings)
        try:
            connected = await asyncio.gather(
                *(self._connect(item, tools) for item in integrations), return_exceptions=True
            )
            for index, (item, result) in enumerate(zip(integrations, connected, strict=True)):
                if isinstance(result, BaseException):
                    raise result
                conn, mcp_tools = result
                tools.add(item, conn, _select(mcp_tools, item, conn, index))
        except BaseException:
            await tools.aclose()
            raise
        return tools

    async def _check_ephemeral(self, item: EphemeralIntegration, where: str) -> None:
        settings = self._settings
        if not settings.allow_ephemeral_mcp:
            raise IntegrationNotAllowed(
                f"{where}: ephemeral MCP servers are not enabled on this server", param=_PARAM
            )
        parts = urlsplit(item.server_url)
        host = parts.hostname or ""
        if settings.mcp_allowed_hosts is not None and not host_allowed(
            item.server_url, settings.mcp_allowed_hosts
        ):
            raise IntegrationNotAllowed(
                f"{where}: MCP server host {host!r} is not on this server's allowed hosts",
                param=_PARAM,
            )
        if not settings.mcp_allow_private:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                with anyio.fail_after(settings.tool_timeout):
                    await public_addresses(host, port)
            except (OSError, TimeoutError) as exc:
                cause = "no answer" if isinstance(exc, TimeoutError) else str(exc)
                raise McpConnectionError(
                    f"MCP server {item.server_label}: cannot resolve {host!r}: {cause}"
                ) from exc

    async def _connect(
        self, item: Integration, tools: _Tools
    ) -> tuple[McpConnection, list[types.Tool]]:
        timeout = self._settings.tool_timeout
        if isinstance(item, PluginIntegration):
            return await self._plugin(item)
        server = HttpServer(
            item.server_url, item.headers, public_only=not self._settings.mcp_allow_private
        )
        conn = tools.own(McpConnection(item.server_label, server))
        return conn, await conn.start(timeout)

    async def _plugin(self, item: PluginIntegration) -> tuple[McpConnection, list[types.Tool]]:
        """The plugin's session (started once; restarted when it died) and its tools."""
        timeout = self._settings.tool_timeout
        conn = self._plugins.get(item.label)
        if conn is not None and conn.alive:
            try:
                return conn, await conn.relist(timeout)
            except Exception as exc:  # noqa: BLE001 - any failure: restart it
                log.warning("MCP plugin %s: %s; restarting it", item.id, _cause(exc))
        lock = self._locks.setdefault(item.label, asyncio.Lock())
        async with lock:
            current = self._plugins.get(item.label)
            if current is not None and current is not conn and current.alive:
                return current, current.tools  # started (or restarted) meanwhile
            if current is not None:
                del self._plugins[item.label]
                await current.stop()
            if self._closed:
                raise McpConnectionError(f"MCP server {item.id}: the server is shutting down")
            new = McpConnection(item.id, self._plugin_config(item, "integrations"))
            self._sessions = {conn for conn in self._sessions if not conn.finished}
            self._sessions.add(new)  # close() stops it even if this start is cancelled
            tools = await new.start(timeout)
            if self._closed:  # close() ran meanwhile
                await new.stop()
                raise McpConnectionError(f"MCP server {item.id}: the server is shutting down")
            self._plugins[item.label] = new
            return new, tools

    async def close(self) -> None:
        """Stop every plugin server (stdio processes end)."""
        self._closed = True
        self._plugins.clear()
        conns, self._sessions = list(self._sessions), set()
        if conns:
            await asyncio.gather(*(conn.stop() for conn in conns))


def _select(
    tools: list[types.Tool], item: Integration, conn: McpConnection, index: int
) -> list[types.Tool]:
    """The server's tools ``allowed_tools`` lets through (InvalidRequest for a name the
    server does not have)."""
    if item.allowed_tools is None:
        return tools
    names = {tool.name for tool in tools}
    for name in item.allowed_tools:
        if name not in names:
            have = ", ".join(sorted(names)) or "none"
            raise _bad(
                f"integrations[{index}].allowed_tools: {conn.name} has no tool {name!r} "
                f"(it has: {have})"
            )
    allowed = set(item.allowed_tools)
    return [tool for tool in tools if tool.name in allowed]


def _cause(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer to tools/list"
    return str(exc) or type(exc).__name__
