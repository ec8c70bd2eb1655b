"""The recorder: a ``ResponseStream`` wrapper that stores the turn when it ends.

It folds the events as they pass (the same fold a non-streaming answer
uses) and, once the stream is over, writes the assistant's message, with a
status that says how it ended:

* ``complete``: every choice finished;
* ``incomplete``: the client went away first (what was generated is kept);
* ``failed``: the backend failed (an error event), or the stream raised.

Writes happen once per turn, never per token.

Example::

    stream = Recorder(await lease.open(request), store, conversation.id, user_message.id)
    try:
        async for event in stream:
            ...
    finally:
        await stream.aclose()        # records the turn (idempotent)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from sluice.core.backend import ResponseStream, StreamMeta
from sluice.core.errors import SluiceError, as_sluice_error
from sluice.core.events import ErrorEvent, Event, Finish
from sluice.core.fold import Fold, FoldResult
from sluice.store import ConversationStore, Message, MessageStatus, NewMessage

log = logging.getLogger("sluice.serving")


class Recorder:
    """Stores the assistant's turn of ``stream`` under ``parent_id`` when it ends."""

    def __init__(
        self,
        stream: ResponseStream,
        store: ConversationStore,
        conversation_id: str,
        parent_id: str,
    ) -> None:
        self.meta: StreamMeta = stream.meta
        self._stream = stream
        self._store = store
        self._conversation_id = conversation_id
        self._parent_id = parent_id
        self._fold = Fold(stream.meta.prompt_owners)
        self._finished: set[int] = set()
        self._error: SluiceError | None = None
        self._recorded: Message | None = None
        self._closed = False
        self._recording = False  # the turn is being (or has been) stored: only once

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        # The turn is stored as soon as the events end, before the dialect's closing
        # frames ([DONE], the error frame) go out: a client that sends its next turn
        # the moment it has read them must find this one in the history.
        try:
            async for event in self._stream:
                if isinstance(event, ErrorEvent):
                    self._error = as_sluice_error(event.error)
                    await self._record()
                    yield event
                    return
                self._fold.add(event)
                if isinstance(event, Finish):
                    self._finished.add(event.choice)
                yield event
        except SluiceError as exc:
            self._error = exc
            await self._record()
            raise
        await self._record()

    @property
    def error(self) -> SluiceError | None:
        return self._error

    def result(self) -> FoldResult:
        """What was generated so far (the whole answer once the stream has ended)."""
        return self._fold.result()

    @property
    def message(self) -> Message | None:
        """The stored assistant message, once :meth:`aclose` recorded it."""
        return self._recorded

    async def aclose(self) -> None:
        """Abort what still runs, then store the turn if the events did not end yet
        (the client went away: it is stored incomplete). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.aclose()
        finally:
            await self._record()

    async def _record(self) -> None:
        if self._recording:
            return
        self._recording = True
        choice = self._fold.choices.get(0)
        complete = self._error is None and set(range(self.meta.choices)) <= self._finished
        status: MessageStatus = (
            "failed" if self._error is not None else "complete" if complete else "incomplete"
        )
        calls: list[dict[str, Any]] | None = None
        if choice is not None and choice.tool_calls:
            calls = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in choice.calls()
            ]
        message = NewMessage(
            role="assistant",
            content=(choice.content or None) if choice is not None else None,
            parent_id=self._parent_id,
            status=status,
            model=self.meta.model,
            reasoning=choice.reasoning_text if choice is not None else None,
            tool_calls=calls,
            usage=self._fold.result().usage_dict(),
            error=self._error.message if self._error is not None else None,
            finish_reason=choice.finish_reason if choice is not None else None,
        )
        try:
            self._recorded = await self._store.add_message(self._conversation_id, message)
        except Exception:  # the answer went out; losing its record must not crash the stream
            log.exception("could not store the turn of conversation %s", self._conversation_id)


def history_messages(path: list[Message]) -> list[dict[str, Any]]:
    """Stored messages as OpenAI chat messages (what the next turn is templated from).

    A failed turn is skipped: it produced no answer to build on.
    """
    out: list[dict[str, Any]] = []
    for m in path:
        if m.status == "failed":
            continue
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            entry["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        if m.reasoning is not None:
            entry["reasoning_content"] = m.reasoning
        out.append(entry)
    return out
