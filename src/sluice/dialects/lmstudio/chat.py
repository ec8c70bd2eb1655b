"""LM Studio's native chat: ``POST /api/v1/chat``, streamed as named events or not.

Order of a request:

1. Before any byte (a real HTTP status with LM Studio's error body): the body is
   parsed; the model must exist (no fallback to the default, as in LM Studio);
   ``previous_response_id`` must name a stored response of this caller;
   ``reasoning`` must be a setting the model honours; the integrations' MCP
   servers are connected and their tools listed.
2. ``chat.start``; the model is acquired: when this request loads it, the load's
   progress streams as ``model_load.*``; then the model runs, server-side tool
   calls between rounds (``tools/loop.py``); prompt processing, reasoning, the
   message and tool calls stream as they come.
3. The response is stored (unless ``store`` is false) before ``chat.end``, so
   its ``response_id`` can be continued as soon as the client has it. An error
   after the start is an ``error`` event, then still ``chat.end`` with what was
   generated (stored as failed).

Stored responses live in the conversation store: a response is a chain of
messages (the system prompt and user turn of the first request, each round's
assistant message and tool outputs, the final assistant message whose id is the
``response_id``). ``previous_response_id`` continues from that message, so two
follow-ups of one response are two branches of one tree.

Example::

    curl -N localhost:8080/api/v1/chat -d '{"model": "smollm2", "input": "Hi", "stream": true}'
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sluice.core.backend import LoadOptions, ResponseStream
from sluice.core.errors import (
    IntegrationNotAllowed,
    MissingChatTemplate,
    ModelNotFound,
    ResponseNotFound,
    SluiceError,
    as_sluice_error,
)
from sluice.core.events import ErrorEvent, Event, Progress
from sluice.core.request import GenerationRequest
from sluice.dialects.lmstudio.format import LMStudioChatFormatter
from sluice.dialects.lmstudio.routes import _lms_error_response, _lmstudio
from sluice.dialects.lmstudio.schema import ChatRequest, parse, reasoning_switch
from sluice.local.model import LocalModel
from sluice.models.dispatch import SlotLease
from sluice.models.files import read_model_file, reasoning_capability
from sluice.models.flights import identify
from sluice.server.auth import key_name
from sluice.server.body import read_request_body
from sluice.server.jsonbody import parse_json_body
from sluice.server.respond import respond
from sluice.server.sse import encode
from sluice.server.state import ServerState, server_state
from sluice.store import Message, NewMessage
from sluice.store.recorder import history_messages
from sluice.tools.loop import ToolLoop
from sluice.tools.mcp import PluginIntegration, ToolSet, parse_integrations
from sluice.upstream.backend import slot_header

log = logging.getLogger("sluice.api")

RESPONSE_PREFIX = "resp_"
# Load progress is a per-mille count in Progress events (done/total).
_PERMILLE = 1000


def new_response_id() -> str:
    return RESPONSE_PREFIX + secrets.token_hex(24)


@dataclass(slots=True)
class _Prepared:
    """Everything checked before the first byte."""

    body: ChatRequest
    request: GenerationRequest
    instance_id: str  # the model's key (sluice has one instance per model)
    options: LoadOptions | None
    tools: ToolSet | None
    parent: Message | None  # the response continued from (its conversation gets the new turn)
    owner: str


async def _previous(
    state: ServerState, response_id: str, owner: str
) -> tuple[Message, list[Message]]:
    message = await state.store.get_message(response_id)
    if message is None or message.role != "assistant":
        raise ResponseNotFound(response_id)
    conversation = await state.store.get_conversation(
        message.conversation_id, owner=owner, user_id=None
    )
    if conversation is None:  # someone else's: answer as if unknown
        raise ResponseNotFound(response_id)
    return message, await state.store.path(message.id)


async def _capability(state: ServerState, name: str) -> tuple[str, bool, dict[str, Any] | None]:
    """(instance id, local?, reasoning capability) of the model ``name``; ModelNotFound if
    none serves it, MissingChatTemplate if it is a local model that cannot chat."""
    spec = state.registry.find(name)
    if spec is None:
        if state.dispatcher.upstream(name) is not None:
            return name, False, None
        raise ModelNotFound(name)
    loaded = state.registry.get_loaded(spec.name)
    if isinstance(loaded, LocalModel):  # the template in effect, without reading the file
        template = loaded.runner.info.chat_template
    else:
        file = await state.offload.run(lambda: read_model_file(spec, state.settings))
        template = file.template
    if template is None:
        raise MissingChatTemplate(
            f"The model '{spec.name}' has no chat template, so it cannot chat; give it one "
            "(chat_template in its [[models]] entry, or --chat-template)."
        )
    return spec.name, True, reasoning_capability(template)


async def _prepare(request: Request, state: ServerState, raw: bytes) -> _Prepared:
    body = await state.offload.run(lambda: parse(parse_json_body(raw, state.limits), ChatRequest))
    owner = key_name(request)
    instance_id, local, capability = await _capability(state, body.model)
    history: list[dict[str, Any]] = []
    parent: Message | None = None
    if body.previous_response_id is not None:
        parent, path = await _previous(state, body.previous_response_id, owner)
        history = history_messages(path)
        if body.system_prompt is not None:  # this request's system prompt replaces the old
            history = [m for m in history if m["role"] != "system"]
    switch = reasoning_switch(body.reasoning, capability, model=body.model) if local else None
    integrations = parse_integrations(body.integrations) if body.integrations else []
    if not state.auth_required and any(isinstance(i, PluginIntegration) for i in integrations):
        raise IntegrationNotAllowed(
            "MCP plugins run commands on this machine: they are only available when the "
            "server requires API keys (--api-key), as in LM Studio.",
            param="integrations",
        )
    tools = await state.mcp.toolset(integrations) if integrations else None
    try:
        offered = [s.openai_tool() for s in tools.specs] if tools else None
        neutral = body.to_request(history, offered, template_kwargs=switch)
    except BaseException:
        if tools is not None:
            await tools.aclose()
        raise
    return _Prepared(
        body,
        neutral,
        instance_id,
        LoadOptions(ctx=body.context_length) if body.context_length else None,
        tools,
        parent,
        owner,
    )


@_lmstudio
async def chat(request: Request) -> Response:
    state = server_state(request)
    raw = await read_request_body(request, state.settings.max_body_bytes, lambda: state.draining)
    if raw is None:
        return Response(status_code=499)
    prepared = await _prepare(request, state, raw)
    run = _Run(state, prepared)
    return await respond(
        request,
        state.settings,
        stream=prepared.body.stream,
        frames=run.frames,
        fold=run.fold,
        close=run.close,
        headers=lambda: {"x-sluice-slot": run.slot} if run.slot else {},
        render_error=_lms_error_response,
    )


def _release_if_acquired(task: asyncio.Future[SlotLease]) -> None:
    """A lease that came in after its request was cancelled is released at once."""
    if not task.cancelled() and task.exception() is None:
        task.result().release()


class _Run:
    """One chat response: acquire, run the rounds, format, store."""

    def __init__(self, state: ServerState, prepared: _Prepared) -> None:
        self.state = state
        self.p = prepared
        self.response_id = new_response_id() if prepared.body.store else None
        providers = {s.name: s.provider for s in prepared.tools.specs} if prepared.tools else {}
        self.formatter = LMStudioChatFormatter(
            prepared.instance_id, providers=providers, response_id=self.response_id
        )
        self.lease: SlotLease | None = None
        self.stream: ToolLoop | ResponseStream | None = None
        self.slot = ""
        self._stored = False
        self._closed = False
        self._error: SluiceError | None = None

    # -- the events -----------------------------------------------------------------

    async def _acquire(self) -> AsyncIterator[Event]:
        """Load progress while the model is acquired (only if this request loads it)."""
        queue: asyncio.Queue[float] = asyncio.Queue()
        started = time.monotonic()
        last = 0.0

        def progress(fraction: float) -> None:  # on the loop (the registry posts it)
            queue.put_nowait(fraction)

        acquire = asyncio.ensure_future(
            self.state.dispatcher.acquire(
                self.p.request.model, progress=progress, options=self.p.options
            )
        )
        try:
            while not acquire.done():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({acquire, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    fraction = getter.result()
                    # Hundredths: llama.cpp reports every tensor, hundreds of them.
                    if fraction < 1.0 and fraction - last >= 0.01:
                        last = fraction
                        yield Progress(
                            0, "model_load", int(fraction * _PERMILLE), _PERMILLE,
                            elapsed=time.monotonic() - started,
                        )  # fmt: skip
                else:
                    getter.cancel()
            self.lease = acquire.result()
        finally:
            if not acquire.done():  # the client went away while the model loaded
                acquire.cancel()
                acquire.add_done_callback(_release_if_acquired)
        if self.lease.loaded_now:
            seconds = self.lease.load_seconds or (time.monotonic() - started)
            yield Progress(0, "model_load", _PERMILLE, _PERMILLE, elapsed=seconds)

    async def _open(self, request: GenerationRequest) -> ResponseStream:
        """A stream on the lease, in flight under this response's id (when stored)."""
        assert self.lease is not None
        stream = await self.lease.open(request)
        identify(stream, self.response_id)
        return stream

    async def events(self) -> AsyncIterator[Event]:
        try:
            async for event in self._acquire():
                yield event
            assert self.lease is not None
            first = await self._open(self.p.request)
        except SluiceError as exc:
            yield ErrorEvent(exc)
            return
        self.slot = slot_header(first.meta.slot, first.meta.replica)
        if self.p.tools is not None:
            self.stream = ToolLoop(
                first,
                self.p.request,
                self.p.tools,
                reopen=self._open,
                max_rounds=self.state.settings.tool_rounds,
            )
        else:
            self.stream = first
        async for event in self.stream:
            if isinstance(event, ErrorEvent):
                self._error = as_sluice_error(event.error)
            yield event

    async def frames(self) -> AsyncIterator[bytes]:
        for frame in self.formatter.start():
            yield encode(frame)
        async for event in self.events():
            if isinstance(event, ErrorEvent):
                await self._store("failed")
                for frame in self.formatter.error(event.error):
                    yield encode(frame)
                return
            for frame in self.formatter.frames(event):
                yield encode(frame)
        await self._store("complete")
        for frame in self.formatter.end():
            yield encode(frame)

    async def fold(self) -> dict[str, Any] | SluiceError:
        self.formatter.start()
        async for event in self.events():
            if isinstance(event, ErrorEvent):
                await self._store("failed")
                return as_sluice_error(event.error)
            self.formatter.frames(event)
        await self._store("complete")
        self.formatter.end()
        return self.formatter.result()

    # -- storing ----------------------------------------------------------------------

    def _transcript(self) -> list[dict[str, Any]]:
        if isinstance(self.stream, ToolLoop):
            return self.stream.transcript()
        output = self.formatter.result()["output"]
        text = "".join(o["content"] for o in output if o["type"] == "message")
        reasoning = "".join(o["content"] for o in output if o["type"] == "reasoning")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        return [message]

    async def _store(self, status: str) -> None:
        """Store the response (once): the new turn and every message the rounds added."""
        if self._stored or self.response_id is None:
            return
        self._stored = True
        p = self.p
        new: list[NewMessage] = []
        if p.parent is None and p.body.system_prompt is not None:
            new.append(NewMessage(role="system", content=p.body.system_prompt))
        for m in p.body.input_messages():
            new.append(NewMessage(role=m["role"], content=m["content"]))
        transcript = self._transcript()
        for i, m in enumerate(transcript):
            last = i == len(transcript) - 1
            new.append(
                NewMessage(
                    role=m["role"],
                    content=m.get("content"),
                    reasoning=m.get("reasoning_content"),
                    tool_calls=m.get("tool_calls"),
                    tool_call_id=m.get("tool_call_id"),
                    name=m.get("name") if m["role"] == "tool" else None,
                    model=p.instance_id if m["role"] == "assistant" else None,
                    status=status if last else "complete",  # type: ignore[arg-type]
                    error=self._error.message if last and self._error is not None else None,
                    usage=self.formatter.result()["stats"] if last else None,
                    id=self.response_id if last else None,
                )
            )
        if p.parent is not None:
            new[0] = replace(new[0], parent_id=p.parent.id)
        try:
            if p.parent is not None:
                conversation_id = p.parent.conversation_id
            else:
                conversation = await self.state.store.create_conversation(
                    owner=p.owner, user_id=None, model=p.instance_id
                )
                conversation_id = conversation.id
            await self.state.store.add_messages(conversation_id, new)
        except SluiceError as exc:
            log.error("storing response %s failed: %s", self.response_id, exc.message)
            self.formatter.response_id = None  # nothing to continue from
        except Exception:
            log.exception("storing response %s failed", self.response_id)
            self.formatter.response_id = None

    async def close(self) -> None:
        """Abort whatever still runs and release the slot; store a cut-off response."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.stream is not None:
                await self.stream.aclose()
            elif self.p.tools is not None:
                await self.p.tools.aclose()
            if self.stream is not None and not self._stored:
                await self._store("incomplete")
        finally:
            if self.lease is not None:
                self.lease.release()
