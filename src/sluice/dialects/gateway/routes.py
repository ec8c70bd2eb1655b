"""Server-side conversations (the gateway's ``/c1``): the client sends only the new message.

``POST /c1/chat`` continues (``conversation_id``) or starts a conversation,
answers in the OpenAI chat shape, streamed or not, and names the
conversation in the ``x-conversation-id`` header. With ``parent_id`` it
continues from an earlier message instead of the head (``null``: from the
start): a branch, which becomes the main line. ``system`` sets a system
prompt where a conversation starts, stored before the first message. A conversation belongs to
the API key (and ``user_id``) that made it: anyone else gets 404
``conversation_not_found``, never a 403 that would confirm it exists.

Order of a turn: the body is validated against the history and the model
opens the stream (every error knowable before the first byte is a real
status, and nothing is stored); then the user's message is committed; then
the answer streams; the recorder stores it when it ends, however it ends.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.backend import ResponseStream
from sluice.core.errors import ConversationNotFound, InvalidRequest, SluiceError
from sluice.core.request import GenerationRequest
from sluice.dialects.openai.format import ChatStreamFormatter, ResponseMeta, chat_completion_body
from sluice.dialects.openai.schema import ChatCompletionRequest, ChatMessage
from sluice.models.dispatch import SlotLease
from sluice.models.flights import identify
from sluice.server.auth import key_name
from sluice.server.body import read_request_body
from sluice.server.jsonbody import (
    BodyLimits,
    check_body_limits,
    field_path,
    parse_json_body,
    paused_gc,
    validate_body,
)
from sluice.server.respond import respond
from sluice.server.sse import (
    error_response,
    json_response,
    sse_stream,
    wants_sse,
)
from sluice.server.state import ServerState, server_state
from sluice.store import ROOT, Conversation, Message, NewMessage
from sluice.store.recorder import Recorder, history_messages
from sluice.upstream.backend import slot_header

log = logging.getLogger("sluice.api")

MAX_PAGE = 100
MAX_TITLE_CHARS = 200
_UNSET = object()


@dataclass(slots=True)
class _Turn:
    """A ``/c1/chat`` body: the new message, where it goes, the rest as a chat request."""

    stream: bool
    message: Any
    conversation_id: str | None
    user_id: str | None
    parent_id: Any  # _UNSET (the head), None (a new root) or a message id
    system: str | None  # a system prompt, stored before the message (at a start only)
    rest: dict[str, Any]


def _read_turn(raw: bytes, limits: BodyLimits) -> _Turn:
    with paused_gc():
        data = parse_json_body(raw, limits)
    if "messages" in data:
        raise InvalidRequest(
            "'messages' is not taken on /c1/chat: send the new turn as 'message'; "
            "the server keeps the history",
            param="messages",
        )
    if "message" not in data:
        raise InvalidRequest("'message' is required: the new user turn", param="message")
    message = data.pop("message")
    try:
        ChatMessage.model_validate({"role": "user", "content": message})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = field_path(first["loc"][1:], message)
        raise InvalidRequest(
            f"Invalid 'message{('.' + where) if where and not where.startswith('[') else where}'"
            f": {first['msg']} (a string or OpenAI content parts)",
            param="message",
        ) from exc
    if message is None or message == "" or message == []:
        raise InvalidRequest("'message' must not be empty", param="message")
    ids: dict[str, str | None] = {}
    for field in ("conversation_id", "user_id"):
        value = data.pop(field, None)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise InvalidRequest(f"'{field}' must be a non-empty string", param=field)
        ids[field] = value
    parent_id = data.pop("parent_id", _UNSET)
    if parent_id is not _UNSET:
        if ids["conversation_id"] is None:
            raise InvalidRequest(
                "'parent_id' needs 'conversation_id': it names a message of that conversation",
                param="parent_id",
            )
        if parent_id is not None and (not isinstance(parent_id, str) or not parent_id.strip()):
            raise InvalidRequest(
                "'parent_id' must be a message id, or null to branch from the start",
                param="parent_id",
            )
    system = data.pop("system", None)
    if system is not None:
        if not isinstance(system, str) or not system.strip():
            raise InvalidRequest("'system' must be a non-empty string", param="system")
        if ids["conversation_id"] is not None and parent_id is not None:
            raise InvalidRequest(
                "'system' is set where a conversation starts: without 'conversation_id', "
                "or with 'parent_id': null (a new first message)",
                param="system",
            )
    if data.get("n", 1) != 1:
        raise InvalidRequest("'n' must be 1 on /c1/chat: a conversation has one answer", param="n")
    return _Turn(
        stream=data.get("stream") is True,
        message=message,
        conversation_id=ids["conversation_id"],
        user_id=ids["user_id"],
        parent_id=parent_id,
        system=system,
        rest=data,
    )


def _chat_request(turn: _Turn, history: list[dict[str, Any]], limits: BodyLimits) -> Any:
    """The turn as an OpenAI chat request over the whole history (on a worker thread)."""
    data = dict(turn.rest)
    opening = [] if turn.system is None else [{"role": "system", "content": turn.system}]
    data["messages"] = [*opening, *history, {"role": "user", "content": turn.message}]
    check_body_limits(data, limits)
    body = validate_body(data, ChatCompletionRequest)
    return body, body.to_request()


async def chat(request: Request) -> Response:
    state = server_state(request)
    raw = await read_request_body(request, state.settings.max_body_bytes, lambda: state.draining)
    if raw is None:
        return Response(status_code=499)
    owner = key_name(request)
    try:
        turn = await state.offload.run(lambda: _read_turn(raw, state.limits))
    except SluiceError as exc:
        return error_response(exc)
    sse = turn.stream and wants_sse(request)
    conversation: Conversation | None = None
    history: list[dict[str, Any]] = []
    try:
        if turn.conversation_id is not None:
            conversation = await state.store.get_conversation(
                turn.conversation_id, owner=owner, user_id=turn.user_id
            )
            if conversation is None:
                raise ConversationNotFound(turn.conversation_id)
            tip = conversation.head_id if turn.parent_id is _UNSET else turn.parent_id
            if tip is not None:
                path = await state.store.path(tip)
                if not path or path[-1].conversation_id != conversation.id:
                    raise InvalidRequest(
                        f"No message '{tip}' in conversation '{conversation.id}'",
                        param="parent_id",
                    )
                history = history_messages(path)
        body, neutral = await state.offload.run(lambda: _chat_request(turn, history, state.limits))
        lease, stream = await state.dispatcher.open(neutral, ttl=body.ttl)
    except SluiceError as exc:
        return error_response(exc, sse=sse)
    try:
        # The user's message is durable before the first byte of the answer.
        if conversation is None:
            # The name asked for, or (none asked: the default) the one that answers.
            model = neutral.model or stream.meta.model
            conversation = await state.store.create_conversation(
                owner=owner, user_id=turn.user_id, model=model
            )
        parent = (
            None if turn.parent_id is _UNSET else ROOT if turn.parent_id is None else turn.parent_id
        )
        turns = [NewMessage(role="user", content=turn.message)]
        if turn.system is not None:
            turns.insert(0, NewMessage(role="system", content=turn.system))
        turns[0] = dataclasses.replace(turns[0], parent_id=parent)  # the rest chain on
        user = (await state.store.add_messages(conversation.id, turns))[-1]
    except BaseException:
        await stream.aclose()
        lease.release()
        raise
    return await _answer(request, state, body, neutral, stream, lease, conversation, user)


async def _answer(
    request: Request,
    state: ServerState,
    body: ChatCompletionRequest,
    neutral: GenerationRequest,
    stream: ResponseStream,
    lease: SlotLease,
    conversation: Conversation,
    user: Message,
) -> Response:
    recorder = Recorder(stream, state.store, conversation.id, user.id)
    meta = ResponseMeta.of(
        stream.meta,
        chat=True,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
    )
    identify(stream, meta.id)
    headers = {
        "x-conversation-id": conversation.id,
        "x-sluice-slot": slot_header(stream.meta.slot, stream.meta.replica),
    }

    async def close() -> None:
        try:
            await recorder.aclose()  # stores the turn: complete, cut by the client, or failed
        finally:
            lease.release()

    async def fold() -> dict[str, Any]:
        async for _ in recorder:
            pass
        if recorder.error is not None:
            raise recorder.error
        return chat_completion_body(meta, recorder.result())

    # Not streamed: the turn is stored before the answer is sent (close runs first), so
    # an acknowledged turn is durable.
    return await respond(
        request,
        state.settings,
        stream=body.stream,
        frames=lambda: sse_stream(recorder, ChatStreamFormatter(meta)),
        fold=fold,
        close=close,
        headers=lambda: headers,
        error_headers={"x-conversation-id": conversation.id},
    )


# -- the conversations ------------------------------------------------------------------


def _conversation(c: Conversation) -> dict[str, Any]:
    return {
        "id": c.id,
        "object": "conversation",
        "created_at": int(c.created_at),
        "updated_at": int(c.updated_at),
        "model": c.model,
        "user_id": c.user_id,
        "title": c.title,
        "head_id": c.head_id,
        "message_count": c.message_count,
    }


def _message(m: Message) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": m.id,
        "object": "conversation.message",
        "parent_id": m.parent_id,
        "role": m.role,
        "content": m.content,
        "created_at": int(m.created_at),
        "status": m.status,
    }
    optional = {
        "model": m.model,
        "reasoning_content": m.reasoning,
        "tool_calls": m.tool_calls,
        "tool_call_id": m.tool_call_id,
        "name": m.name,
        "finish_reason": m.finish_reason,
        "usage": m.usage,
        "error": m.error,
    }
    entry.update({k: v for k, v in optional.items() if v is not None})
    return entry


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidRequest(f"'{name}' must be an integer, not {text!r}", param=name) from None
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}", param=name)
    return value


async def list_conversations(request: Request) -> Response:
    state = server_state(request)
    limit = _int_param(request, "limit", 20, 1, MAX_PAGE)
    offset = _int_param(request, "offset", 0, 0, 2**31)
    user_id = request.query_params.get("user_id")
    page, total = await state.store.list_conversations(
        owner=key_name(request), user_id=user_id, limit=limit, offset=offset
    )
    return json_response(
        {
            "object": "list",
            "data": [_conversation(c) for c in page],
            "total": total,
            "limit": limit,
            "offset": offset,
            "has_more": offset + len(page) < total,
        }
    )


async def _owned(request: Request) -> Conversation:
    state = server_state(request)
    conversation_id = request.path_params["conversation_id"]
    conversation = await state.store.get_conversation(
        conversation_id, owner=key_name(request), user_id=request.query_params.get("user_id")
    )
    if conversation is None:
        raise ConversationNotFound(conversation_id)
    return conversation


async def get_conversation(request: Request) -> Response:
    conversation = await _owned(request)
    messages = await server_state(request).store.messages(conversation.id)
    return json_response(
        _conversation(conversation) | {"messages": [_message(m) for m in messages]}
    )


async def delete_conversation(request: Request) -> Response:
    conversation = await _owned(request)
    await server_state(request).store.delete_conversation(
        conversation.id, owner=conversation.owner, user_id=conversation.user_id
    )
    return json_response({"id": conversation.id, "object": "conversation.deleted", "deleted": True})


def _read_title(raw: bytes, limits: BodyLimits) -> str | None:
    with paused_gc():
        data = parse_json_body(raw, limits)
    unknown = sorted(set(data) - {"title"})
    if unknown:
        raise InvalidRequest(
            f"Unknown field '{unknown[0]}': only 'title' can be changed", param=unknown[0]
        )
    if "title" not in data:
        raise InvalidRequest("'title' is required (a string, or null to clear it)", param="title")
    title = data["title"]
    if title is None:
        return None
    if not isinstance(title, str):
        raise InvalidRequest("'title' must be a string or null", param="title")
    title = " ".join(title.split())  # one line: it is a list entry
    if not title:
        raise InvalidRequest("'title' must not be blank (null clears it)", param="title")
    if len(title) > MAX_TITLE_CHARS:
        raise InvalidRequest(
            f"'title' is {len(title)} characters; at most {MAX_TITLE_CHARS}", param="title"
        )
    return title


async def update_conversation(request: Request) -> Response:
    """``PATCH /c1/conversations/{id}`` with ``{"title": ...}``: rename it (null clears)."""
    state = server_state(request)
    conversation = await _owned(request)
    raw = await read_request_body(request, state.settings.max_body_bytes, lambda: state.draining)
    if raw is None:
        return Response(status_code=499)
    title = _read_title(raw, state.limits)
    renamed = await state.store.rename_conversation(
        conversation.id, owner=conversation.owner, user_id=conversation.user_id, title=title
    )
    if renamed is None:  # deleted meanwhile
        raise ConversationNotFound(conversation.id)
    return json_response(_conversation(renamed))
