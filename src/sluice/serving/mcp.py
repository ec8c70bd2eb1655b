"""Server-side tools over MCP (LM Studio's ``integrations``): what the tool loop sees.

The tool loop (``toolloop.py``) programs against :class:`ToolSet`; the
:class:`McpManager` builds one per request from the request's integrations:

* plugins (``"mcp/<label>"`` or ``{"type": "plugin", "id": ..., "allowed_tools"?}``):
  servers from the ``mcp.json`` of the settings (stdio or streamable HTTP),
  started once on first use and reused by every request;
* ephemeral servers (``{"type": "ephemeral_mcp", "server_label", "server_url",
  "allowed_tools"?, "headers"?}``): streamable HTTP, connected for this request
  only, to allowed hosts only.

Example::

    manager = McpManager(settings)
    tools = await manager.toolset(integrations)     # McpConnectionError, IntegrationNotAllowed
    try:
        specs = tools.specs                         # what the model is offered
        output = await tools.call("add", {"a": 1, "b": 2})   # ToolCallFailed
    finally:
        await tools.aclose()                        # ephemeral sessions end; plugins stay
    await manager.close()                           # at shutdown: every plugin server stops
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


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


class ToolCallFailed(Exception):
    """A tool call that did not produce an output: the server failed, timed out, or
    answered more than the output limit. The message is what the model is told."""


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
