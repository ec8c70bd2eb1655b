"""OpenAI's Responses API: ``/v1/responses`` with stored responses, background mode,
resumable streams and cancel.

``POST /v1/responses``, in order:

1. Before any byte (a real status, OpenAI's error body): the body is read and
   parsed; a model of an upstream with ``native_apis = ["responses"]`` gets it as
   written (only ``model`` renamed) and its bytes come back. Otherwise it is
   validated; ``previous_response_id`` must name a stored response of this caller
   (its messages are the history, its instructions are not carried over); images
   for a local model are a 400.
2. Then one of three ways:

   * ``background``: the response is registered as a run (``server/runs.py``) and
     the call answers at once (status ``queued``); the run acquires the model,
     generates, and stores the response when it ends. ``stream: true`` follows the
     run from its first event.
   * stored and streamed: the model is acquired and the request opened here (so a
     prompt over the context is still a 400), then it generates as a run the
     client follows: a client that drops can resume with
     ``GET /v1/responses/{id}?stream=true&starting_after=N`` within
     ``--resume-grace`` seconds (the run keeps generating that long for it).
   * otherwise the answer streams or folds like any dialect's
     (``server/respond.py``), and is stored at its end when ``store`` is true.

``GET /v1/responses/{id}`` answers a live run's current state or the stored
response; with ``stream=true`` it replays the run's events after ``starting_after``
and follows it live. ``POST /v1/responses/{id}/cancel`` stops a background
response (status ``cancelled``). ``DELETE`` forgets it; ``GET .../input_items``
lists its input. Another key's response is a 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sluice.core.backend import ResponseStream
from sluice.core.errors import (
    InvalidRequest,
    NotFound,
    RequestCancelled,
    SluiceError,
    as_sluice_error,
)
from sluice.core.events import ErrorEvent
from sluice.core.request import GenerationRequest
from sluice.dialects.responses.format import (
    RESPONSE_PREFIX,
    ResponseFields,
    ResponsesFormatter,
    error_response,
    new_id,
)
from sluice.dialects.responses.resume import ResponsesPartial
from sluice.dialects.responses.schema import ResponsesRequest, parse
from sluice.dialects.responses.shared import (
    cancel_elsewhere,
    folded,
    follow_stored,
    relay_for,
    shared,
    terminal_frame,
)
from sluice.metrics import ResponsesEventTap
from sluice.models.dispatch import SlotLease, UpstreamTarget
from sluice.models.flights import identify
from sluice.server.auth import key_name
from sluice.server.respond import CLIENT_GONE, forward, respond
from sluice.server.runs import Run
from sluice.server.sse import (
    SSEResponse,
    encode,
    error_frame,
    json_response,
    sse_stream,
)
from sluice.server.state import ServerState, read_json, server_state
from sluice.store import NewMessage, StoredResponse
from sluice.store.recorder import history_messages
from sluice.upstream.backend import slot_header

log = logging.getLogger("sluice.api")

NATIVE = "responses"  # an upstream's native_apis entry for this dialect


class ResponseNotFound(NotFound):
    """No response with this id for this caller (another key's is not found either)."""

    def __init__(self, response_id: str, param: str = "response_id") -> None:
        super().__init__(f"No response with id '{response_id}' was found.", param=param)


@dataclass(slots=True)
class _Prepared:
    body: ResponsesRequest
    request: GenerationRequest
    owner: str
    parent_id: str | None  # the continued response (its message in the tree)
    conversation_id: str | None
    input_items: list[dict[str, Any]]


def _fields(body: ResponsesRequest, response_id: str) -> ResponseFields:
    tools = [t for t in body.tools or () if isinstance(t, dict)]
    return ResponseFields(
        id=response_id,
        model=body.model or "",
        background=body.background,
        store=body.store,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=tools,
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text=body.text or {"format": {"type": "text"}},
        reasoning=(
            body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None}
        ),
        metadata=body.metadata or {},
        truncation=body.truncation or "disabled",
        user=body.user,
    )


