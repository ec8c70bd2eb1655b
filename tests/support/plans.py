"""Building output plans for one chat request in grammar tests."""

from __future__ import annotations

from typing import Any

from sluice.core.request import GenerationRequest
from sluice.dialects.openai.schema import ChatCompletionRequest
from sluice.local.plan import OutputPlan, ToolLimits


def body(**extra: Any) -> GenerationRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **extra).to_request()


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def plan(limits: ToolLimits | None = None, **extra: Any) -> OutputPlan:
    return OutputPlan.build(
        body(**extra), fmt="hermes", reasoning=None, limits=limits or ToolLimits()
    )


def field(schema: dict[str, Any]) -> dict[str, Any]:
    """An object schema with one required property ``x`` of ``schema``."""
    return {"type": "object", "properties": {"x": schema}, "required": ["x"]}
