"""What a grammar is built from: the limits, tool specs and call framing, schema errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_REPEAT = 4096
REPEAT_SETTING = "--max-grammar-repeat"
DEFAULT_MAX_ALTERNATIVES = 32
ALTERNATIVES_SETTING = "--max-grammar-alternatives"


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


class _SchemaProblem(Exception):
    """A schema the converter cannot or will not translate (message for the client)."""


class _OverBudget(_SchemaProblem):
    pass


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
