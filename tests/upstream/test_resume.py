"""What a continuation asks another replica, and what can be continued at all."""

from __future__ import annotations

from typing import Any

from sluice.core.events import ReasoningDelta, TextDelta, ToolCallStart
from sluice.upstream.resume import (
    Partial,
    continuation,
    continuation_body,
    heal,
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
