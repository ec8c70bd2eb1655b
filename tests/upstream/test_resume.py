"""What a continuation asks another replica, and what can be continued at all."""

from __future__ import annotations

from typing import Any

from sluice.core.events import ReasoningDelta, TextDelta, ToolCallStart
from sluice.upstream.resume import (
    Continuation,
    MessagesPartial,
    Partial,
    continuation,
    continuation_body,
    heal,
    partial_for,
    role_only,
    spliced_usage,
)


def chunk(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def streamed(*chunks: dict[str, Any]) -> Partial:
    partial = Partial()
    for c in chunks:
        partial.add_chunk(c)
    return partial


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_chat_answer_is_continued_as_the_assistant_message() -> None:
    partial = streamed(
        chunk(role="assistant", content=""),
        chunk(reasoning_content="Think"),
        chunk(content="Hel"),
        chunk(content="lo"),
    )
    body = continuation_body({**CHAT, "max_tokens": 10}, chat=True, partial=partial)
    assert body is not None
    assert body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "Think"},
    ]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert body["max_tokens"] == 7 and partial.tokens == 3
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}]  # the original untouched


def test_a_completion_is_continued_from_its_text() -> None:
    partial = streamed({"choices": [{"index": 0, "text": " the"}]})
    body = continuation_body(
        {"model": "m", "prompt": ["Once upon"], "max_tokens": 5}, chat=False, partial=partial
    )
    assert body == {"model": "m", "prompt": "Once upon the", "max_tokens": 4}


def test_what_cannot_be_continued() -> None:
    calls = streamed(chunk(content="ok"), chunk(tool_calls=[{"index": 0, "id": "c"}]))
    assert continuation_body(CHAT, chat=True, partial=calls) is None
    many = streamed({"choices": [{"index": 1, "delta": {"content": "x"}}]})
    assert continuation_body(CHAT, chat=True, partial=many) is None
    assert continuation_body({**CHAT, "n": 2}, chat=True, partial=Partial()) is None
    spent = streamed(chunk(content="a"), chunk(content="b"))
    assert continuation_body({**CHAT, "max_tokens": 2}, chat=True, partial=spent) is None
    assert continuation_body({"prompt": [1, 2, 3]}, chat=False, partial=spent) is None
    assert continuation_body({"prompt": "x", "echo": True}, chat=False, partial=spent) is None


def test_events_of_the_translated_path() -> None:
    partial = Partial()
    partial.add_event(ReasoningDelta(0, "hm"))
    partial.add_event(TextDelta(0, "Hi", token_count=2))
    assert (partial.text, partial.tokens, partial.resumable) == ("Hi", 3, True)
    partial.add_event(ToolCallStart(0, 0, "c", "f"))
    assert not partial.resumable


def test_usage_and_the_opening_chunk() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "x": 1}
    assert spliced_usage(usage, 3) == {
        "prompt_tokens": 9,
        "completion_tokens": 8,
        "total_tokens": 17,
        "x": 1,
    }
    assert role_only(chunk(role="assistant", content=""))
    assert role_only(chunk(role="assistant"))
    assert not role_only(chunk(role="assistant", content="Hi"))
    assert not role_only({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert not role_only({"choices": [], "usage": usage})


def test_a_trailing_space_is_held_back_and_not_repeated() -> None:
    partial = streamed(chunk(content="Hello, "), chunk(content="dear\n "))
    ask = continuation(CHAT, chat=True, partial=partial)
    assert ask is not None
    assert ask.body["messages"][-1]["content"] == "Hello, dear"
    assert ask.skip == "\n "
    # The continuation writes the whitespace again, in one piece or several.
    assert heal("\n friend", ask.skip) == ("friend", "")
    assert heal("\n", ask.skip) == ("", " ")
    assert heal(" friend", " ") == ("friend", "")
    # It wrote something else: nothing is dropped from it.
    assert heal("!", ask.skip) == ("!", "")
    plain = continuation(CHAT, chat=True, partial=streamed(chunk(content="Hi")))
    assert plain is not None and plain.skip == ""


def test_a_prefilled_assistant_message_is_continued_not_doubled() -> None:
    prefill = {"role": "assistant", "content": "Answer:", "reasoning_content": "So"}
    body = {**CHAT, "messages": [*CHAT["messages"], prefill]}
    partial = streamed(chunk(reasoning_content=" then"), chunk(content=" 42"))
    ask = continuation(body, chat=True, partial=partial)
    assert ask is not None
    assert ask.body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Answer: 42", "reasoning_content": "So then"},
    ]
    assert (ask.body["continue_final_message"], ask.body["add_generation_prompt"]) == (True, False)
    assert body["messages"][-1] == prefill  # the original untouched
    # llama-server's answer to a prefill starts with it: not prefilled twice.
    echoed = continuation(body, chat=True, partial=streamed(chunk(content="Answer: 42")))
    assert echoed is not None and echoed.body["messages"][-1]["content"] == "Answer: 42"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def text_start(index: int) -> dict[str, Any]:
    return event("content_block_start", index=index, content_block={"type": "text", "text": ""})


def text_delta(index: int, text: str) -> dict[str, Any]:
    return event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})