def _with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as ``input_items`` lists them: each with an id."""
    out = []
    for item in items:
        item = dict(item)
        item.setdefault("type", "message")
        if "id" not in item:
            item["id"] = new_id("msg_" if item["type"] == "message" else "item_")
        out.append(item)
    return out


async def _prepare(request: Request, state: ServerState, data: dict[str, Any]) -> _Prepared:
    body = await state.offload.run(lambda: parse(data))
    owner = key_name(request)
    history: list[dict[str, Any]] = []
    parent_id = conversation_id = None
    if body.previous_response_id is not None:
        stored = await state.store.get_response(body.previous_response_id, owner=owner)
        if stored is None:
            raise ResponseNotFound(body.previous_response_id, param="previous_response_id")
        path = await state.store.path(stored.id)
        # The previous instructions are not carried over (OpenAI's rule).
        history = [m for m in history_messages(path) if m["role"] != "system"]
        parent_id, conversation_id = stored.id, stored.conversation_id
    neutral = await state.offload.run(lambda: body.neutral_request(history))
    return _Prepared(body, neutral, owner, parent_id, conversation_id, _with_ids(body.items()))


def _transcript(formatter: ResponsesFormatter) -> NewMessage:
    """The response's output as one assistant message (its id is the response's)."""
    text, reasoning, calls = [], [], []
    for item in formatter.items:
        whole = "".join(item.pieces)
        if item.kind == "message":
            text.append(whole)
        elif item.kind == "reasoning":
            reasoning.append(whole)
        else:
            calls.append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": whole},
                }
            )
    status = {"completed": "complete", "failed": "failed"}.get(formatter.status, "incomplete")
    return NewMessage(
        role="assistant",
        content="".join(text),
        reasoning="".join(reasoning) or None,
        tool_calls=calls or None,
        status=status,  # type: ignore[arg-type]
        model=formatter.fields.model,
        error=(formatter.failure or {}).get("message"),
        id=formatter.fields.id,
    )


async def _store(state: ServerState, p: _Prepared, formatter: ResponsesFormatter) -> None:
    """The response and its messages (what a later ``previous_response_id`` continues)."""
    if not p.body.store:
        return
    try:
        new: list[NewMessage] = []
        if p.body.instructions:
            new.append(NewMessage(role="system", content=p.body.instructions))
        for m in p.body.input_messages():
            new.append(
                NewMessage(
                    role=m["role"],
                    content=m.get("content"),
                    reasoning=m.get("reasoning_content"),
                    tool_calls=m.get("tool_calls"),
                    tool_call_id=m.get("tool_call_id"),
                )
            )
        new.append(_transcript(formatter))
        if p.parent_id is not None:
            new[0] = dataclasses.replace(new[0], parent_id=p.parent_id)
        conversation_id = p.conversation_id
        if conversation_id is None:
            conversation = await state.store.create_conversation(
                owner=p.owner, user_id=None, model=p.body.model
            )
            conversation_id = conversation.id
        await state.store.add_messages(conversation_id, new)
        await state.store.put_response(
            StoredResponse(
                id=formatter.fields.id,
                owner=p.owner,
                conversation_id=conversation_id,
                body=formatter.response(),
                input_items=p.input_items,
                created_at=time.time(),
            )
        )
    except SluiceError as exc:
        log.error("storing response %s failed: %s", formatter.fields.id, exc.message)
    except Exception:
        log.exception("storing response %s failed", formatter.fields.id)


async def _store_queued(state: ServerState, p: _Prepared, created: dict[str, Any]) -> None:
    try:
        await state.store.put_response(
            StoredResponse(
                id=created["id"],
                owner=p.owner,
                conversation_id=None,
                body=created,
                input_items=p.input_items,
                created_at=time.time(),
            )
        )
    except SluiceError as exc:
        log.error("storing response %s failed: %s", created["id"], exc.message)


def _encode(frames: list[Any]) -> list[bytes]:
    return [encode(frame) for frame in frames]


async def _generate(
    run: Run,
    state: ServerState,
    p: _Prepared,
    formatter: ResponsesFormatter,
    opened: tuple[SlotLease, ResponseStream] | None,
) -> None:
    """A run's work: acquire (unless ``opened``), generate, publish, store."""
    lease = stream = None
    try:
        if opened is None:
            try:
                lease, stream = await state.dispatcher.open(p.request)
            except SluiceError as exc:
                run.publish(_encode(formatter.error(exc)))
                return
        else:
            lease, stream = opened
        identify(stream, run.id)
        async for event in stream:
            if isinstance(event, ErrorEvent):
                if isinstance(as_sluice_error(event.error), RequestCancelled):
                    run.publish(_encode(formatter.cancel()))  # /v1/requests/{id}/cancel
                else:
                    run.publish(_encode(formatter.error(event.error)))
                return
            frames = formatter.frames(event)
            if frames:
                run.publish(_encode(frames))
        run.publish(_encode(formatter.end()))
    except asyncio.CancelledError:
        run.publish(_encode(formatter.cancel()))
        raise
    finally:
        try:
            if stream is not None:
                await asyncio.shield(stream.aclose())
        finally:
            if lease is not None:
                lease.release()
            relay = relay_for(state.runs, state.store) if run.tap is not None else None
            if relay is not None:  # its events are all stored before its end is
                await asyncio.shield(relay.drain(run))
            await asyncio.shield(_store(state, p, formatter))


