"""The OpenAI formatters (events -> frames), their usage totals and the non-streaming fold.

The SSE encoder itself is tested in ``tests/server/test_sse.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from sluice.core.errors import ContextOverflow, EngineFailure, InvalidRequest
from sluice.core.events import ErrorEvent, Finish, Start, TextDelta, TokenLogprob, TopLogprob, Usage
from sluice.core.fold import Fold
from sluice.core.frames import DONE, Frame, UsageTotals
from sluice.dialects.openai.format import (
    ChatStreamFormatter,
    ResponseMeta,
    TextStreamFormatter,
    chat_completion_body,
    chat_logprobs,
    text_completion_body,
    text_logprobs,
)
from sluice.server.sse import encode, error_frame


def meta(**kw: object) -> ResponseMeta:
    base: dict[str, Any] = {
        "id": "x-1",
        "created": 1700000000,
        "model": "m",
        "prompt_owners": frozenset({0}),
    }
    base.update(kw)
    return ResponseMeta(**base)


def tlp(token: str, logprob: float | None = -1.0) -> TokenLogprob:
    return TokenLogprob(
        token, 1, logprob, tuple(token.encode()), (TopLogprob(token, -1.0, tuple(token.encode())),)
    )


def run(fmt: ChatStreamFormatter | TextStreamFormatter, events: list) -> list[dict]:
    frames: list[Frame] = []
    for e in events:
        frames.extend(fmt.frames(e))
    end = fmt.end()
    assert end[-1] == DONE  # the dialect's terminal frame is the formatter's
    frames.extend(end[:-1])
    out = []
    for f in frames:
        assert f.event is None and isinstance(f.data, dict)
        out.append(f.data)
    return out


USAGE = Usage(0, prompt_tokens=5, completion_tokens=2, cached_tokens=3)


# -- error frames ------------------------------------------------------------------


def test_the_formatters_error_frame_is_the_wire_error_frame() -> None:
    # In-stream errors are the dialect's own frames, ASCII-escaped like the
    # pre-stream ones, so a message quoting a lone surrogate can still be sent.
    for fmt in (ChatStreamFormatter(meta()), TextStreamFormatter(meta())):
        error = InvalidRequest("bad \ud800 input")
        frames = fmt.error(error)
        assert b"".join(encode(f) for f in frames) == error_frame(error)
        assert b"\\ud800" in error_frame(error)


# -- chat ----------------------------------------------------------------------------


def test_chat_formatter_contract() -> None:
    out = run(
        ChatStreamFormatter(meta()),
        [
            Start(0, 5),
            TextDelta(0, "Hi", 1),
            TextDelta(0, "", 1),  # nothing decided this step: no frame
            TextDelta(0, " there", 1),
            Finish(0, "stop", USAGE),
        ],
    )
    assert [c["choices"][0]["delta"] for c in out] == [
        {"role": "assistant"},
        {"content": "Hi"},
        {"content": " there"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in out] == [None, None, None, "stop"]
    assert {(c["id"], c["created"], c["object"]) for c in out} == {
        ("x-1", 1700000000, "chat.completion.chunk")
    }
    assert all("usage" not in c for c in out)


def test_chat_formatter_usage_chunk_and_continuous_usage() -> None:
    out = run(
        ChatStreamFormatter(meta(include_usage=True)),
        [Start(0, 5), TextDelta(0, "a", 1), Finish(0, "length", USAGE)],
    )
    assert [("usage" in c) for c in out] == [False, False, False, True]
    assert out[-1]["choices"] == []
    assert out[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    out = run(
        ChatStreamFormatter(meta(include_usage=True, continuous_usage=True)),
        [Start(0, 5), TextDelta(0, "a", 1), Finish(0, "length", USAGE)],
    )
    assert all("usage" in c for c in out)
    assert [c["usage"]["completion_tokens"] for c in out] == [0, 1, 2, 2]
    assert all(isinstance(c["usage"]["prompt_tokens_details"]["cached_tokens"], int) for c in out)


def test_chat_formatter_logprobs_shape() -> None:
    out = run(
        ChatStreamFormatter(meta(logprobs=True)),
        [Start(0, 1), TextDelta(0, "ab", 2, (tlp("a"), tlp("b"))), Finish(0, "stop")],
    )
    lp = out[1]["choices"][0]["logprobs"]
    assert [e["token"] for e in lp["content"]] == ["a", "b"]
    assert lp["content"][0]["bytes"] == [97]
    assert lp["content"][0]["top_logprobs"] == [{"token": "a", "logprob": -1.0, "bytes": [97]}]
    assert lp["refusal"] is None


def test_chat_logprobs_never_null_logprob() -> None:
    assert chat_logprobs([tlp("a", None)])["content"][0]["logprob"] == 0.0


def test_chat_formatter_ignores_errors_it_is_not_given() -> None:
    assert ChatStreamFormatter(meta()).frames(ErrorEvent(EngineFailure("x"))) == []


# -- text ------------------------------------------------------------------------------


def test_text_formatter_offsets_and_logprobs_every_chunk() -> None:
    out = run(
        TextStreamFormatter(meta(logprobs=True)),
        [
            Start(0, 2),
            TextDelta(0, "ab", 0, (tlp("a", None), tlp("b")), echo=True),
            TextDelta(0, "cd", 2, (tlp("c"), tlp("d"))),
            TextDelta(0, "e", 1, (tlp("e"),)),
            Finish(0, "stop", USAGE),
        ],
    )
    assert [c["object"] for c in out] == ["text_completion"] * 4
    assert [c["choices"][0]["text"] for c in out] == ["ab", "cd", "e", ""]
    lps = [c["choices"][0]["logprobs"] for c in out]
    assert all(lp is not None for lp in lps)
    assert lps[0]["tokens"] == ["a", "b"] and lps[0]["token_logprobs"] == [None, -1.0]
    assert lps[0]["top_logprobs"] == [None, {"b": -1.0}]
    assert lps[0]["text_offset"] == [0, 1]
    assert lps[1]["text_offset"] == [2, 3]
    assert lps[2]["text_offset"] == [4]
    assert lps[3] == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    assert [c["choices"][0]["finish_reason"] for c in out] == [None, None, None, "stop"]


def test_text_formatter_offsets_are_per_choice() -> None:
    out = run(
        TextStreamFormatter(meta(logprobs=True, prompt_owners=frozenset({0, 1}))),
        [
            TextDelta(0, "aaa", 1, (tlp("aaa"),)),
            TextDelta(1, "b", 1, (tlp("b"),)),
            TextDelta(1, "c", 1, (tlp("c"),)),
            TextDelta(0, "d", 1, (tlp("d"),)),
        ],
    )
    offsets = [(c["choices"][0]["index"], c["choices"][0]["logprobs"]["text_offset"]) for c in out]
    assert offsets == [(0, [0]), (1, [0]), (1, [1]), (0, [3])]


def test_text_logprobs_offsets_from_start() -> None:
    assert text_logprobs([tlp("ab"), tlp("c")], 10)["text_offset"] == [10, 12]


# -- usage totals -------------------------------------------------------------------------


def test_usage_counts_shared_prompt_once() -> None:
    totals = UsageTotals(frozenset({0}))
    for choice in (0, 1):
        totals.start(choice, 5)
        totals.finish(Finish(choice, "stop", Usage(choice, 5, 3, cached_tokens=2)))
    assert totals.as_dict() == {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_usage_counts_each_distinct_prompt() -> None:
    totals = UsageTotals(frozenset({0, 1}))
    totals.start(0, 5)
    totals.start(1, 7)
    assert totals.as_dict()["prompt_tokens"] == 12


# -- non-streaming fold ----------------------------------------------------------------


def test_accumulator_folds_the_same_events() -> None:
    events = [Start(0, 5), TextDelta(0, "Hi", 1), TextDelta(0, "!", 1), Finish(0, "stop", USAGE)]
    acc = Fold(frozenset({0}))
    for e in events:
        acc.add(e)
    body = chat_completion_body(meta(), acc.result())
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"]["total_tokens"] == 7
    text = Fold(frozenset({0}))
    for e in events:
        text.add(e)
    assert text_completion_body(meta(), text.result())["choices"][0]["text"] == "Hi!"


def test_accumulator_raises_the_stream_error() -> None:
    acc = Fold(frozenset({0}))
    acc.add(Start(0, 1))
    with pytest.raises(ContextOverflow):
        acc.add(ErrorEvent(ContextOverflow(10, 5)))
    with pytest.raises(EngineFailure):
        acc.add(ErrorEvent(RuntimeError("boom")))
