"""LM Studio's ``POST /api/v1/chat``: named SSE events and the non-streaming body.

One object serves both: fed every event, it answers the stream's frames, and
:meth:`LMStudioChatFormatter.result` is the body, which ``chat.end`` carries
too (the same dict, built by the same code). A response may span several model
rounds (server-side tool calls): each round is a ``Start``, its prompt
processing, its output and a ``Finish``, and the tools' ``ToolResult`` events
come between rounds.

The stream's shape:

* ``chat.start``; ``model_load.start/progress/end`` if the model loads for it;
* per round ``prompt_processing.start/progress/end`` (made up, progress 1, for
  a backend that reports none, so clients see one shape);
* ``reasoning.*`` and ``message.*`` blocks, each opened and closed once, and
  ``tool_call.*`` events, in the order the model wrote them;
* ``chat.end {"result": ...}``; after a failure ``error`` first, then
  ``chat.end`` with what was generated.

Stats over every round: ``input_tokens`` is the last round's prompt,
``total_output_tokens`` the sum of the rounds' completions,
``tokens_per_second`` that sum over the time from the first output token to
the last (tool calls between rounds included), ``time_to_first_token_seconds``
from the start of prompt processing (the formatter's creation if none was
reported).

Example::

    calc = {"type": "plugin", "plugin_id": "mcp/calc"}
    fmt = LMStudioChatFormatter("qwen3-0.6b", providers={"add": calc})
    frames = fmt.start()
    for event in events:
        frames.extend(fmt.frames(event))
    frames.extend(fmt.end())
    body = fmt.result()          # == frames[-1].data["result"]
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from sluice.core.errors import as_sluice_error, lmstudio_error_body
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResult,
)
from sluice.core.frames import Frame

BlockKind = Literal["reasoning", "message"]


def _frame(kind: str, **fields: Any) -> Frame:
    return Frame({"type": kind, **fields}, event=kind)


def _fraction(done: int, total: int) -> float:
    if total <= 0:
        return 1.0
    return min(1.0, max(0.0, done / total))


@dataclass(slots=True)
class _Phase:
    """A model load or one prompt's processing: idle -> open -> done."""

    state: Literal["idle", "open", "done"] = "idle"
    last: float = 0.0  # the last progress sent: each one sent is larger

    def advance(self, value: float) -> bool:
        if value <= self.last:
            return False
        self.last = value
        return True


@dataclass(slots=True)
class _Call:
    """A tool call the model is writing (one index of one round)."""

    name: str
    arguments: list[str] = field(default_factory=list)
    started: bool = False  # tool_call.start sent
    argued: bool = False  # tool_call.arguments sent


