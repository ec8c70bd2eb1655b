"""The MCP client layer against a real MCP server (``tests/support/mcp_server.py``) over stdio
(a plugin of an ``mcp.json``) and streamable HTTP (ephemeral, and a plugin by URL)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from sluice.config import Settings
from sluice.core.errors import IntegrationNotAllowed, InvalidRequest, McpConnectionError
from sluice.tools.mcp import (
    EphemeralIntegration,
    McpManager,
    PluginIntegration,
    ToolCallFailed,
    parse_integrations,
)
from sluice.tools.mcp_servers import (
    HttpServer,
    McpConnection,
    StdioServer,
    host_allowed,
    public_addresses,
)
from tests.support.servers import MCP_TEST_SERVER, free_port, mcp_http_server

SERVER = MCP_TEST_SERVER
TOOLS = {"add", "echo", "pid", "slow", "fail", "big"}


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    with mcp_http_server() as url:
        yield url


def _settings(tmp_path: Path, http_url: str, **overrides: Any) -> Settings:
    config = tmp_path / "mcp.json"
    config.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "calc": {"command": sys.executable, "args": [SERVER, "stdio"]},
                    "web": {"url": http_url},
                    "paged": {
                        "command": sys.executable,
                        "args": [SERVER, "stdio"],
                        "env": {"MCP_TEST_PAGE_SIZE": "4"},
                    },
                }
            }
        )
    )
    values: dict[str, Any] = {
        "mcp_config": str(config),
        "allow_mcp_plugins": True,
        "allow_ephemeral_mcp": True,
        "mcp_allow_private": True,
        "tool_timeout": 10.0,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def make(tmp_path: Path, http_url: str) -> AsyncIterator[Callable[..., McpManager]]:
    managers: list[McpManager] = []

    def make(**overrides: Any) -> McpManager:
        managers.append(McpManager(_settings(tmp_path, http_url, **overrides)))
        return managers[-1]

    yield make
    for manager in managers:
        await manager.close()
    assert _stdio_children() == []  # close() left no server process


def _stdio_children() -> list[int]:
    """This process's children running the test server over stdio (Linux /proc)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and SERVER.encode() in command and b"stdio" in command:
            found.append(int(entry.name))
    return found


def _ephemeral(url: str, label: str = "web", **kw: Any) -> EphemeralIntegration:
    return EphemeralIntegration(label, url, **kw)


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- parsing ----------------------------------------------------------------------


def test_parse_integrations() -> None:
    parsed = parse_integrations(
        [
            "mcp/calc",
            {"type": "plugin", "id": "mcp/web", "allowed_tools": ["add"]},
            {
                "type": "ephemeral_mcp",
                "server_label": "hf",
                "server_url": "https://example.com/mcp",
                "headers": {"Authorization": "Bearer x"},
            },
        ]
    )
    assert parsed == [
        PluginIntegration("mcp/calc"),
        PluginIntegration("mcp/web", ("add",)),
        EphemeralIntegration("hf", "https://example.com/mcp", None, {"Authorization": "Bearer x"}),
    ]
    assert parse_integrations(None) == []


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("mcp/x", "integrations must be an array"),
        ([5], "integrations[0] must be a plugin id"),
        ([""], "integrations[0] must be a non-empty string"),
        ([{"type": "tool"}], "integrations[0].type must be 'plugin' or 'ephemeral_mcp'"),
        ([{"type": "plugin"}], "integrations[0].id must be a non-empty string"),
        (
            ["mcp/a", {"type": "ephemeral_mcp", "server_label": "a", "server_url": "ftp://h/"}],
            "integrations[1].server_url must be an http(s) URL",
        ),
        (
            [{"type": "ephemeral_mcp", "server_label": "a", "server_url": "https:///x"}],
            "integrations[0].server_url must be an http(s) URL",
        ),
        (
            [{"type": "ephemeral_mcp", "server_url": "https://h/"}],
            "integrations[0].server_label must be a non-empty string",
        ),
        (
            [{"type": "plugin", "id": "mcp/a", "allowed_tools": "add"}],
            "integrations[0].allowed_tools must be an array of tool names",
        ),
        (
            [
                {
                    "type": "ephemeral_mcp",
                    "server_label": "a",
                    "server_url": "https://h/",
                    "headers": {"x": 1},
                }
            ],
            "integrations[0].headers must be an object of strings",
        ),
        (
            [
                {
                    "type": "ephemeral_mcp",
                    "server_label": "a",
                    "server_url": "https://h/",
                    "headers": {"x": "a\r\nb: c"},
                }
            ],
            "integrations[0].headers has an invalid header name or value",
        ),
        ([{"type": "plugin", "id": "mcp/a", "x": 1}], "integrations[0].x is not a field"),
        (["mcp/a", {"type": "plugin", "id": "mcp/a"}], "integrations[1]: 'mcp/a' is given twice"),
    ],
)
def test_parse_errors(raw: Any, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_integrations(raw)
    assert info.value.param == "integrations"
    assert message in info.value.message


def test_host_checks() -> None:
    assert host_allowed("https://Example.com/mcp", "example.com")
    assert host_allowed("https://example.com/mcp", "a.org, example.com:443")
    assert not host_allowed("https://example.com:8443/mcp", "example.com:443")
    assert host_allowed("http://[::1]:8080/mcp", "[::1]:8080")
    assert not host_allowed("https://evil.com/mcp", "example.com")
    assert not host_allowed("https://example.com/mcp", "")


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "0.0.0.0", "224.0.0.1", "localhost"]
)
async def test_private_addresses_refused(host: str) -> None:
    with pytest.raises(IntegrationNotAllowed, match="not a public address"):
        await public_addresses(host, 80)


