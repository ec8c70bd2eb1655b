"""The recorder stores a turn when its events end: before the dialect's closing frames."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sluice.core.backend import StreamMeta
from sluice.core.errors import EngineFailure
from sluice.core.events import ErrorEvent, Event, Finish, Start, TextDelta, Usage
from sluice.store import NewMessage, SQLiteStore
from sluice.store.recorder import Recorder


class Scripted:
    def __init__(self, events: list[Event]) -> None:
        self.meta = StreamMeta(model="m", choices=1, prompt_owners=frozenset({0}), slot="m")
        self.events = events
        self.closed = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[Event]:
        for event in self.events:
            yield event

    async def aclose(self) -> None:
        self.closed = True


ANSWER: list[Event] = [
    Start(0, 3),
    TextDelta(0, "Hel", 1),
    TextDelta(0, "lo", 1),
    Finish(0, "stop", Usage(0, 3, 2)),
]


async def _setup() -> tuple[SQLiteStore, str, str]:
    store = await SQLiteStore.open(":memory:")
    conversation = await store.create_conversation(owner="", user_id=None, model="m")
    user = await store.add_message(conversation.id, NewMessage(role="user", content="Hi"))
    return store, conversation.id, user.id


async def test_the_turn_is_stored_when_the_events_end_before_aclose() -> None:
    store, conversation, user = await _setup()
    recorder = Recorder(Scripted(ANSWER), store, conversation, user)
    async for _ in recorder:
        pass
    # The formatter sends [DONE] now: the answer must already be in the store.
    messages = await store.messages(conversation)
    assert [(m.role, m.content, m.status) for m in messages] == [
        ("user", "Hi", "complete"),
        ("assistant", "Hello", "complete"),
    ]
    assert messages[1].parent_id == user and messages[1].usage is not None
    await recorder.aclose()  # stores nothing twice
    assert len(await store.messages(conversation)) == 2
    await store.close()


async def test_an_error_is_stored_before_the_error_frame() -> None:
    store, conversation, user = await _setup()
    events = [*ANSWER[:2], ErrorEvent(EngineFailure("boom"))]
    recorder = Recorder(Scripted(events), store, conversation, user)
    async for event in recorder:
        if isinstance(event, ErrorEvent):
            failed = (await store.messages(conversation))[-1]
            assert (failed.status, failed.content, failed.error) == ("failed", "Hel", "boom")
    await recorder.aclose()
    assert len(await store.messages(conversation)) == 2
    await store.close()


async def test_a_client_that_leaves_early_gets_an_incomplete_turn() -> None:
    store, conversation, user = await _setup()
    source = Scripted(ANSWER)
    recorder = Recorder(source, store, conversation, user)
    seen = 0
    async for _ in recorder:
        seen += 1
        if seen == 2:
            break
    await recorder.aclose()
    assert source.closed
    last = (await store.messages(conversation))[-1]
    assert (last.status, last.content) == ("incomplete", "Hel")
    await store.close()
