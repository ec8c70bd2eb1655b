"""Which parser reads a model's output, decided from its chat template.

Example::

    fmt = detect_tool_format(chat_template)          # "hermes", "llama3", ...
    markers = detect_reasoning(chat_template)        # ("<think>", "</think>") or None
    parser = tool_parser(fmt, choice=0)
"""

from __future__ import annotations

from collections.abc import Callable

from sluice.parsers.base import StreamParser
from sluice.parsers.generic import GenericParser
from sluice.parsers.hermes import HermesParser
from sluice.parsers.llama3 import PYTHON_TAG, Llama3Parser
from sluice.parsers.mistral import TOOL_CALLS, MistralParser
from sluice.parsers.reasoning import ReasoningParser

ToolParserFactory = Callable[[int, str], StreamParser]
"""``factory(choice, id_prefix) -> parser``."""

TOOL_FORMATS: dict[str, ToolParserFactory] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "generic": GenericParser,
}

THINK = ("<think>", "</think>")


def tool_parser(fmt: str, choice: int, id_prefix: str = "call_") -> StreamParser:
    """A fresh tool-call parser of format ``fmt`` for one choice."""
    try:
        factory = TOOL_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown tool format {fmt!r}; known: {sorted(TOOL_FORMATS)}") from None
    return factory(choice, id_prefix)


def detect_tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model ("generic" if none)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    if TOOL_CALLS in template:
        return "mistral"
    return "generic"


def detect_reasoning(chat_template: str | None) -> tuple[str, str] | None:
    """The reasoning markers of a template that mentions them, else None."""
    if chat_template and THINK[0] in chat_template:
        return THINK
    return None


def template_opens_think(rendered_prompt: str, start: str = THINK[0], end: str = THINK[1]) -> bool:
    """True if the rendered prompt ends inside an opened, unclosed reasoning block
    (the generation prompt wrote the start tag), so the output begins as reasoning."""
    at = rendered_prompt.rfind(start)
    if at == -1:
        return False
    after = rendered_prompt[at + len(start) :]
    return end not in after and not after.strip()


def reasoning_parser(
    markers: tuple[str, str], choice: int, rendered_prompt: str = ""
) -> ReasoningParser:
    """A reasoning parser for ``markers``, opened if the prompt already opened the block."""
    start, end = markers
    return ReasoningParser(
        choice, start, end, opened=template_opens_think(rendered_prompt, start, end)
    )