async def create(request: Request) -> Response:
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    target = _native(state, data)
    if target is not None:
        return await _passthrough(request, target, data)
    p = await _prepare(request, state, data)
    body = p.body
    response_id = new_id(RESPONSE_PREFIX)
    formatter = ResponsesFormatter(_fields(body, response_id))
    grace = state.settings.resume_grace

    if body.background:
        started = formatter.start()
        created = formatter.response() | {"status": "queued"}
        # Stored at once: after a restart the id still answers (server.app marks what a
        # stopped server left unfinished as failed).
        await _store_queued(state, p, created)
        run = state.runs.start(
            response_id,
            owner=p.owner,
            background=True,
            grace=grace,
            work=lambda r: _generate(r, state, p, formatter, None),
            state=(formatter, p),
        )
        relay = relay_for(state.runs, state.store)
        if relay is not None:  # a shared store: other instances resume and cancel it
            relay.attach(run)
        run.publish(_encode(started))
        if body.stream:
            return _follow(state, run, -1)
        return json_response(created)

    # Knowable before the first byte: a real status (a prompt over the context: a 400).
    lease, stream = await state.dispatcher.open(p.request)
    identify(stream, response_id)
    headers = {"x-sluice-slot": slot_header(stream.meta.slot, stream.meta.replica)}
    if body.stream and body.store:
        run = state.runs.start(
            response_id,
            owner=p.owner,
            background=False,
            grace=grace,
            work=lambda r: _generate(r, state, p, formatter, (lease, stream)),
            state=(formatter, p),
        )
        run.publish(_encode(formatter.start()))
        return _follow(state, run, -1, headers)

    async def close() -> None:
        try:
            await stream.aclose()
        finally:
            lease.release()
            if not formatter.ended:  # the client went away: nothing more comes
                formatter.cancel()
            await _store(state, p, formatter)

    async def frames() -> AsyncIterator[bytes]:
        for frame in formatter.start():
            yield encode(frame)
        async for chunk in sse_stream(stream, formatter):
            yield chunk

    async def fold() -> dict[str, Any]:
        formatter.start()
        async for event in stream:
            if isinstance(event, ErrorEvent):
                formatter.error(event.error)  # stored as failed; the answer is the error
                raise as_sluice_error(event.error)
            formatter.frames(event)
        formatter.end()
        return formatter.response()

    return await respond(
        request,
        state.settings,
        stream=body.stream,
        frames=frames,
        fold=fold,
        close=close,
        headers=lambda: headers,
    )


def _follow(
    state: ServerState, run: Run, starting_after: int, headers: dict[str, str] | None = None
) -> Response:
    """An SSE response that follows ``run`` from frame ``starting_after + 1``; the run
    goes on when the client leaves."""
    return SSEResponse(  # type: ignore[return-value]
        run.follow(starting_after),
        on_close=lambda: None,
        ping_interval=state.settings.ping_interval,
        stall_timeout=state.settings.stall_timeout,
        headers=headers,
    )


def _terminal(state: ServerState, body: dict[str, Any], starting_after: int) -> Response:
    """A stream of a response whose events are no longer kept (past --resume-grace, or
    left by a stopped server): its terminal event, with the response as it ended."""

    async def one() -> AsyncIterator[bytes]:
        yield terminal_frame(body, starting_after + 1)

    return _sse(state, one())


def _sse(state: ServerState, chunks: AsyncIterator[bytes]) -> Response:
    return SSEResponse(  # type: ignore[return-value]
        chunks,
        on_close=lambda: None,
        ping_interval=state.settings.ping_interval,
        stall_timeout=state.settings.stall_timeout,
    )


