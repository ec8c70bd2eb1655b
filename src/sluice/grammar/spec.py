"""What a grammar is built from: tool specs and the call framing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]
    param: str = "tools"  # the request field named by a schema error


@dataclass(frozen=True, slots=True)
class CallFraming:
    """How a family writes tool calls around the JSON call objects.

    The whole output is ``prefix call (sep call)* suffix`` and each call is
    ``call_open {"<name_key>": "...", "<args_key>": {...}} call_close``.
    """

    prefix: str = ""
    call_open: str = ""
    call_close: str = ""
    sep: str = "\n"
    suffix: str = ""
    name_key: str = "name"
    args_key: str = "arguments"
