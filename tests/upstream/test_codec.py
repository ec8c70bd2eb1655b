"""The upstream codec: neutral request -> OpenAI body, OpenAI stream -> neutral events.

The decoder is proven by a round trip through sluice's own formatters: events
rendered as OpenAI chunks and decoded back fold into the same response.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.errors import (
    UpstreamFailed,
    UpstreamMalformed,
    UpstreamRejected,
    error_frame_payload,
    spec_for,
)
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    ReasoningDelta,
    Start,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    TopLogprob,
    Usage,
)
from sluice.core.fold import Fold
from sluice.core.request import GenerationRequest, SamplingParams
from sluice.dialects.openai.format import (
    ChatStreamFormatter,
    ResponseMeta,
    TextStreamFormatter,
    chat_completion_body,
    text_completion_body,
)
from sluice.dialects.openai.schema import ChatCompletionRequest, CompletionRequest
from sluice.upstream.codec import (
    ChunkDecoder,
    error_from_response,
    stream_meta,
    upstream_body,
)

# -- round trip through sluice's own formatters -------------------------------------------


def render(
    events: list[Event], *, chat: bool, owners: frozenset[int], logprobs: bool
) -> list[dict[str, Any]]:
    """The chunk dicts sluice sends for ``events`` (usage on), as a client parses them."""
    meta = ResponseMeta("x-1", 1, "m", owners, include_usage=True, logprobs=logprobs)
    fmt = ChatStreamFormatter(meta) if chat else TextStreamFormatter(meta)
    frames = [f for e in events for f in fmt.frames(e)] + fmt.end()[:-1]  # [:-1]: no [DONE]
    chunks: list[dict[str, Any]] = [json.loads(json.dumps(f.data)) for f in frames]
    return chunks


def decode(chunks: list[dict[str, Any]], *, chat: bool) -> list[Event]:
    decoder = ChunkDecoder(chat=chat)
    events: list[Event] = [e for c in chunks for e in decoder.feed(c)]
    return events + decoder.end()


def body_of(
    events: list[Event], *, chat: bool, owners: frozenset[int], logprobs: bool
) -> dict[str, Any]:
    fold = Fold(owners)
    for event in events:
        fold.add(event)
    meta = ResponseMeta("x-1", 1, "m", owners, logprobs=logprobs)
    render_body = chat_completion_body if chat else text_completion_body
    body: dict[str, Any] = render_body(meta, fold.result())
    return body


def assert_round_trip(
    events: list[Event], *, chat: bool = True, owners: frozenset[int] = frozenset({0})
) -> list[Event]:
    logprobs = any(isinstance(e, TextDelta) and e.logprobs for e in events)
    decoded = decode(render(events, chat=chat, owners=owners, logprobs=logprobs), chat=chat)
    assert not any(isinstance(e, ErrorEvent) for e in decoded), decoded
    expected = body_of(events, chat=chat, owners=owners, logprobs=logprobs)
    # The decoded response's meta is the upstream one: choice 0 owns the prompt.
    got = body_of(decoded, chat=chat, owners=frozenset({0}), logprobs=logprobs)
    assert got == expected
    check_order(decoded)
    return decoded


def check_order(events: list[Event]) -> None:
    """Start first per choice, ToolCallEnd after its start and before Finish, one Finish."""
    started: set[int] = set()
    finished: set[int] = set()
    calls: dict[int, set[int]] = {}
    for e in events:
        if isinstance(e, Start):
            assert e.choice not in started
            started.add(e.choice)
            continue
        choice = getattr(e, "choice", None)
        if choice is None:
            continue
        assert choice in started and choice not in finished, e
        if isinstance(e, ToolCallStart):
            calls.setdefault(choice, set()).add(e.index)
        elif isinstance(e, ToolCallEnd):
            calls[choice].remove(e.index)
        elif isinstance(e, Finish):
            assert not calls.get(choice), "every started call ends before its choice finishes"
            finished.add(choice)
    assert finished == started


def lp(token: str, logprob: float = -0.5) -> TokenLogprob:
    top = (TopLogprob(token, logprob, tuple(token.encode())), TopLogprob("zz", -3.0, (122, 122)))
    return TokenLogprob(token, 7, logprob, tuple(token.encode()), top)


def test_text_reasoning_and_usage_round_trip() -> None:
    events: list[Event] = [
        Start(0, prompt_tokens=11),
        ReasoningDelta(0, "Let me "),
        ReasoningDelta(0, "think."),
        TextDelta(0, "Hello", token_count=1),
        TextDelta(0, " wörld", token_count=2),
        Finish(0, "stop", usage=Usage(0, 11, 3, cached_tokens=4)),
    ]
    decoded = assert_round_trip(events)
    # Reasoning arrives once although sluice sends it under both names.
    assert [e.text for e in decoded if isinstance(e, ReasoningDelta)] == ["Let me ", "think."]
    finish = decoded[-1]
    assert isinstance(finish, Finish) and finish.usage == Usage(0, 11, 3, 4)


def test_tool_calls_and_two_choices_round_trip() -> None:
    events: list[Event] = [
        Start(0, 9),
        Start(1, 9),
        TextDelta(0, "Calling.", token_count=1),
        ToolCallStart(0, 0, "call_a", "get_weather"),
        ToolCallStart(1, 0, "call_c", "lookup"),
        ToolCallDelta(0, 0, '{"ci'),
        ToolCallDelta(1, 0, '{"q": 1}'),
        ToolCallDelta(0, 0, 'ty": "Paris"}'),
        ToolCallEnd(0, 0),
        ToolCallStart(0, 1, "call_b", "get_time"),
        ToolCallDelta(0, 1, "{}"),
        ToolCallEnd(0, 1),
        ToolCallEnd(1, 0),
        Finish(1, "tool_calls", usage=Usage(1, 9, 5)),
        Finish(0, "tool_calls", usage=Usage(0, 9, 12, cached_tokens=2)),
    ]
    decoded = assert_round_trip(events)
    starts = [e for e in decoded if isinstance(e, ToolCallStart)]
    assert [(s.choice, s.index, s.id, s.name) for s in starts] == [
        (0, 0, "call_a", "get_weather"),
        (1, 0, "call_c", "lookup"),
        (0, 1, "call_b", "get_time"),
    ]
    ends = [(e.choice, e.index) for e in decoded if isinstance(e, ToolCallEnd)]
    assert ends == [(1, 0), (0, 0), (0, 1)]  # at each finish, in index order
    # The upstream's totals (prompt once, completion 17) on choice 0, zero on choice 1.
    finishes = {e.choice: e for e in decoded if isinstance(e, Finish)}
    assert finishes[0].usage == Usage(0, 9, 17, 2)
    assert finishes[1].usage == Usage(1, 0, 0)


def test_chat_logprobs_round_trip() -> None:
    events: list[Event] = [
        Start(0, 3),
        TextDelta(0, "Hi", token_count=1, logprobs=(lp("Hi"),)),
        TextDelta(0, " there", token_count=2, logprobs=(lp(" the", -1.25), lp("re"))),
        Finish(0, "length"),
    ]
    decoded = assert_round_trip(events)
    deltas = [e for e in decoded if isinstance(e, TextDelta)]
    assert deltas[1].logprobs is not None and deltas[1].token_count == 2
    assert deltas[1].logprobs[0] == TokenLogprob(
        " the", -1, -1.25, tuple(b" the"), lp(" the", -1.25).top
    )


def test_text_completion_round_trip_with_echo_logprobs_and_prompts() -> None:
    first = TokenLogprob("Once", 1, None, tuple(b"Once"))  # the first echoed token: no logprob
    events: list[Event] = [
        Start(0, 2),
        Start(1, 3),
        TextDelta(0, "Once", logprobs=(first,), echo=True),
        TextDelta(0, " upon", token_count=1, logprobs=(lp(" upon"),)),
        TextDelta(1, "A", token_count=1, logprobs=(lp("A"),)),
        Finish(0, "length"),
        Finish(1, "stop", usage=Usage(1, 3, 1)),
    ]
    # Two prompts: each choice owns its own prompt in the original response.
    assert_round_trip(events, chat=False, owners=frozenset({0, 1}))


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(min_size=1, max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
    n=st.integers(min_value=1, max_value=3),
    chat=st.booleans(),
    usage=st.booleans(),
)
def test_random_splits_round_trip(
    text: str, cuts: list[int], n: int, chat: bool, usage: bool
) -> None:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    events: list[Event] = [Start(c, 5) for c in range(n)]
    for c in range(n):
        events += [TextDelta(c, p, token_count=1) for p in pieces]
    for c in reversed(range(n)):
        u = Usage(c, 5, len(pieces) + c) if usage else None
        events.append(Finish(c, "stop", usage=u))
    decoded = assert_round_trip(events, chat=chat)
    for c in range(n):
        assert "".join(e.text for e in decoded if isinstance(e, TextDelta) and e.choice == c) == (
            text
        )


# -- real servers' shapes ----------------------------------------------------------------


def chat_chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def test_llama_server_stream() -> None:
    chunks = [
        chat_chunk({"role": "assistant", "content": None}),
        chat_chunk({"reasoning_content": "Hm"}),
        chat_chunk({"content": "Ok"}),
        chat_chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "Xy12",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            }
        ),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
        {
            **chat_chunk({}, "tool_calls"),
            "timings": {"cache_n": 4, "prompt_n": 16, "prompt_ms": 12.5, "predicted_ms": 80.0},
        },
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"completion_tokens": 12, "prompt_tokens": 20, "total_tokens": 32},
        },
    ]
    decoder = ChunkDecoder(chat=True)
    events = [e for c in chunks[:-1] for e in decoder.feed(c)]
    assert not any(isinstance(e, Finish) for e in events)  # held for the usage
    events += decoder.feed(chunks[-1])
    assert decoder.end() == []
    assert events == [
        Start(0, 0),
        ReasoningDelta(0, "Hm"),
        TextDelta(0, "Ok", token_count=1),
        ToolCallStart(0, 0, "Xy12", "get_weather"),
        ToolCallDelta(0, 0, '{"city":'),
        ToolCallDelta(0, 0, '"Oslo"}'),
        ToolCallEnd(0, 0),
        Finish(
            0,
            "tool_calls",
            usage=Usage(0, 20, 12, cached_tokens=4, prompt_ms=12.5, generation_ms=80.0),
        ),
    ]


def test_vllm_stream_two_choices() -> None:
    chunks = [
        chat_chunk({"role": "assistant", "content": ""}, index=0),
        chat_chunk({"role": "assistant", "content": ""}, index=1),
        chat_chunk({"reasoning": "so"}, index=1),
        chat_chunk(
            {
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-9",
                        "type": "function",
                        "index": 0,
                        "function": {"name": "f", "arguments": ""},
                    }
                ]
            },
            index=0,
        ),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, index=0),
        chat_chunk({"content": "Yes"}, index=1),
        {**chat_chunk({"content": ""}, "tool_calls", index=0), "stop_reason": None},
        chat_chunk({"content": ""}, "content_filter", index=1),
        {"id": "x", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 20}},
    ]
    events = decode(chunks, chat=True)
    assert events == [
        Start(0, 0),
        Start(1, 0),
        ReasoningDelta(1, "so"),
        ToolCallStart(0, 0, "chatcmpl-tool-9", "f"),
        ToolCallDelta(0, 0, "{}"),
        TextDelta(1, "Yes", token_count=1),
        ToolCallEnd(0, 0),
        Finish(0, "tool_calls", usage=Usage(0, 10, 20)),
        Finish(1, "stop", usage=Usage(1, 0, 0)),  # content_filter: no such reason here
    ]


def test_servers_that_put_the_whole_call_in_one_delta_without_index_or_done() -> None:
    # Such a server: object "chat.completion", the whole call in its first delta,
    # empty content with the finish; no usage: the fold counts the deltas.
    chunks: list[dict[str, Any]] = [
        {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "w", "arguments": '{"c":"S"}'},
                            }
                        ]
                    },
                    "finish_reason": None,
                }
            ],
        },
        {"choices": [{"delta": {"content": ""}, "finish_reason": "function_call"}]},
    ]
    assert decode(chunks, chat=True) == [
        Start(0, 0),
        ToolCallStart(0, 0, "call_1", "w"),
        ToolCallDelta(0, 0, '{"c":"S"}'),
        ToolCallEnd(0, 0),
        Finish(0, "tool_calls", usage=None),
    ]


def test_text_chunks_and_llama_server_chat_shaped_text_logprobs() -> None:
    chunks = [
        {
            "choices": [
                {
                    "text": "ab",
                    "index": 0,
                    "finish_reason": None,
                    "logprobs": {
                        "content": [
                            {"id": 64, "token": "a", "logprob": -0.1, "bytes": [97]},
                            {"id": 65, "token": "b", "logprob": -0.2, "top_logprobs": []},
                        ]
                    },
                }
            ]
        },
        {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]},
    ]
    events = decode(chunks, chat=False)
    assert events == [
        Start(0, 0),
        TextDelta(
            0,
            "ab",
            token_count=2,
            logprobs=(
                TokenLogprob("a", 64, -0.1, (97,)),
                TokenLogprob("b", 65, -0.2, (98,)),
            ),
        ),
        Finish(0, "length"),
    ]


# -- failures in the stream --------------------------------------------------------------


def test_error_object_in_stream_ends_it_after_held_finishes() -> None:
    decoder = ChunkDecoder(chat=True)
    assert decoder.feed(chat_chunk({"content": "a"}, "stop")) == [
        Start(0, 0),
        TextDelta(0, "a", token_count=1),
    ]
    out = decoder.feed(chat_chunk({"content": "b"}, index=1))
    # sluice's own error frame (an upstream sluice), also what llama-server/vLLM send
    out += decoder.feed(error_frame_payload(UpstreamFailed("decode failed")))
    assert out[:3] == [Start(1, 0), TextDelta(1, "b", token_count=1), Finish(0, "stop")]
    error = out[3]
    assert isinstance(error, ErrorEvent) and type(error.error) is UpstreamFailed
    assert "decode failed" in str(error.error)
    assert len(out) == 4
    assert decoder.feed(chat_chunk({"content": "c"})) == [] and decoder.end() == []


@pytest.mark.parametrize(
    "chunk",
    [
        {"error": "boom"},
        {"object": "error", "message": "boom", "type": "BadRequestError", "code": 400},
        {"error": {"code": 500, "message": "boom", "type": "server_error"}},
    ],
)
def test_error_shapes_in_stream(chunk: dict[str, Any]) -> None:
    [event] = ChunkDecoder(chat=True).feed(chunk)
    assert isinstance(event, ErrorEvent) and type(event.error) is UpstreamFailed
    assert "boom" in str(event.error)


@pytest.mark.parametrize(
    "chunk",
    [
        [1, 2],
        {"id": "x"},
        {"choices": {"0": {}}},
        {"choices": ["text"]},
        {"choices": [{"index": "0", "delta": {}}]},
        {"choices": [{"index": 0, "delta": "hi"}]},
        {"choices": [{"index": 0, "delta": {"content": 5}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": {"index": 0}}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": 3}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": 1}]},
    ],
)
def test_malformed_chunks(chunk: Any) -> None:
    decoder = ChunkDecoder(chat=True)
    events = decoder.feed(chunk)
    assert isinstance(events[-1], ErrorEvent)
    assert isinstance(events[-1].error, UpstreamMalformed)
    assert decoder.end() == []


def test_a_null_error_key_is_no_error() -> None:
    chunk = {**chat_chunk({"content": "a"}), "error": None}
    assert ChunkDecoder(chat=True).feed(chunk) == [Start(0, 0), TextDelta(0, "a", token_count=1)]


def test_malformed_text_chunk() -> None:
    [*_, event] = ChunkDecoder(chat=False).feed({"choices": [{"index": 0, "text": ["a"]}]})
    assert isinstance(event, ErrorEvent) and isinstance(event.error, UpstreamMalformed)


def test_end_before_finish_and_empty_stream_fail() -> None:
    decoder = ChunkDecoder(chat=True)
    decoder.feed(chat_chunk({"content": "a"}, "stop", index=0))
    decoder.feed(chat_chunk({"content": "b"}, index=1))
    *finishes, error = decoder.end()
    assert finishes == [Finish(0, "stop")]
    assert isinstance(error, ErrorEvent) and type(error.error) is UpstreamFailed
    assert "before finishing" in str(error.error)
    [empty] = ChunkDecoder(chat=True).end()
    assert isinstance(empty, ErrorEvent) and type(empty.error) is UpstreamFailed


# -- request bodies ----------------------------------------------------------------------


CHAT_WIRE: dict[str, Any] = {
    "model": "client-name",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need a tool",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"c": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ],
    "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "response_format": {"type": "json_object"},
    "reasoning_effort": "low",
    "chat_template_kwargs": {"enable_thinking": False},
    "max_tokens": 50,
    "stop": ["\n\n", "END"],
    "n": 2,
    "logprobs": True,
    "top_logprobs": 3,
    "temperature": 0.2,
    "top_p": 0.9,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 42,
    "logit_bias": {"15": -100.0, "7": 2.5},
    "top_k": 40,
    "min_p": 0.05,
    "repeat_penalty": 1.1,
    "repeat_last_n": 128,
    "ignore_eos": True,
}


def test_chat_body_keeps_every_field_the_client_sent() -> None:
    request = ChatCompletionRequest.model_validate(CHAT_WIRE).to_request()
    path, body = upstream_body(request, "upstream-name")
    assert path == "/chat/completions"
    expected = {
        **CHAT_WIRE,
        "model": "upstream-name",
        "stream": True,
        "stream_options": {"include_usage": True},
        "repetition_penalty": 1.1,  # vLLM's spelling, beside llama-server's
    }
    assert body == expected
    # sluice as the upstream of sluice: the body is the same request again.
    again = ChatCompletionRequest.model_validate(body).to_request()
    assert again == replace(request, model="upstream-name")
    # A penalty of 1.0 sent is a choice (no penalty) and goes on; one left out does not.
    sent = {"messages": CHAT_WIRE["messages"], "repeat_penalty": 1.0, "repeat_last_n": 64}
    _, body = upstream_body(ChatCompletionRequest.model_validate(sent).to_request(), "u")
    assert (body["repeat_penalty"], body["repetition_penalty"], body["repeat_last_n"]) == (
        1.0,
        1.0,
        64,
    )
    left_out = {"messages": CHAT_WIRE["messages"]}
    _, body = upstream_body(ChatCompletionRequest.model_validate(left_out).to_request(), "u")
    assert not {"repeat_penalty", "repetition_penalty", "repeat_last_n"} & set(body)


def test_a_continued_final_message_goes_up_as_the_servers_flags() -> None:
    """Anthropic's and Ollama's prefill, and OpenAI's flag, as vLLM, SGLang, llama-server
    and sluice read it; a request without one sends neither flag."""
    from sluice.dialects.anthropic.schema import MessagesRequest
    from sluice.dialects.ollama.schema import ChatRequest

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    anthropic = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": turns})
    ollama = ChatRequest.model_validate({"model": "m", "messages": turns})
    wire = {"messages": turns, **flags}
    openai = ChatCompletionRequest.model_validate(wire).to_request()
    for request in (anthropic.to_request(), ollama.to_request(), openai):
        _, body = upstream_body(request, "u")
        assert {k: body.get(k) for k in flags} == flags
        assert body["messages"][-1] == {"role": "assistant", "content": "Once"}
        # sluice behind sluice: the flag survives the trip.
        assert ChatCompletionRequest.model_validate(body).to_request().continue_final
    plain = ChatCompletionRequest.model_validate({"messages": turns}).to_request()
    _, body = upstream_body(plain, "u")
    assert not set(flags) & set(body)
    asked = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": turns[:1]})
    assert not asked.to_request().continue_final


def test_text_body_keeps_every_field_the_client_sent() -> None:
    wire = {
        "model": "c",
        "prompt": ["Once", "Twice"],
        "max_tokens": 7,
        "echo": True,
        "logprobs": 0,
        "stop": ["."],
        "n": 3,
        "seed": 1,
        "temperature": 0.0,
    }
    request = CompletionRequest.model_validate(wire).to_request()
    path, body = upstream_body(request, "u")
    assert path == "/completions"
    assert body == {
        **wire,
        "model": "u",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert CompletionRequest.model_validate(body).to_request() == replace(request, model="u")
    single = CompletionRequest.model_validate({"prompt": [1, 2, 3]}).to_request()
    _, body = upstream_body(single, "u")
    assert body["prompt"] == [1, 2, 3] and "logprobs" not in body and "echo" not in body


def test_defaults_are_not_sent() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"model": "c", "messages": [{"role": "user", "content": "Hi"}]}
    ).to_request()
    assert upstream_body(chat, "u")[1] == {
        "model": "u",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, text = upstream_body(CompletionRequest.model_validate({"prompt": "x"}).to_request(), "u")
    # max_tokens 16 is the endpoint's default *to the client*; upstreams differ, so it goes.
    assert text == {
        "model": "u",
        "prompt": "x",
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_logprobs_without_alternatives_and_object_arguments() -> None:
    request = GenerationRequest(
        messages=[
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"x": 1}}}],
            }
        ],
        logprobs=0,
    )
    _, body = upstream_body(request, "u")
    assert body["logprobs"] is True and "top_logprobs" not in body
    assert body["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert request.messages is not None  # the request itself is left alone
    assert request.messages[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def test_grammar_is_sent_llama_server_style_only_on_its_own() -> None:
    sampling = SamplingParams(grammar='root ::= "a"', grammar_triggers=("<tool>",))
    plain = GenerationRequest(messages=[{"role": "user", "content": "x"}], sampling=sampling)
    _, body = upstream_body(plain, "u")
    assert body["grammar"] == 'root ::= "a"'
    assert body["grammar_lazy"] is True
    assert body["grammar_triggers"] == [{"type": 2, "value": "<tool>"}]
    derived = replace(plain, response_format={"type": "json_object"})
    assert "grammar" not in upstream_body(derived, "u")[1]


def test_stream_meta() -> None:
    text = GenerationRequest(prompts=["a", "b"], n=2, logprobs=1)
    meta = stream_meta(text, "m", slot="gpu", replica="http://h:8000")
    assert (meta.choices, meta.prompt_owners, meta.logprobs) == (4, frozenset({0}), True)
    assert (meta.slot, meta.replica, meta.model) == ("gpu", "http://h:8000", "m")
    chat = stream_meta(GenerationRequest(messages=[], n=3), "m", slot="s", replica=None)
    assert (chat.choices, chat.logprobs) == (3, False)


# -- errors before the stream ------------------------------------------------------------


def test_openai_error_json_is_rejected_with_the_upstreams_fields() -> None:
    body = json.dumps(
        {
            "error": {
                "message": "max_tokens is too large",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": "context_length_exceeded",
            }
        }
    ).encode()
    error = error_from_response(400, body, {"content-type": "application/json"})
    assert isinstance(error, UpstreamRejected)
    assert (error.message, error.param, error.code, error.status) == (
        "max_tokens is too large",
        "max_tokens",
        "context_length_exceeded",
        400,
    )
    assert spec_for(error).status == 400 and spec_for(error).type == "invalid_request_error"


def test_429_keeps_retry_after() -> None:
    error = error_from_response(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "7"})
    assert isinstance(error, UpstreamRejected)
    assert error.headers() == {"Retry-After": "7"}
    assert (error.status, error.type, error.message) == (429, "rate_limit_error", "slow down")


@pytest.mark.parametrize(
    ("status", "body", "message", "type_"),
    [
        # llama-server: the numeric code repeats the status
        (
            400,
            b'{"error":{"code":400,"message":"bad grammar","type":"invalid_request_error"}}',
            "bad grammar",
            "invalid_request_error",
        ),
        # vLLM's older top-level error object
        (
            404,
            b'{"object":"error","message":"no model","type":"NotFoundError","code":404}',
            "no model",
            "NotFoundError",
        ),
        (404, b'{"error":"model \'x\' not found"}', "model 'x' not found", "invalid_request_error"),
        (422, b'{"detail":"Field required"}', "Field required", "invalid_request_error"),
        (400, b"  bad request\n", "bad request", "invalid_request_error"),
        (400, b"", "the upstream answered HTTP 400 without a message", "invalid_request_error"),
    ],
)
def test_4xx_shapes(status: int, body: bytes, message: str, type_: str) -> None:
    error = error_from_response(status, body, {})
    assert isinstance(error, UpstreamRejected)
    assert (error.status, error.message, error.type, error.code) == (status, message, type_, None)
    assert error.headers() == {}


@pytest.mark.parametrize("status", [500, 502, 503, 401, 403])
def test_5xx_and_credential_refusals_are_upstream_failures(status: int) -> None:
    error = error_from_response(status, b'{"error": {"message": "oops"}}', {"Retry-After": "1"})
    assert type(error) is UpstreamFailed
    assert str(status) in error.message and "oops" in error.message
    assert spec_for(error).status == 502


def test_usage_only_from_the_usage_chunk_and_the_last_running_total_wins() -> None:
    # vLLM's continuous usage stats: a running total on every chunk; the last is the total.
    decoder = ChunkDecoder(chat=True)
    first = {**chat_chunk({"content": "a"}), "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
    last = {**chat_chunk({}, "stop"), "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    assert decoder.feed(first) == [Start(0, 0), TextDelta(0, "a", token_count=1)]
    assert decoder.feed(last) == []
    # An empty choices list without usage (a keep-alive) releases nothing.
    assert decoder.feed({"choices": []}) == []
    assert decoder.end() == [Finish(0, "stop", usage=Usage(0, 4, 2))]


def test_an_explicit_sampling_value_is_sent_even_if_it_is_a_common_default() -> None:
    # temperature 1 and top_k 0 are what the client asked for: an upstream whose own
    # defaults differ (llama-server: 0.8 and 40) must be told.
    wire = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    chat = ChatCompletionRequest.model_validate(
        {"model": "c", "messages": [{"role": "user", "content": "Hi"}], **wire}
    ).to_request()
    body = upstream_body(chat, "u")[1]
    assert {k: body.get(k) for k in wire} == wire