async def test_public_address_passes() -> None:
    assert await public_addresses("93.184.215.14", 443) == ["93.184.215.14"]


# -- tools ------------------------------------------------------------------------


async def test_list_and_openai_shape(make: Callable[..., McpManager], http_url: str) -> None:
    tools = await make().toolset([_ephemeral(http_url)])
    try:
        assert {spec.name for spec in tools.specs} == TOOLS
        add = next(spec for spec in tools.specs if spec.name == "add")
        assert add.provider == {"type": "ephemeral_mcp", "server_label": "web"}
        shape = add.openai_tool()
        assert shape["type"] == "function"
        assert shape["function"]["name"] == "add"
        assert shape["function"]["description"] == "Add two integers"
        parameters = shape["function"]["parameters"]
        assert parameters["type"] == "object"
        assert parameters["required"] == ["a", "b"]
        assert parameters["properties"]["a"]["type"] == "integer"
    finally:
        await tools.aclose()


@pytest.mark.parametrize("plugin", ["mcp/calc", "mcp/web"])
async def test_plugin_add(make: Callable[..., McpManager], plugin: str) -> None:
    tools = await make().toolset(parse_integrations([plugin]))
    assert {spec.name for spec in tools.specs} == TOOLS
    assert tools.specs[0].provider == {"type": "plugin", "plugin_id": plugin}
    output = await tools.call("add", {"a": 1, "b": 2})
    assert output == '[{"type":"text","text":"3"}]'
    assert json.loads(output) == [{"type": "text", "text": "3"}]
    assert await tools.call("echo", {"text": "héllo"}) == '[{"type":"text","text":"héllo"}]'
    await tools.aclose()


async def test_paginated_listing(make: Callable[..., McpManager]) -> None:
    tools = await make().toolset([PluginIntegration("mcp/paged", ("big", "add"))])
    assert [spec.name for spec in tools.specs] == ["add", "big"]  # "big" is on page 2
    assert await tools.call("big", {"n": 3}) == '[{"type":"text","text":"xxx"}]'


async def test_allowed_tools(make: Callable[..., McpManager], http_url: str) -> None:
    manager = make()
    tools = await manager.toolset([_ephemeral(http_url, allowed_tools=("echo", "add"))])
    assert [spec.name for spec in tools.specs] == ["add", "echo"]  # the server's order
    with pytest.raises(ToolCallFailed, match="Cannot find tool with name pid"):
        await tools.call("pid", {})
    await tools.aclose()
    with pytest.raises(InvalidRequest, match=r"integrations\[0\].allowed_tools: .*'nope'") as info:
        await manager.toolset([PluginIntegration("mcp/calc", ("add", "nope"))])
    assert info.value.param == "integrations"


async def test_failing_tool_is_an_output(make: Callable[..., McpManager], http_url: str) -> None:
    tools = await make().toolset([_ephemeral(http_url)])
    output = await tools.call("fail", {"message": "it broke"})
    assert output == '[{"type":"text","text":"Error executing tool fail: it broke"}]'
    await tools.aclose()


async def test_big_output_fails(make: Callable[..., McpManager], http_url: str) -> None:
    tools = await make(tool_output_bytes=100).toolset([_ephemeral(http_url)])
    assert len(await tools.call("big", {"n": 50})) == len('[{"type":"text","text":""}]') + 50
    with pytest.raises(ToolCallFailed, match="is 227 bytes, over the limit of 100 bytes"):
        await tools.call("big", {"n": 200})
    await tools.aclose()