MESSAGE_START = event("message_start", message={"id": "msg_1", "usage": {"input_tokens": 5}})
MESSAGES = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def sent(*events: dict[str, Any]) -> MessagesPartial:
    partial = partial_for("/messages")
    assert isinstance(partial, MessagesPartial)
    for e in events:
        partial.add_chunk(e)
    return partial


def test_a_messages_answer_is_tracked_block_by_block() -> None:
    partial = sent(MESSAGE_START, text_start(0), text_delta(0, "Hel"), event("ping"))
    assert (partial.started, partial.open, partial.blocks) == (True, 0, 1)
    partial.add_chunk(text_delta(0, "lo "))
    assert (partial.text, partial.tokens, partial.resumable) == ("Hello ", 2, True)
    partial.add_chunk(event("content_block_stop", index=0))
    assert (partial.open, partial.blocks) == (None, 1)
    ended = event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 2})
    partial.add_chunk(ended)
    assert not partial.resumable  # only its message_stop was lost


def test_what_a_messages_answer_cannot_continue_from() -> None:
    tool = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    calling = sent(MESSAGE_START, text_start(0), text_delta(0, "Let me"))
    calling.add_chunk(event("content_block_stop", index=0))
    calling.add_chunk(event("content_block_start", index=1, content_block=tool))
    assert calling.continuation(MESSAGES) is None
    for kind in ("thinking", "redacted_thinking"):
        thought = event("content_block_start", index=0, content_block={"type": kind})
        assert sent(MESSAGE_START, thought).continuation(MESSAGES) is None
    spent = sent(MESSAGE_START, text_start(0), *(text_delta(0, "a") for _ in range(10)))
    assert spent.continuation(MESSAGES) is None  # max_tokens used up
    assert spent.continuation({**MESSAGES, "max_tokens": 11}) is not None


def test_a_messages_continuation_is_a_prefill_without_its_trailing_space() -> None:
    partial = sent(MESSAGE_START, text_start(0), text_delta(0, "Hel"), text_delta(0, "lo "))
    ask = partial.continuation(MESSAGES)
    assert ask is not None
    assert ask.body == {
        **MESSAGES,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
    }
    assert (ask.skip, ask.echo) == (" ", "Hello")
    assert MESSAGES["messages"] == [{"role": "user", "content": "hi"}]  # untouched
    # Nothing sent yet: the request as it was, no prefill.
    fresh = sent(MESSAGE_START).continuation(
        {k: v for k, v in MESSAGES.items() if k != "max_tokens"}
    )
    assert fresh is not None and fresh.body["messages"] == MESSAGES["messages"]
    assert "max_tokens" not in fresh.body and fresh.echo == ""


def test_a_client_prefill_takes_the_text_in_its_own_message() -> None:
    partial = sent(MESSAGE_START, text_start(0), text_delta(0, " 42"), text_delta(0, " is"))
    user = {"role": "user", "content": "hi"}
    string = {**MESSAGES, "messages": [user, {"role": "assistant", "content": "Answer:"}]}
    ask = partial.continuation(string)
    assert ask is not None
    assert ask.body["messages"] == [user, {"role": "assistant", "content": "Answer: 42 is"}]
    assert string["messages"][-1] == {"role": "assistant", "content": "Answer:"}
    blocks = [{"type": "text", "text": "A"}, {"type": "text", "text": "nswer:", "x": 1}]
    listed = {**MESSAGES, "messages": [user, {"role": "assistant", "content": blocks}]}
    ask = partial.continuation(listed)
    assert ask is not None
    assert ask.body["messages"][-1]["content"] == [
        {"type": "text", "text": "A"},
        {"type": "text", "text": "nswer: 42 is", "x": 1},
    ]
    assert ask.echo == "A\n\nnswer: 42 is"  # as llama-server repeats it
    assert blocks[-1] == {"type": "text", "text": "nswer:", "x": 1}


