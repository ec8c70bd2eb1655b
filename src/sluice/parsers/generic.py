"""Tool calls for models whose chat template knows no tools (e.g. SmolLM2).

The server describes the tools in a system prompt, as compact signatures
(:mod:`sluice.parsers.signatures`: a fraction of the tokens of their JSON
schemas), and asks for calls in one fixed shape, the Hermes markup, so the parser
is :class:`HermesParser`.

Example::

    prompt = tool_system_prompt(tools, "auto", parallel=True)
    history = tool_call_text("get_weather", '{"city": "Tokyo"}')
    parser = GenericParser(0)
"""

from __future__ import annotations

import json
from typing import Any

from sluice.parsers.hermes import HermesParser
from sluice.parsers.signatures import signature

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


class GenericParser(HermesParser):
    """The Hermes parser, reading the format :func:`tool_system_prompt` asks for."""

    __slots__ = ()


def tool_call_text(name: str, arguments: str) -> str:
    """One past call in the format the prompt asks for (to replay an assistant turn).

    ``arguments`` is the call's JSON text; empty means ``{}``, and text that is
    not JSON is embedded as a JSON string so the block stays valid JSON.
    """
    try:
        args: Any = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        args = arguments
    call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{call}\n{CALL_CLOSE}"


def tool_system_prompt(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, parallel: bool
) -> str:
    """Instructions listing the functions and the exact call format.

    ``tools`` are OpenAI tool objects (``{"type": "function", "function": {...}}``;
    bare function objects are accepted too). ``tool_choice`` is ``"none"``,
    ``"auto"``/``None``, ``"required"``, a named function
    (``{"type": "function", "function": {"name": ...}}``) or ``"function:<name>"``.
    """
    lines = ["You can call these functions (name?: optional):"]
    for tool in tools:
        lines.append(signature(tool.get("function", tool)))
    lines += [
        "",
        "To call a function, reply with exactly this block, one block per call:",
        CALL_OPEN,
        '{"name": "<function name>", "arguments": {<parameter>: <value>, ...}}',
        CALL_CLOSE,
    ]
    forced = _forced_name(tool_choice)
    if tool_choice == "none":
        lines.append("Do not call any function now; answer the user directly.")
    elif forced is not None:
        lines.append(f"You must call the function {forced}.")
    elif tool_choice == "required":
        lines.append("You must call at least one function.")
    else:
        lines.append(
            "Call a function only when it helps to answer; otherwise answer the user directly, "
            "without any block."
        )
    if tool_choice != "none":
        if parallel:
            lines.append("You may call several functions at once: one block for each call.")
        else:
            lines.append("Call at most one function per reply.")
    return "\n".join(lines)


def _forced_name(tool_choice: str | dict[str, Any] | None) -> str | None:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        return name if isinstance(name, str) else None
    if isinstance(tool_choice, str) and tool_choice.startswith("function:"):
        return tool_choice.split(":", 1)[1]
    return None