class LMStudioChatFormatter:
    """Events -> LM Studio's named events; also the non-streaming body (:meth:`result`).

    ``providers`` maps the name of each server-side tool to its ``provider_info``;
    ``response_id`` is given only when the response is stored (an attribute: clear
    it before the end if storing failed); ``clock`` (seconds) times the stats.

    Example::

        fmt = LMStudioChatFormatter("gemma-3-270m", response_id="resp_ab12")
        fmt.start()     # [chat.start]
        fmt.frames(TextDelta(0, "Hi", token_count=1))
        # -> [prompt_processing.start, .progress 1, .end, message.start, message.delta]
        fmt.end()       # [message.end, chat.end]
    """

    def __init__(
        self,
        model_instance_id: str,
        *,
        providers: dict[str, dict[str, Any]] | None = None,
        response_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_instance_id = model_instance_id
        self._providers = providers or {}
        self.response_id = response_id
        self._clock = clock
        self._created = clock()
        self._started = False
        self._final: dict[str, Any] | None = None
        # output: closed items, and the block being written
        self._items: list[dict[str, Any]] = []
        self._block: BlockKind | None = None
        self._block_text: list[str] = []
        self._calls: dict[int, _Call] = {}
        # model load
        self._load = _Phase()
        self._load_elapsed = 0.0  # the last load event's elapsed, and when it came
        self._load_seen_at = 0.0
        self._load_time: float | None = None
        # prompt processing of the current round
        self._prompt = _Phase()
        self._round_output = False  # the current round wrote something
        self._round_finished = False  # ...or finished: the next Start begins another
        self._prompt_started_at: float | None = None  # the first real prompt processing
        # stats
        self._input_tokens = 0
        self._finished_tokens = 0  # completion tokens of finished rounds
        self._round_tokens = 0  # token counts seen in the current round
        self._reasoning_tokens = 0
        self._pending_tokens = 0  # tokens of empty deltas before any block opened
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._ttft: float | None = None

    # -- the protocol ---------------------------------------------------------------

    def start(self) -> list[Frame]:
        """``chat.start`` (once; :meth:`frames`, :meth:`error` and :meth:`end` send it
        first if nobody asked)."""
        if self._started:
            return []
        self._started = True
        return [_frame("chat.start", model_instance_id=self.model_instance_id)]

    def frames(self, event: Event) -> list[Frame]:
        if self._final is not None:
            return []
        out = self.start()
        match event:
            case Progress(phase="model_load"):
                out += self._on_load(event)
            case Progress(phase="prompt_processing"):
                out += self._on_prompt(event)
            case Start():
                out += self._on_start(event)
            case TextDelta():
                out += self._on_text(event)
            case ReasoningDelta():
                out += self._on_reasoning(event)
            case ToolCallStart():
                out += self._on_call_start(event)
            case ToolCallDelta():
                call = self._calls.get(event.index)
                if call is not None:
                    call.arguments.append(event.arguments)
                self._mark_token()
            case ToolCallEnd():
                out += self._on_call_end(event)
            case ToolResult():
                out += self._on_result(event)
            case Finish():
                out += self._on_finish(event)
            case ErrorEvent():
                out += self.error(event.error)
        return out

    def error(self, error: BaseException) -> list[Frame]:
        """A failure after the stream began: the open block is closed (a client that
        renders blocks sees each one end), then ``error``, then ``chat.end`` with what
        was generated. A load or prompt processing cut short gets no ``.end``: that
        event means it completed."""
        if self._final is not None:
            return []
        out = self.start() + self._close_block()
        inner = lmstudio_error_body(as_sluice_error(error))["error"]
        # ASCII: a message may quote the client's input, lone surrogates included.
        out.append(Frame({"type": "error", "error": inner}, event="error", ascii=True))
        return out + self._chat_end()

    def end(self) -> list[Frame]:
        """After the last event: what is still open is closed, then ``chat.end``."""
        if self._final is not None:
            return []
        out = self.start() + self._settle_load()
        if self._prompt.state == "open":
            out += self._end_prompt()
        return out + self._close_block() + self._chat_end()

    def result(self) -> dict[str, Any]:
        """The non-streaming body; once ended, the very dict ``chat.end`` carried.

        Before the end it is the body so far (the open block included), and asking
        changes nothing about the frames still to come.
        """
        if self._final is not None:
            return self._final
        output = list(self._items)
        if self._block is not None:
            output.append({"type": self._block, "content": "".join(self._block_text)})
        return self._body(output)

    # -- model load and prompt processing -----------------------------------------

    def _on_load(self, event: Progress) -> list[Frame]:
        if self._load.state == "done":
            return []
        out: list[Frame] = []
        if self._load.state == "idle":
            self._load.state = "open"
            out.append(_frame("model_load.start", model_instance_id=self.model_instance_id))
        self._load_elapsed = event.elapsed
        self._load_seen_at = self._clock()
        if event.done >= event.total:
            return out + self._end_load(event.elapsed)
        if self._load.advance(_fraction(event.done, event.total)):
            out.append(self._load_progress())
        return out

    def _load_progress(self) -> Frame:
        return _frame(
            "model_load.progress",
            model_instance_id=self.model_instance_id,
            progress=self._load.last,
        )

    def _end_load(self, elapsed: float) -> list[Frame]:
        out = [self._load_progress()] if self._load.advance(1.0) else []
        self._load.state = "done"
        self._load_time = round(elapsed, 3)
        out.append(
            _frame(
                "model_load.end",
                model_instance_id=self.model_instance_id,
                load_time_seconds=self._load_time,
            )
        )
        return out

    def _settle_load(self) -> list[Frame]:
        """A load that ended without saying so (work went on): end it now, its time
        estimated from its last report."""
        if self._load.state != "open":
            return []
        return self._end_load(self._load_elapsed + self._clock() - self._load_seen_at)

    def _on_prompt(self, event: Progress) -> list[Frame]:
        out = self._settle_load()
        if self._prompt.state == "done":
            if not (self._round_output or self._round_finished):
                return out  # a late report of the prompt already done
            self._new_round()  # a new prompt with no Start before it
        if self._prompt.state == "idle":
            self._prompt.state = "open"
            if self._prompt_started_at is None:
                self._prompt_started_at = self._clock()
            out.append(_frame("prompt_processing.start"))
        # Cached tokens are processed already (the engine counts them in done, too).
        done = max(event.done, event.cached)
        if done >= event.total:
            return out + self._end_prompt()
        if self._prompt.advance(_fraction(done, event.total)):
            out.append(_frame("prompt_processing.progress", progress=self._prompt.last))
        return out

    def _end_prompt(self) -> list[Frame]:
        out = []
        if self._prompt.advance(1.0):
            out.append(_frame("prompt_processing.progress", progress=1.0))
        self._prompt.state = "done"
        out.append(_frame("prompt_processing.end"))
        return out

    def _settle_prompt(self) -> list[Frame]:
        """Before a round's first output: its prompt processing, ended (or made up, for
        a backend that reports none)."""
        if self._prompt.state == "done":
            return []
        out = [_frame("prompt_processing.start")] if self._prompt.state == "idle" else []
        self._prompt.state = "open"
        return out + self._end_prompt()

    def _new_round(self) -> None:
        self._prompt = _Phase()
        self._round_output = False
        self._round_finished = False
        self._calls = {}
        self._pending_tokens = 0

    def _on_start(self, event: Start) -> list[Frame]:
        out = self._settle_load() + self._close_block()
        # (A prompt reported before its round's Start stays that round's.)
        if self._round_output or self._round_finished:
            self._new_round()
        self._pending_tokens = 0
        if event.prompt_tokens:
            self._input_tokens = event.prompt_tokens
        return out

    def _before_output(self) -> list[Frame]:
        out = self._settle_load() + self._settle_prompt()
        self._round_output = True
        self._mark_token()
        return out

    def _mark_token(self) -> None:
        now = self._clock()
        if self._first_token_at is None:
            self._first_token_at = now
            since = (
                self._prompt_started_at if self._prompt_started_at is not None else self._created
            )
            self._ttft = round(max(0.0, now - since), 3)
        self._last_token_at = now

    # -- text and reasoning -------------------------------------------------------

    def _on_text(self, event: TextDelta) -> list[Frame]:
        if event.echo:
            return []
        self._round_tokens += event.token_count
        if not event.text:
            # The tokens of text that became reasoning markers or reasoning (parsing.py's
            # _attach) come on an empty delta: reasoning's if a reasoning block is open,
            # or opens next (an opening marker).
            if event.token_count:
                self._mark_token()
                if self._block == "reasoning":
                    self._reasoning_tokens += event.token_count
                elif self._block is None:
                    self._pending_tokens += event.token_count
            return []
        out = self._before_output() + self._open("message")
        self._block_text.append(event.text)
        out.append(_frame("message.delta", content=event.text))
        return out

    def _on_reasoning(self, event: ReasoningDelta) -> list[Frame]:
        if not event.text:
            return []
        out = self._before_output() + self._open("reasoning")
        self._block_text.append(event.text)
        out.append(_frame("reasoning.delta", content=event.text))
        return out

    def _open(self, kind: BlockKind) -> list[Frame]:
        if self._block == kind:
            return []
        out = self._close_block()
        if kind == "reasoning":
            self._reasoning_tokens += self._pending_tokens
        self._pending_tokens = 0
        self._block = kind
        return [*out, _frame(f"{kind}.start")]

    def _close_block(self) -> list[Frame]:
        if self._block is None:
            return []
        kind = self._block
        self._items.append({"type": kind, "content": "".join(self._block_text)})
        self._block = None
        self._block_text = []
        return [_frame(f"{kind}.end")]

    # -- tool calls -----------------------------------------------------------------

    def _on_call_start(self, event: ToolCallStart) -> list[Frame]:
        out = self._before_output() + self._close_block()
        self._pending_tokens = 0
        call = self._calls[event.index] = _Call(event.name)
        provider = self._providers.get(event.name)
        if provider is not None:
            call.started = True
            out.append(_frame("tool_call.start", tool=event.name, provider_info=provider))
        return out

    def _on_call_end(self, event: ToolCallEnd) -> list[Frame]:
        call = self._calls.get(event.index)
        if call is None or not call.started:
            return []  # an unknown tool: nothing until its ToolResult says so
        arguments = _json_object("".join(call.arguments))
        if arguments is None:
            return []  # not an object: its ToolResult is the failure
        call.argued = True
        return [
            _frame(
                "tool_call.arguments",
                tool=call.name,
                arguments=arguments,
                provider_info=self._providers[call.name],
            )
        ]

    def _on_result(self, event: ToolResult) -> list[Frame]:
        out = self._close_block()
        call = self._calls.pop(event.index, None)
        provider = event.provider or self._providers.get(event.name)
        if event.failure is None:
            arguments = event.arguments if event.arguments is not None else {}
            if provider is not None:  # a call the model's events did not announce
                if call is None or not call.started:
                    out.append(_frame("tool_call.start", tool=event.name, provider_info=provider))
                if call is None or not call.argued:
                    out.append(
                        _frame(
                            "tool_call.arguments",
                            tool=event.name,
                            arguments=arguments,
                            provider_info=provider,
                        )
                    )
            fields: dict[str, Any] = {
                "tool": event.name,
                "arguments": arguments,
                "output": event.output if event.output is not None else "",
            }
            if provider is not None:
                fields["provider_info"] = provider
            out.append(_frame("tool_call.success", **fields))
            self._items.append({"type": "tool_call", **fields})
            return out
        metadata: dict[str, Any] = {"type": event.failure, "tool_name": event.name}
        if event.failure != "invalid_name":
            if event.arguments is not None:
                metadata["arguments"] = event.arguments
            if provider is not None:
                metadata["provider_info"] = provider
        reason = event.reason or _default_reason(event)
        out.append(_frame("tool_call.failure", reason=reason, metadata=metadata))
        self._items.append({"type": "invalid_tool_call", "reason": reason, "metadata": metadata})
        return out

    # -- the end of a round, of the response ----------------------------------------

    def _on_finish(self, event: Finish) -> list[Frame]:
        # A round's prompt was processed even if it wrote nothing; no block spans rounds.
        out = self._settle_load() + self._settle_prompt() + self._close_block()
        self._pending_tokens = 0
        if event.usage is not None:
            self._input_tokens = event.usage.prompt_tokens
            self._finished_tokens += event.usage.completion_tokens
        else:
            self._finished_tokens += self._round_tokens
        self._round_tokens = 0
        self._round_finished = True
        return out

    def _chat_end(self) -> list[Frame]:
        self._final = self._body(list(self._items))
        return [_frame("chat.end", result=self._final)]

    def _body(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model_instance_id": self.model_instance_id,
            "output": output,
            "stats": self._stats(),
        }
        if self.response_id is not None:
            body["response_id"] = self.response_id
        return body

    def _stats(self) -> dict[str, Any]:
        total = self._finished_tokens + self._round_tokens
        span = 0.0
        if self._first_token_at is not None and self._last_token_at is not None:
            span = self._last_token_at - self._first_token_at
        stats: dict[str, Any] = {
            "input_tokens": self._input_tokens,
            "total_output_tokens": total,
            "reasoning_output_tokens": min(self._reasoning_tokens, total),
            "tokens_per_second": round(total / span, 2) if span > 0 else 0.0,
            "time_to_first_token_seconds": self._ttft if self._ttft is not None else 0.0,
        }
        if self._load_time is not None:
            stats["model_load_time_seconds"] = self._load_time
        return stats


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _default_reason(event: ToolResult) -> str:
    if event.failure == "invalid_name":
        return f"Cannot find tool with name {event.name}."
    if event.failure == "invalid_arguments":
        return f"Invalid arguments for tool {event.name}."
    return f"Tool {event.name} failed."