async def test_timeout_cancels_the_tool(
    make: Callable[..., McpManager], http_url: str, tmp_path: Path
) -> None:
    tools = await make(tool_timeout=1.0).toolset([_ephemeral(http_url)])
    marker = tmp_path / "slow"
    started = time.monotonic()
    with pytest.raises(ToolCallFailed, match=r"^slow timed out after 1 s$"):
        await tools.call("slow", {"seconds": 30, "marker": str(marker)})
    assert time.monotonic() - started < 3
    await _until(lambda: Path(f"{marker}.cancelled").exists())
    assert Path(f"{marker}.started").exists()
    assert not Path(f"{marker}.done").exists()
    assert await tools.call("add", {"a": 2, "b": 2}) == '[{"type":"text","text":"4"}]'
    await tools.aclose()


async def test_timeout_cancels_the_tool_stdio(tmp_path: Path) -> None:
    # The connection itself: a stdio server may take more than the short limit to start.
    conn = McpConnection("mcp/calc", StdioServer(sys.executable, (SERVER, "stdio")))
    await conn.start(timeout=10)
    marker = tmp_path / "slow"
    try:
        with pytest.raises(ToolCallFailed, match=r"^slow timed out after 0.5 s$"):
            await conn.call("slow", {"seconds": 30, "marker": str(marker)}, timeout=0.5)
        await _until(lambda: Path(f"{marker}.cancelled").exists())
        assert not Path(f"{marker}.done").exists()
        assert conn.alive
    finally:
        await conn.stop()
    assert not conn.alive


@pytest.mark.parametrize("kind", ["ephemeral", "plugin"])
async def test_cancelled_call_cancels_the_tool(
    make: Callable[..., McpManager], http_url: str, tmp_path: Path, kind: str
) -> None:
    item = _ephemeral(http_url) if kind == "ephemeral" else PluginIntegration("mcp/calc")
    tools = await make().toolset([item])
    marker = tmp_path / "slow"
    call = asyncio.create_task(tools.call("slow", {"seconds": 30, "marker": str(marker)}))
    await _until(lambda: Path(f"{marker}.started").exists())
    call.cancel()  # the client went away
    started = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert time.monotonic() - started < 1
    await _until(lambda: Path(f"{marker}.cancelled").exists())
    assert not Path(f"{marker}.done").exists()
    await tools.aclose()


# -- connections ------------------------------------------------------------------


async def test_unreachable_server(make: Callable[..., McpManager]) -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(McpConnectionError, match="MCP server gone: ") as info:
        await make().toolset([_ephemeral(url, "gone")])
    assert "onnect" in info.value.message  # the cause: a connection error


async def test_connect_timeout(make: Callable[..., McpManager]) -> None:
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/mcp"
        started = time.monotonic()
        with pytest.raises(McpConnectionError, match="within 0.5 s"):
            await make(tool_timeout=0.5).toolset([_ephemeral(url, "mute")])
        assert time.monotonic() - started < 3


async def test_not_allowed(make: Callable[..., McpManager], http_url: str) -> None:
    with pytest.raises(IntegrationNotAllowed, match="ephemeral MCP servers are not enabled"):
        await make(allow_ephemeral_mcp=False).toolset([_ephemeral(http_url)])
    with pytest.raises(IntegrationNotAllowed, match="MCP plugins are not enabled"):
        await make(allow_mcp_plugins=False).toolset([PluginIntegration("mcp/calc")])
    with pytest.raises(IntegrationNotAllowed, match="'127.0.0.1' is not on this server's allowed"):
        await make(mcp_allowed_hosts="example.com").toolset([_ephemeral(http_url)])
    with pytest.raises(IntegrationNotAllowed, match="'127.0.0.1' resolves to 127.0.0.1"):
        await make(mcp_allow_private=False).toolset([_ephemeral(http_url)])
    local = http_url.replace("127.0.0.1", "localhost")
    with pytest.raises(IntegrationNotAllowed, match="'localhost' resolves to"):
        await make(mcp_allow_private=False).toolset([_ephemeral(local)])
    port = http_url.split(":")[2].split("/")[0]
    tools = await make(mcp_allowed_hosts=f"example.com,127.0.0.1:{port}").toolset(
        [_ephemeral(http_url)]
    )
    assert {spec.name for spec in tools.specs} == TOOLS
    await tools.aclose()


async def test_unknown_plugin_and_broken_config(
    make: Callable[..., McpManager], tmp_path: Path
) -> None:
    with pytest.raises(
        InvalidRequest, match=r"unknown plugin 'mcp/nope' \(known: mcp/calc, mcp/web, mcp/paged\)"
    ):
        await make().toolset([PluginIntegration("mcp/nope")])
    broken = tmp_path / "broken.json"
    broken.write_text('{"mcpServers": {"x": {"command": 5}}}')
    with pytest.raises(McpConnectionError, match=r"mcpServers.x.command must be a non-empty"):
        await make(mcp_config=str(broken)).toolset([PluginIntegration("mcp/x")])
    broken.write_text("{not json")
    with pytest.raises(McpConnectionError, match="cannot be read"):
        await make(mcp_config=str(broken)).toolset([PluginIntegration("mcp/x")])
    with pytest.raises(InvalidRequest, match="none are configured"):
        await make(mcp_config=None).toolset([PluginIntegration("mcp/x")])