def spliced(partial: MessagesPartial, ask: Continuation, *events: dict[str, Any]) -> list[Any]:
    splice = partial.splice(ask)
    return [e for data in events for e in splice.events(data)]


def test_a_messages_continuation_goes_on_in_the_open_block() -> None:
    partial = sent(MESSAGE_START, text_start(0), text_delta(0, "Hel"), text_delta(0, "lo "))
    ask = partial.continuation(MESSAGES)
    assert ask is not None
    usage = {"input_tokens": 9, "output_tokens": 1}
    out = spliced(
        partial,
        ask,
        event("message_start", message={"id": "msg_2", "usage": {"input_tokens": 9}}),
        text_start(0),
        text_delta(0, " world"),
        event("content_block_stop", index=0),
        event("message_delta", delta={"stop_reason": "end_turn"}, usage=usage),
        event("message_stop"),
    )
    assert out == [
        text_delta(0, "world"),
        event("content_block_stop", index=0),
        event(
            "message_delta",
            delta={"stop_reason": "end_turn"},
            usage={"input_tokens": 7, "output_tokens": 3},
        ),
        event("message_stop"),
    ]
    assert partial.text == "Hello world" and partial.tokens == 3
    assert partial.splice(ask).encode(event("message_stop")) == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )


def test_a_messages_continuation_drops_the_prefill_it_repeats() -> None:
    partial = sent(MESSAGE_START, text_start(0), text_delta(0, "Hel"), text_delta(0, "lo "))
    ask = partial.continuation(MESSAGES)
    assert ask is not None
    out = spliced(partial, ask, text_start(0), text_delta(0, "Hello world"), text_delta(0, "!"))
    assert out == [text_delta(0, "world"), text_delta(0, "!")]


def test_later_blocks_are_numbered_after_the_first_messages() -> None:
    tool = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    args = {"type": "input_json_delta", "partial_json": "{}"}
    # The text block was stopped: the continuation's text is a block of its own.
    stopped = sent(MESSAGE_START, text_start(0), text_delta(0, "Hi."))
    stopped.add_chunk(event("content_block_stop", index=0))
    ask = stopped.continuation(MESSAGES)
    assert ask is not None
    out = spliced(
        stopped,
        ask,
        text_start(0),
        text_delta(0, " Then"),
        event("content_block_stop", index=0),
        event("content_block_start", index=1, content_block=tool),
        event("content_block_delta", index=1, delta=args),
    )
    assert [(e["type"], e["index"]) for e in out] == [
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
    ]
    # A text block left open, and the continuation begins with a tool call: stopped first.
    opened = sent(MESSAGE_START, text_start(0), text_delta(0, "Hi."))
    ask = opened.continuation(MESSAGES)
    assert ask is not None
    out = spliced(opened, ask, event("content_block_start", index=0, content_block=tool))
    assert out == [
        event("content_block_stop", index=0),
        event("content_block_start", index=1, content_block=tool),
    ]
    assert opened.open is None and opened.blocks == 2


def test_a_dropped_start_is_sent_by_the_continuation() -> None:
    partial = sent()  # dropped before its message_start
    ask = partial.continuation(MESSAGES)
    assert ask is not None and ask.body == MESSAGES
    start = event("message_start", message={"id": "msg_2"})
    assert spliced(partial, ask, start, text_start(0)) == [start, text_start(0)]


def test_messages_usage_moves_the_sent_tokens_out_of_fresh_input_then_cache_reads() -> None:
    """A continuing replica that had the question cached reads it from its cache; the
    tokens sent come out of its fresh input first, then out of its cache reads, so the
    whole input is still the first answer's prompt."""
    from sluice.upstream.resume import messages_usage

    usage = {"input_tokens": 4, "cache_read_input_tokens": 41, "output_tokens": 150}
    assert messages_usage(usage, 10) == {
        "input_tokens": 0,
        "cache_read_input_tokens": 35,
        "output_tokens": 160,
    }
    assert messages_usage({"input_tokens": 50, "output_tokens": 1}, 10) == {
        "input_tokens": 40,
        "output_tokens": 11,
    }
