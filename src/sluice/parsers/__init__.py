"""Streaming output parsers: reasoning split and tool calls, one module per family.

Each parser turns one choice's text deltas into typed events (see
:mod:`sluice.parsers.base`); :mod:`sluice.parsers.registry` picks the family.
"""

from sluice.parsers.base import StreamParser
from sluice.parsers.reasoning import ReasoningParser
from sluice.parsers.registry import (
    TOOL_FORMATS,
    detect_reasoning,
    detect_tool_format,
    template_opens_think,
    tool_parser,
)

__all__ = [
    "TOOL_FORMATS",
    "ReasoningParser",
    "StreamParser",
    "detect_reasoning",
    "detect_tool_format",
    "template_opens_think",
    "tool_parser",
]