async def test_plugin_started_once(make: Callable[..., McpManager]) -> None:
    manager = make()
    first, second = await asyncio.gather(  # two concurrent first uses
        manager.toolset([PluginIntegration("mcp/calc")]),
        manager.toolset([PluginIntegration("mcp/calc")]),
    )
    pid = json.loads(await first.call("pid", {}))[0]["text"]
    assert json.loads(await second.call("pid", {}))[0]["text"] == pid
    await first.aclose()
    await second.aclose()
    third = await manager.toolset([PluginIntegration("mcp/calc")])  # a later request
    assert json.loads(await third.call("pid", {}))[0]["text"] == pid
    assert _running(int(pid))
    await manager.close()
    await _until(lambda: not _running(int(pid)))


async def test_cancelled_plugin_start(make: Callable[..., McpManager]) -> None:
    """A request that goes away while its plugin starts leaves nothing running."""
    manager = make()
    start = asyncio.create_task(manager.toolset([PluginIntegration("mcp/calc")]))
    await _until(lambda: bool(_stdio_children()))
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await _until(lambda: not _stdio_children())  # the half-started server ends
    tools = await manager.toolset([PluginIntegration("mcp/calc")])  # a later request
    assert await tools.call("add", {"a": 1, "b": 1}) == '[{"type":"text","text":"2"}]'


async def test_dead_plugin_restarts(make: Callable[..., McpManager]) -> None:
    manager = make()
    tools = await manager.toolset([PluginIntegration("mcp/calc")])
    pid = int(json.loads(await tools.call("pid", {}))[0]["text"])
    os.kill(pid, signal.SIGKILL)
    await _until(lambda: not _running(pid))
    with pytest.raises(ToolCallFailed):
        await tools.call("pid", {})
    again = await manager.toolset([PluginIntegration("mcp/calc")])
    new_pid = int(json.loads(await again.call("pid", {}))[0]["text"])
    assert new_pid != pid
    assert json.loads(await tools.call("pid", {}))[0]["text"] == str(new_pid)  # rerouted


async def test_duplicate_tool_names_first_wins(
    make: Callable[..., McpManager], http_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sluice.mcp"):
        tools = await make().toolset([_ephemeral(http_url), PluginIntegration("mcp/calc")])
    assert len(tools.specs) == len(TOOLS)
    assert all(spec.provider["type"] == "ephemeral_mcp" for spec in tools.specs)
    assert "'add' of mcp/calc is also offered by web" in caplog.text
    await tools.aclose()


async def test_ephemeral_session_ends_with_aclose(
    make: Callable[..., McpManager], http_url: str
) -> None:
    tools = await make().toolset([_ephemeral(http_url)])
    await tools.aclose()
    await tools.aclose()  # idempotent
    with pytest.raises(ToolCallFailed, match="not connected"):
        await tools.call("add", {"a": 1, "b": 2})


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_legacy_handshake(http_url: str, tmp_path: Path, transport: str) -> None:
    """A server spoken to with the ``initialize`` handshake (as pre-2026 servers are):
    calls work and a cancelled call is cancelled on the server too."""
    server = StdioServer(sys.executable, (SERVER, "stdio")) if transport == "stdio" else None
    conn = McpConnection("old", server or HttpServer(http_url), mode="legacy")
    try:
        assert {tool.name for tool in await conn.start(timeout=10)} == TOOLS
        assert conn.protocol_version not in MODERN_PROTOCOL_VERSIONS
        result = await conn.call("add", {"a": 1, "b": 2}, timeout=5)
        assert [c.model_dump(exclude_none=True) for c in result.content] == [
            {"type": "text", "text": "3"}
        ]
        marker = tmp_path / "slow"
        call = asyncio.create_task(conn.call("slow", {"seconds": 30, "marker": str(marker)}, 60))
        await _until(lambda: Path(f"{marker}.started").exists())
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await _until(lambda: Path(f"{marker}.cancelled").exists())
        assert not Path(f"{marker}.done").exists()
    finally:
        await conn.stop()
    assert _stdio_children() == []


async def test_public_only_checked_at_connect(http_url: str) -> None:
    """An ephemeral server's addresses are checked again when connecting (DNS rebinding)."""
    conn = McpConnection("web", HttpServer(http_url, public_only=True))
    with pytest.raises(McpConnectionError, match="MCP server web: .*not a public address"):
        await conn.start(timeout=5)
