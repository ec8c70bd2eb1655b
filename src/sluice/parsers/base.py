"""Streaming output parsers: model text in, typed events out.

A parser is created per choice and fed the choice's text deltas in order.
It holds back what is still ambiguous (a possible prefix of ``<think>`` or of
a tool-call opening tag, a tool call whose name is not complete yet) and
returns events as soon as they are decided; ``flush()`` ends the text.

Parsers chain: the reasoning parser runs first and passes only its
``content`` on, so a tool call written inside reasoning is not a tool call.

Example::

    parser = registry.tool_parser("hermes", choice=0)
    events = parser.feed('<tool_call>{"name": "f", "argu')
    events += parser.feed('ments": {"x": 1}}</tool_call>')
    events += parser.flush()
    # ToolCallStart(name="f"), ToolCallDelta('{"x": 1}'), ToolCallEnd
"""

from __future__ import annotations

from typing import Protocol

from sluice.core.events import Event


class StreamParser(Protocol):
    """``feed(text) -> events`` plus ``flush() -> events``; one per choice."""

    def feed(self, text: str) -> list[Event]: ...

    def flush(self) -> list[Event]: ...

    @property
    def called_tools(self) -> bool:
        """True once at least one tool call was emitted (finish_reason tool_calls)."""
        ...
