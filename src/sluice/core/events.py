"""The closed set of typed events every backend emits and every formatter reads.

It lives in ``core`` (which imports nothing else of sluice) so that the engine,
the backends, the parsers and every dialect's formatter share it while imports
still go one way.

A response is a stream of these events, possibly for several choices
(``choice`` is the OpenAI ``index``). Every formatter is a pure function of
this stream; a non-streaming response is a fold over it.

Example::

    async for event in backend.stream(request):
        match event:
            case TextDelta(text=text):
                print(text, end="")
            case Finish(reason=reason):
                print("\\n", reason)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one emitted token, with the top alternatives."""

    token: str
    token_id: int
    logprob: float | None  # None for the first echoed prompt token
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Start:
    """Admitted after validation: the response may begin (role frame)."""

    choice: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Progress:
    """Work before the first token: model load or prompt processing."""

    choice: int
    phase: Literal["model_load", "prompt_processing"]
    done: int
    total: int
    cached: int = 0
    # model_load: seconds since the load began (its load time once done == total)
    elapsed: float = 0.0


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Newly decided text. ``logprobs`` has one entry per token it completes."""

    choice: int
    text: str
    token_count: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    echo: bool = False  # text of the prompt, sent back on request


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    choice: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    choice: int
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    choice: int
    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    choice: int
    index: int


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool call the server ran itself (MCP), or could not run; its output goes back
    to the model. Follows the model's ToolCallStart/Delta/End of the same ``index``.

    ``failure`` None: the call ran and ``output`` is its raw output string (LM Studio's
    ``tool_call.success``). Otherwise ``failure`` says why it did not
    (``invalid_name``: no such tool; ``invalid_arguments``: not JSON, or not matching
    the tool's schema; ``tool_error``: the server failed, timed out or answered too
    much) and ``reason`` is the message (``tool_call.failure``).
    """

    choice: int
    index: int
    name: str
    arguments: dict[str, Any] | None  # None when they were not a JSON object
    output: str | None = None
    failure: Literal["invalid_name", "invalid_arguments", "tool_error"] | None = None
    reason: str | None = None
    # who serves the tool: {"type": "plugin", "plugin_id": ...} or
    # {"type": "ephemeral_mcp", "server_label": ...}; None for an unknown name
    provider: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts for one choice; formatters sum them over choices."""

    choice: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning block
    prompt_ms: float = 0.0
    generation_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Finish:
    """Exactly one per choice, after its last delta."""

    choice: int
    reason: FinishReason
    usage: Usage | None = None
    stop_string: str | None = None


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """A failure after the stream began; ends the whole response."""

    error: Exception = field()


Event = (
    Start
    | Progress
    | TextDelta
    | ReasoningDelta
    | ToolCallStart
    | ToolCallDelta
    | ToolCallEnd
    | ToolResult
    | Finish
    | ErrorEvent
)