async def _find(
    request: Request,
) -> tuple[ServerState, str, str, Run | None, StoredResponse | None]:
    state = server_state(request)
    response_id = request.path_params["response_id"]
    owner = key_name(request)
    run = state.runs.get(response_id, owner=owner)
    if (  # ended here and stored, then deleted through another instance: its log goes too
        run is not None
        and run.done
        and state.store.shared
        and _current(run, None).get("store")
        and await state.store.get_response(response_id, owner=owner) is None
    ):
        state.runs.forget(response_id)
        run = None
    stored = None if run is not None else await state.store.get_response(response_id, owner=owner)
    if run is None and stored is None:
        raise ResponseNotFound(response_id)
    return state, response_id, owner, run, stored


def _current(run: Run | None, stored: StoredResponse | None) -> dict[str, Any]:
    if run is not None:
        formatter, _ = run.state
        return dict(formatter.response())
    assert stored is not None
    return stored.body


async def retrieve(request: Request) -> Response:
    state, response_id, owner, run, stored = await _find(request)
    if request.query_params.get("stream") in ("true", "1"):
        raw = request.query_params.get("starting_after", "-1")
        try:
            starting_after = int(raw)
        except ValueError:
            raise InvalidRequest(
                f"'starting_after' must be an integer, not {raw[:32]!r}", param="starting_after"
            ) from None
        if run is None:
            assert stored is not None
            events = shared(state.store)
            if events is not None:  # it may run (or have run) on another instance
                return _sse(state, follow_stored(events, response_id, owner, starting_after))
            return _terminal(state, stored.body, starting_after)
        return _follow(state, run, starting_after)
    body = _current(run, stored)
    events = shared(state.store)
    if run is None and events is not None and body.get("status") in ("queued", "in_progress"):
        # Generating on another instance: as far as its events tell.
        got = await events.events_after(response_id, owner=owner, after=-1)
        if got is not None and got.unfinished:
            body = folded(got.body, [frame for _, frame in got.frames])
    return json_response(body)


async def cancel(request: Request) -> Response:
    state, response_id, owner, run, stored = await _find(request)
    body = _current(run, stored)
    if not body.get("background"):
        raise InvalidRequest(
            "Only responses created with 'background': true can be cancelled.", param="response_id"
        )
    if run is not None and not run.done:
        run.cancel()
        await run.wait()
        body = _current(run, None)
    elif run is None and body.get("status") in ("queued", "in_progress"):
        events = shared(state.store)
        if events is not None:  # running on another instance: it is asked to stop
            ended = await cancel_elsewhere(state.store, events, response_id, owner)
            body = ended if ended is not None else body
    return json_response(body)


async def delete(request: Request) -> Response:
    state, response_id, owner, run, stored = await _find(request)
    if run is not None:
        run.cancel()
        await run.wait()
        state.runs.forget(response_id)
    elif stored is not None and stored.body.get("status") in ("queued", "in_progress"):
        # Running on another instance: stopped first, or its end would store it again.
        events = shared(state.store)
        if events is not None:
            await cancel_elsewhere(state.store, events, response_id, owner)
    await state.store.delete_response(response_id, owner=owner)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(request: Request) -> Response:
    state, response_id, owner, run, stored = await _find(request)
    if stored is None:
        stored = await state.store.get_response(response_id, owner=owner)
    if stored is None:  # still generating: its input is stored with it at the end
        assert run is not None
        items: list[dict[str, Any]] = run.state[1].input_items
    else:
        items = stored.input_items
    return json_response(
        {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": False,
        }
    )


# -- native upstreams --------------------------------------------------------------------


def _native(state: ServerState, data: dict[str, Any]) -> UpstreamTarget | None:
    return state.dispatcher.native(data.get("model"), NATIVE)


async def _passthrough(request: Request, target: UpstreamTarget, data: dict[str, Any]) -> Response:
    state = server_state(request)
    data["model"] = target.model
    raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    accept = request.headers.get("accept")
    answer = await state.dispatcher.passthrough(
        target,
        "/responses",
        raw,
        {"accept": accept} if accept else None,
        tap=ResponsesEventTap,
        conversation=data,
        session=request.headers,
        key_ids=True,  # previous_response_id: to the replica that stored it
        # A foreground stream dropped mid-answer: continued through the slot's chat.
        resumable=ResponsesPartial if data.get("stream") and not data.get("background") else None,
    )
    return await forward(
        request, state.settings, answer, failure_frame=error_frame, render_error=error_response
    )
