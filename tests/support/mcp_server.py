"""A small real MCP server for the tests, built on the SDK's ``MCPServer``.

Example::

    python tests/support/mcp_server.py stdio
    python tests/support/mcp_server.py http --port 8931 [--host 127.0.0.1]
    # then the server is at http://127.0.0.1:8931/mcp

Tools: ``add``, ``echo``, ``pid`` (this process's id), ``slow`` (leaves
``<marker>.started``, then ``<marker>.done`` or ``<marker>.cancelled``),
``fail`` (an ``isError`` result) and ``big`` (``n`` characters).
``MCP_TEST_PAGE_SIZE=n`` in the environment: ``tools/list`` answers in pages of n.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ListToolsResult, PaginatedRequestParams


class _Server(MCPServer):
    async def _handle_list_tools(
        self, ctx: Any, params: PaginatedRequestParams | None
    ) -> ListToolsResult:
        tools = await self.list_tools()
        size = int(os.environ.get("MCP_TEST_PAGE_SIZE", "0"))
        if not size:
            return ListToolsResult(tools=tools)
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + size
        return ListToolsResult(
            tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None
        )


server = _Server("sluice-test", log_level="WARNING")


@server.tool(description="Add two integers")
def add(a: int, b: int) -> int:
    return a + b


@server.tool(description="Return the text unchanged")
def echo(text: str) -> str:
    return text


@server.tool(description="The server's process id")
def pid() -> int:
    return os.getpid()


@server.tool(description="Sleep for some seconds, leaving marker files")
async def slow(seconds: float, marker: str) -> str:
    # MCP_TEST_MARKERS=<dir>: the markers go there (named by the marker's last part) and the
    # call lasts at least 30 s, whatever a model wrote as its arguments.
    folder = os.environ.get("MCP_TEST_MARKERS")
    if folder:
        marker = str(Path(folder) / (Path(marker).name or "slow"))
        seconds = max(seconds, 30.0)
    Path(f"{marker}.started").write_text(str(os.getpid()))
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        Path(f"{marker}.cancelled").write_text("")
        raise
    Path(f"{marker}.done").write_text("")
    return "done"


@server.tool(description="Fail with the message")
def fail(message: str) -> str:
    raise ToolError(message)


@server.tool(description="A string of n characters")
def big(n: int) -> str:
    return "x" * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="transport", required=True)
    sub.add_parser("stdio")
    http = sub.add_parser("http")
    http.add_argument("--port", type=int, required=True)
    http.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    if args.transport == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host=args.host, port=args.port, streamable_http_path="/mcp")


if __name__ == "__main__":
    main()
