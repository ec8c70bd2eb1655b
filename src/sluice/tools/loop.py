"""The tool loop: a ``ResponseStream`` over several model rounds, with the server
running the model's tool calls (MCP) in between.

Round by round: the model's events pass through unchanged (each round has its
own ``Start``, prompt ``Progress`` and ``Finish``); when a round finishes with
``tool_calls``, every call is checked (a known name, arguments that are a JSON
object matching the tool's schema) and run, one ``ToolResult`` each, and the
model is asked again with its calls and their outputs appended to the messages.
The loop ends with the first round that does not call tools, or with
``ToolRoundsExceeded`` after ``max_rounds`` rounds of calls.

A failed call is not the end: the model is told what went wrong (as the tool's
message) and may try again. Closing the loop closes the running round and ends
the request's MCP sessions; a call in progress is cancelled with the task that
awaits it (a client disconnect).

Example::

    loop = ToolLoop(first_stream, request, toolset, reopen=lease.open, max_rounds=8)
    try:
        async for event in loop:
            ...
        loop.transcript()     # the messages this response added, for the store
    finally:
        await loop.aclose()
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import jsonschema

from sluice.core.backend import ResponseStream, StreamMeta
from sluice.core.errors import SluiceError, ToolRoundsExceeded, as_sluice_error
from sluice.core.events import ErrorEvent, Event, ToolResult
from sluice.core.fold import ChoiceState, Fold, ToolCallResult
from sluice.core.request import GenerationRequest
from sluice.tools.mcp import ToolCallFailed, ToolSet, ToolSpec

log = logging.getLogger("sluice.tools")


def assistant_message(state: ChoiceState) -> dict[str, Any]:
    """One folded round as the assistant's chat message (what the next round reads)."""
    message: dict[str, Any] = {"role": "assistant", "content": state.content}
    if state.reasoning_text is not None:
        message["reasoning_content"] = state.reasoning_text
    if state.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in state.calls()
        ]
    return message


def tool_message(call_id: str, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


async def run_call(
    tools: ToolSet, specs: dict[str, ToolSpec], index: int, call: ToolCallResult
) -> ToolResult:
    """Check and run one call; never raises but for cancellation."""
    spec = specs.get(call.name)
    try:
        parsed = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        parsed = None
    arguments = parsed if isinstance(parsed, dict) else None
    if spec is None:
        return ToolResult(
            0, index, call.name, arguments, failure="invalid_name",
            reason=f"Cannot find tool with name {call.name}.",
        )  # fmt: skip
    if arguments is None:
        return ToolResult(
            0, index, call.name, None, failure="invalid_arguments",
            reason=f"The arguments of {call.name} are not a JSON object: {call.arguments[:200]!r}",
            provider=spec.provider,
        )  # fmt: skip
    try:
        jsonschema.validate(arguments, spec.input_schema)
    except jsonschema.ValidationError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path)
        return ToolResult(
            0, index, call.name, arguments, failure="invalid_arguments",
            reason=f"Invalid arguments for {call.name}{(' at ' + where) if where else ''}: "
            f"{exc.message}",
            provider=spec.provider,
        )  # fmt: skip
    except jsonschema.SchemaError:
        log.warning("tool %s has an invalid input schema; arguments not checked", call.name)
    try:
        output = await tools.call(call.name, arguments)
    except ToolCallFailed as exc:
        return ToolResult(
            0, index, call.name, arguments, failure="tool_error",
            reason=str(exc) or f"{call.name} failed", provider=spec.provider,
        )  # fmt: skip
    return ToolResult(0, index, call.name, arguments, output=output, provider=spec.provider)


class ToolLoop:
    """Model rounds with server-side tool calls between them (a ``ResponseStream``)."""

    def __init__(
        self,
        first: ResponseStream,
        request: GenerationRequest,
        tools: ToolSet,
        *,
        reopen: Callable[[GenerationRequest], Awaitable[ResponseStream]],
        max_rounds: int,
    ) -> None:
        self.meta: StreamMeta = first.meta
        self._stream: ResponseStream | None = first
        self._request = request
        self._tools = tools
        self._specs = {spec.name: spec for spec in tools.specs}
        self._reopen = reopen
        self._max_rounds = max(1, max_rounds)
        self._added: list[dict[str, Any]] = []  # messages of finished rounds
        self._round = ChoiceState()  # the running round (choice 0: LM Studio has one)
        self._closed = False

    def transcript(self) -> list[dict[str, Any]]:
        """The messages this response added so far: every round's assistant message
        and its tools' outputs, the last round's message (possibly partial) last."""
        return [*self._added, assistant_message(self._round)]

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        rounds = 0
        while self._stream is not None:
            # The same fold a non-streamed answer uses, for this round's choice 0.
            fold = Fold(self.meta.prompt_owners)
            self._round = fold.choices[0] = ChoiceState()
            async for event in self._stream:
                if isinstance(event, ErrorEvent):
                    yield event
                    return
                fold.add(event)
                yield event
            calls = self._round.tool_calls
            if self._round.finish_reason == "length" and calls:
                # Cut off inside a call: not run, and said so (no dangling tool_call.start).
                for index in sorted(calls):
                    call = calls[index]
                    spec = self._specs.get(call.name)
                    yield ToolResult(
                        0, index, call.name, None, failure="invalid_arguments",
                        reason=f"The output ended (max tokens) before the arguments of "
                        f"{call.name} were complete.",
                        provider=spec.provider if spec is not None else None,
                    )  # fmt: skip
                return
            if self._round.finish_reason != "tool_calls" or not calls:
                return
            rounds += 1
            outputs: list[dict[str, Any]] = []
            for index in sorted(calls):
                call = calls[index]
                result = await run_call(self._tools, self._specs, index, call)
                yield result
                content = result.output if result.failure is None else f"Error: {result.reason}"
                outputs.append(tool_message(call.id, call.name, content or ""))
            self._added += [assistant_message(self._round), *outputs]
            if rounds >= self._max_rounds:
                yield ErrorEvent(
                    ToolRoundsExceeded(
                        f"The model was still calling tools after {rounds} rounds "
                        f"(the limit, --tool-rounds)."
                    )
                )
                return
            assert self._request.messages is not None
            # A forced call (the tool_choice extension) holds for the first round only:
            # the model must be free to answer with what the tools returned.
            choice = self._request.tool_choice
            self._request = replace(
                self._request,
                messages=[*self._request.messages, *self._added[-1 - len(outputs) :]],
                tool_choice="auto" if choice not in (None, "auto", "none") else choice,
            )
            stream, self._stream = self._stream, None
            await stream.aclose()
            try:
                self._stream = await self._reopen(self._request)
            except SluiceError as exc:
                yield ErrorEvent(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a backend bug still ends the stream cleanly
                yield ErrorEvent(as_sluice_error(exc))
                return

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._stream is not None:
                await self._stream.aclose()
        finally:
            await self._tools.aclose()
