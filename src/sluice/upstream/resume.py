"""Mid-stream failover: another replica continues an answer the first one dropped.

When an upstream fails after it streamed part of an answer (a dropped connection, a
silence past the timeout, a stream ended without its finish), another replica of the
slot is asked to continue from what was already sent, and its stream is spliced on so
the client reads one answer: nothing repeated or lost, one finish, usage summed (the
continuation's output tokens plus those already sent; its prompt tokens less those,
which were the first answer's).

* OpenAI chat (:class:`Partial`): the same request with the partial answer as the
  assistant's final message to continue (``continue_final_message`` and
  ``add_generation_prompt: false``, which vLLM, SGLang, llama.cpp's server and sluice read;
  llama-server also continues a final assistant message by itself); ``/v1/completions``:
  the prompt followed by the text so far. Spliced by :class:`OpenAISplice`.
* Anthropic Messages (:class:`MessagesPartial`): the same request with the text so far
  as a final assistant message (Anthropic's prefill, which llama-server's
  ``/v1/messages`` continues too). Spliced by :class:`MessagesSplice`: its events go on
  under the first message's block indexes.
* A dialect the upstream speaks itself but whose API cannot continue an answer
  (Responses, Gemini: :class:`ChatContinued`, subclassed in ``dialects/``): through the
  slot's OpenAI chat, the request in chat form with the text so far to continue; a
  :class:`ChatSplice` decodes its chunks and the dialect writes them as the rest of the
  first stream's events.

Where the request already ends with an assistant message (the client's own prefill),
the text is appended to it: two assistant messages at the end are refused
(llama-server: "Cannot have 2 or more assistant messages at the end of the list").

What cannot be continued is not: an answer with tool calls begun (no server continues
one), a thought (a prefill cannot carry a signed thinking block), several choices
(``n`` > 1), a prompt of token ids, an answer at its ``max_tokens``. Then the failure
ends the stream as before.

Example::

    partial = partial_for(path)                    # Partial or MessagesPartial
    partial.add_chunk(event)                       # each parsed event forwarded
    ask = partial.continuation(request_body)       # or None: send ask.body elsewhere
    splice = partial.splice(ask)
    for event in splice.events(continuation_event):    # what the client gets instead
        client.write(splice.encode(event))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
)
from sluice.core.frames import Frame
from sluice.upstream.codec import ChunkDecoder


@dataclass(frozen=True, slots=True)
class Continuation:
    """The request that continues an answer, and the whitespace its text ended with,
    held back from it: a prefix that ends in a space would be tokenized with the space
    alone where the model wrote it as the next word's first character, and the model
    then continues differently (what "token healing" repairs). The continuation writes
    that space again; :func:`heal` drops it. ``echo``: the prefilled assistant text
    that a server may repeat at the start of its answer (llama-server's ``/v1/messages``
    does), dropped from it."""

    body: dict[str, Any]
    skip: str
    echo: str = ""
    # Where it goes when not where the first request went: a native dialect's answer
    # continued through the slot's OpenAI chat (:class:`ChatContinued`).
    path: str | None = None
    headers: Mapping[str, str] | None = None
    prefix: str = "/v1"


class Splice(Protocol):
    """A continuation's events made the first answer's (one dialect's)."""

    def events(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """What the client gets for one of the continuation's parsed events (none, it
        amended, or more), each already added to the partial."""
        ...

    def encode(self, data: dict[str, Any]) -> bytes:
        """One event as the dialect's SSE frame."""
        ...

    def done(self) -> tuple[list[dict[str, Any]], bytes]:
        """At the continuation's ``[DONE]``: the events that end the answer, each already
        added to the partial, and the bytes that end the stream."""
        ...


class Resumable(Protocol):
    """One dialect's answer so far, fed each event the client got."""

    @property
    def tokens(self) -> int: ...

    def add_chunk(self, data: Mapping[str, Any]) -> None: ...

    def continuation(self, body: Mapping[str, Any]) -> Continuation | None:
        """The request that continues ``body``'s answer; None when it cannot go on."""
        ...

    def splice(self, ask: Continuation) -> Splice:
        """What splices the stream answering ``ask`` onto this one."""
        ...


def partial_for(path: str) -> Partial | MessagesPartial:
    """A new partial for a stream of ``path`` (``/chat/completions``, ``/completions``,
    ``/messages``)."""
    if path == "/messages":
        return MessagesPartial()
    return Partial(chat=path == "/chat/completions")


@dataclass(slots=True)
class Partial:
    """What one OpenAI answer streamed so far (its first choice), and whether it can go
    on; ``chat``: a chat completion (else a text completion)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tokens: int = 0  # content-bearing chunks: one token each on the servers that stream so
    resumable: bool = True
    chat: bool = True
    first: Mapping[str, Any] | None = None  # its first chunk: the continuation's names

    def add_chunk(self, chunk: Mapping[str, Any]) -> None:
        """One parsed OpenAI chunk (chat ``delta`` or completions ``text``)."""
        if self.first is None:
            self.first = chunk
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, Mapping):
                continue
            if choice.get("index", 0) != 0:
                self.resumable = False  # n > 1
                continue
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.resumable = False
                text = delta.get("content")
                thought = delta.get("reasoning_content") or delta.get("reasoning")
            else:
                text, thought = choice.get("text"), None
            if isinstance(text, str) and text:
                self.content.append(text)
                self.tokens += 1
            if isinstance(thought, str) and thought:
                self.reasoning.append(thought)
                self.tokens += 1

    def add_event(self, event: Event) -> None:
        """One decoded event (the translated path)."""
        if isinstance(event, TextDelta):
            if event.choice != 0:
                self.resumable = False
            elif not event.echo:
                self.content.append(event.text)
                self.tokens += max(event.token_count, 1)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
            self.tokens += 1
        elif isinstance(event, ToolCallStart | ToolCallDelta):
            self.resumable = False

    @property
    def text(self) -> str:
        return "".join(self.content)

    def continuation(self, body: Mapping[str, Any]) -> Continuation | None:
        return continuation(body, chat=self.chat, partial=self)

    def splice(self, ask: Continuation) -> OpenAISplice:
        return OpenAISplice(self, ask.skip)


def heal(text: str, skip: str) -> tuple[str, str]:
    """``text`` (a continuation's next piece) without what it repeats of ``skip``; and
    what is left to skip (nothing once a piece differs or ``skip`` is used up)."""
    n = 0
    while n < len(skip) and n < len(text) and text[n] == skip[n]:
        n += 1
    if n == len(text) and n < len(skip):
        return "", skip[n:]  # the whole piece was repeated whitespace: more may follow
    return text[n:], ""


def continuation(body: Mapping[str, Any], *, chat: bool, partial: Partial) -> Continuation | None:
    """The request that continues ``body``'s answer after ``partial`` (see
    :class:`Continuation`); None when it cannot be continued (see the module)."""
    text = partial.text
    prefix = text.rstrip()
    out = continuation_body(body, chat=chat, partial=partial, text=prefix)
    return None if out is None else Continuation(out, text[len(prefix) :])


def continuation_body(
    body: Mapping[str, Any], *, chat: bool, partial: Partial, text: str | None = None
) -> dict[str, Any] | None:
    """The request that continues ``body``'s answer after ``partial`` (its text, or
    ``text``); None when it cannot be continued (see the module)."""
    if not partial.resumable or body.get("n", 1) not in (1, None):
        return None
    if text is None:
        text = partial.text
    out = dict(body)
    if not _shortened(out, ("max_tokens", "max_completion_tokens"), partial.tokens):
        return None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        out["messages"] = prefilled(messages, text)
        if partial.reasoning:
            last = out["messages"][-1]
            before = last.get("reasoning_content")
            thought = "".join(partial.reasoning)
            last["reasoning_content"] = before + thought if isinstance(before, str) else thought
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or body.get("echo"):
        return None
    out["prompt"] = prompt + text
    return out


def _shortened(out: dict[str, Any], names: tuple[str, ...], tokens: int) -> bool:
    """``out``'s token limits less the ``tokens`` already sent; False when one is used up
    (the answer is as long as it may be: nothing to continue)."""
    for name in names:
        limit = out.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - tokens < 1:
                return False
            out[name] = limit - tokens
    return True


def prefilled(messages: list[Any], text: str) -> list[Any]:
    """``messages`` (not changed) with ``text`` for the assistant to continue: appended to
    a final assistant message (the client's prefill: to its string content or its last
    text block), less what ``text`` repeats of it (llama-server's answer to a prefill
    starts with the prefill); else as a new final assistant message."""
    last = messages[-1] if messages else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        return [*messages, {"role": "assistant", "content": text}]
    content = last.get("content")
    text = text.removeprefix(assistant_text(last))
    if isinstance(content, list) and content:
        blocks = list(content)
        tail = blocks[-1]
        if isinstance(tail, Mapping) and tail.get("type") == "text":
            blocks[-1] = {**tail, "text": str(tail.get("text") or "") + text}
        elif text:
            blocks.append({"type": "text", "text": text})
        merged: Any = blocks
    else:
        merged = (content if isinstance(content, str) else "") + text
    return [*messages[:-1], {**last, "content": merged}]


def assistant_text(message: Mapping[str, Any]) -> str:
    """A message's text as llama-server repeats a prefill: its string content, or its
    text blocks joined by blank lines."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = [b.get("text") for b in content if isinstance(b, Mapping) and b.get("type") == "text"]
    return "\n\n".join(t for t in texts if isinstance(t, str))


def spliced_usage(usage: Mapping[str, Any], sent: int) -> dict[str, Any]:
    """The continuation's usage as the whole answer's: the ``sent`` tokens (streamed
    before it) moved from its prompt to its completion."""
    out = dict(usage)
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        moved = min(sent, prompt)
        out["prompt_tokens"] = prompt - moved
        out["completion_tokens"] = completion + moved
        out["total_tokens"] = prompt + completion
    return out


def role_only(chunk: Mapping[str, Any]) -> bool:
    """A chat chunk that only opens the assistant's message (a continuation's first)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or chunk.get("usage"):
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, Mapping) else None
        if not isinstance(delta, Mapping) or choice.get("finish_reason"):
            return False
        if any(v for k, v in delta.items() if k != "role"):
            return False
    return True


class OpenAISplice:
    """A continuation's OpenAI chunks as the first answer's: named by its ``id``,
    ``created`` and ``model``, the role-only opening dropped, the held-back whitespace
    healed, the usage the whole answer's."""

    __slots__ = ("_names", "_partial", "_sent", "_skip")

    def __init__(self, partial: Partial, skip: str) -> None:
        first = partial.first or {}
        self._names = {k: first[k] for k in ("id", "created", "model") if k in first}
        self._partial = partial
        self._sent = partial.tokens  # streamed before it: its usage moves them
        self._skip = skip

    def events(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        if self._partial.chat and role_only(data):
            return []
        if self._skip:
            keep, self._skip = _heal_chunk(data, self._skip)
            if not keep:
                return []
        data.update(self._names)
        usage = data.get("usage")
        if isinstance(usage, dict):
            data["usage"] = spliced_usage(usage, self._sent)
        self._partial.add_chunk(data)
        return [data]

    def encode(self, data: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def done(self) -> tuple[list[dict[str, Any]], bytes]:
        return [], b"data: [DONE]\n\n"


def _heal_chunk(chunk: dict[str, Any], skip: str) -> tuple[bool, str]:
    """A continuation's chunk without the whitespace it repeats (:func:`heal`): whether
    it still says anything, and what is left to skip."""
    choices = chunk.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        return True, skip
    delta = choice.get("delta")
    holder, field_name = (delta, "content") if isinstance(delta, dict) else (choice, "text")
    text = holder.get(field_name)
    if not isinstance(text, str) or not text:
        return True, skip  # no text in it (yet): skip the next text
    healed, skip = heal(text, skip)
    holder[field_name] = healed
    empty = not healed and not choice.get("finish_reason") and not chunk.get("usage")
    if empty and isinstance(delta, dict):
        empty = not any(v for k, v in delta.items() if k not in ("content", "role"))
    return not empty, skip


@dataclass(slots=True)
class MessagesPartial:
    """What an Anthropic Messages stream sent so far (its events as the client got
    them), and whether it can go on: text blocks only, its ``stop_reason`` not come."""

    content: list[str] = field(default_factory=list)  # its text, piece by piece
    tokens: int = 0  # content_block_delta events: one token each, as the tap counts
    resumable: bool = True
    started: bool = False  # its message_start sent
    blocks: int = 0  # content blocks begun: the next one's index
    open: int | None = None  # the text block begun and not stopped

    def add_chunk(self, data: Mapping[str, Any]) -> None:
        """One parsed event (``message_start``, ``content_block_*``, ``message_delta``,
        ``ping``, ...)."""
        kind = data.get("type")
        if kind == "content_block_delta":
            self.tokens += 1
            delta = data.get("delta")
            text = delta.get("text") if isinstance(delta, Mapping) else None
            if isinstance(delta, Mapping) and delta.get("type") == "text_delta":
                self.content.append(text if isinstance(text, str) else "")
            else:
                self.resumable = False  # a tool's input, a thought, a citation
        elif kind == "content_block_start":
            index, block = data.get("index"), data.get("content_block")
            if isinstance(index, int):
                self.blocks = max(self.blocks, index + 1)
            if not isinstance(block, Mapping) or block.get("type") != "text":
                self.resumable = False  # a tool call begun; a (signed) thought
                return
            self.open = index if isinstance(index, int) else None
            text = block.get("text")
            if isinstance(text, str) and text:
                self.content.append(text)
        elif kind == "content_block_stop":
            if data.get("index") == self.open:
                self.open = None
        elif kind == "message_start":
            self.started = True
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, Mapping) and delta.get("stop_reason"):
                self.resumable = False  # the answer was whole: only its end was lost

    @property
    def text(self) -> str:
        return "".join(self.content)

    def continuation(self, body: Mapping[str, Any]) -> Continuation | None:
        """``body`` with the text so far as the assistant's prefill (its trailing
        whitespace held back: Anthropic refuses a prefill that ends in it) and
        ``max_tokens`` less the tokens sent; None when it cannot go on."""
        messages = body.get("messages")
        if not self.resumable or not isinstance(messages, list) or not messages:
            return None
        out = dict(body)
        if not _shortened(out, ("max_tokens",), self.tokens):
            return None
        text = self.text
        prefix = text.rstrip()
        if prefix:
            out["messages"] = prefilled(messages, prefix)
        last = out["messages"][-1]
        assistant = isinstance(last, Mapping) and last.get("role") == "assistant"
        return Continuation(out, text[len(prefix) :], assistant_text(last) if assistant else "")

    def splice(self, ask: Continuation) -> MessagesSplice:
        return MessagesSplice(self, ask)


class MessagesSplice:
    """A continuation's Messages events as the rest of the first message: its
    ``message_start`` dropped; its first text block going on in the block left open
    (else that block stopped first) and later blocks numbered after the first
    message's; its prefill's echo and the held-back whitespace dropped from its first
    text; its usage the whole answer's."""

    __slots__ = ("_echo", "_index", "_partial", "_sent", "_skip")

    def __init__(self, partial: MessagesPartial, ask: Continuation) -> None:
        self._partial = partial
        self._sent = partial.tokens
        self._skip = ask.skip
        self._echo = ask.echo  # checked against its first text only
        self._index: dict[Any, int] = {}  # its block indexes: the client's

    def events(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in _text_apart(data):
            for spliced in self._spliced(event):
                self._partial.add_chunk(spliced)
                out.append(spliced)
        return out

    def _spliced(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        kind = data.get("type")
        partial = self._partial
        if kind == "message_start":
            return [] if partial.started else [data]
        if kind == "content_block_start":
            block = data.get("content_block")
            text = isinstance(block, Mapping) and block.get("type") == "text"
            before: list[dict[str, Any]] = []
            if partial.open is not None:
                if text and not self._index:  # its first block: on in the open one
                    self._index[data.get("index")] = partial.open
                    return []
                before = [{"type": "content_block_stop", "index": partial.open}]
            self._index[data.get("index")] = partial.blocks
            return [*before, {**data, "index": partial.blocks}]
        if kind in ("content_block_delta", "content_block_stop"):
            index = data.get("index")
            data["index"] = self._index.get(index, index)
            delta = data.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                text = self._healed(delta.get("text"))
                if not text:
                    return []
                delta["text"] = text
            return [data]
        if kind == "message_delta":
            usage = data.get("usage")
            if isinstance(usage, dict):
                data["usage"] = messages_usage(usage, self._sent)
        return [data]

    def _healed(self, text: object) -> str:
        """Its text less the prefill's echo (its first text only) and the whitespace
        held back."""
        if not isinstance(text, str):
            return ""
        if self._echo:
            text = text.removeprefix(self._echo)
            self._echo = ""
        if self._skip:
            text, self._skip = heal(text, self._skip)
        return text

    def encode(self, data: dict[str, Any]) -> bytes:
        return named_event(data)

    def done(self) -> tuple[list[dict[str, Any]], bytes]:
        return [], b""  # (Messages streams send no [DONE])


def named_event(data: Mapping[str, Any]) -> bytes:
    """An event as ``event: <its type>`` and its data (Anthropic's and Responses' SSE)."""
    kind = data.get("type")
    name = b"event: " + kind.encode() + b"\n" if isinstance(kind, str) else b""
    return name + b"data: " + orjson.dumps(data) + b"\n\n"


def _text_apart(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A text block's start that carries text, as the start and a delta with the text
    (which then goes through what a delta's text does); any other event as it is."""
    block = data.get("content_block")
    if data.get("type") != "content_block_start" or not isinstance(block, Mapping):
        return [data]
    text = block.get("text")
    if block.get("type") != "text" or not isinstance(text, str) or not text:
        return [data]
    delta = {"type": "text_delta", "text": text}
    return [
        {**data, "content_block": {**block, "text": ""}},
        {"type": "content_block_delta", "index": data.get("index"), "delta": delta},
    ]


def messages_usage(usage: Mapping[str, Any], sent: int) -> dict[str, Any]:
    """A continuation's Messages usage as the whole answer's: the ``sent`` tokens are
    output, and no longer input (its prompt held them)."""
    out = dict(usage)
    output = usage.get("output_tokens")
    if isinstance(output, int) and not isinstance(output, bool):
        out["output_tokens"] = output + sent
    # Out of its fresh input first, then (a replica that had the prompt in its cache)
    # out of what it read from the cache.
    left = sent
    for name in ("input_tokens", "cache_read_input_tokens"):
        count = usage.get(name)
        if isinstance(count, int) and not isinstance(count, bool) and left:
            moved = min(left, count)
            out[name] = count - moved
            left -= moved
    return out


class ChatContinued:
    """A stream in a dialect the upstream speaks itself (Responses, Gemini) that neither
    API can continue: continued through the slot's OpenAI chat instead, as the request
    in chat form (``to_chat``: its path and body, or None when it has none) with the
    text so far to continue. A dialect's partial reads its own events into
    :attr:`partial` (the text, the reasoning, the tokens, whether it can go on), and
    makes the :class:`ChatSplice` that writes the continuation in its events (its
    formatter set up as if it had written the first stream)."""

    def __init__(self, to_chat: Callable[[Mapping[str, Any]], tuple[str, dict[str, Any]] | None]):
        self.partial = Partial(chat=True)
        self._to_chat = to_chat

    @property
    def tokens(self) -> int:
        return self.partial.tokens

    def continuation(self, body: Mapping[str, Any]) -> Continuation | None:
        if not self.partial.resumable:
            return None
        chat = self._to_chat(body)
        if chat is None:
            return None
        path, chat_body = chat
        ask = continuation(chat_body, chat=True, partial=self.partial)
        if ask is None:
            return None
        accept = {"accept": "text/event-stream"}
        return dataclasses.replace(ask, path=path, headers=accept, prefix="/v1")


class Formatter(Protocol):
    """A dialect's writer of events (``ResponsesFormatter``, ``GeminiFormatter``)."""

    def frames(self, event: Event) -> list[Frame]: ...

    def error(self, error: BaseException) -> list[Frame]: ...

    def end(self) -> list[Frame]: ...


class ChatSplice:
    """A continuation's OpenAI chat chunks as a native dialect's events: decoded
    (:class:`~sluice.upstream.codec.ChunkDecoder`), their text healed of the whitespace
    held back, their usage the whole answer's (the tokens sent before it are output,
    not prompt), then written by the dialect's ``formatter`` (set up as if it had
    written the first stream) and framed by ``encode``."""

    def __init__(
        self,
        partial: Partial,
        skip: str,
        formatter: Formatter,
        encode: Callable[[dict[str, Any]], bytes],
    ) -> None:
        self._decoder = ChunkDecoder(chat=True)
        self._partial = partial
        self._sent = partial.tokens
        self._thought = len(partial.reasoning)  # reasoning tokens sent before it
        self._skip = skip
        self._formatter = formatter
        self.encode = encode

    def events(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        return self._written(self._decoder.feed(data))

    def done(self) -> tuple[list[dict[str, Any]], bytes]:
        return self._written(self._decoder.end()) + _data(self._formatter.end()), b""

    def _written(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, TextDelta) and self._skip:
                text, self._skip = heal(event.text, self._skip)
                if not text:
                    continue
                event = dataclasses.replace(event, text=text)
            if isinstance(event, Finish) and event.usage is not None:
                usage = event.usage
                moved = min(self._sent, usage.prompt_tokens)
                event = dataclasses.replace(
                    event,
                    usage=dataclasses.replace(
                        usage,
                        prompt_tokens=usage.prompt_tokens - moved,
                        completion_tokens=usage.completion_tokens + moved,
                        reasoning_tokens=usage.reasoning_tokens + self._thought,
                    ),
                )
            self._partial.add_event(event)
            if isinstance(event, ErrorEvent):
                out += _data(self._formatter.error(event.error))
            else:
                out += _data(self._formatter.frames(event))
        return out


def _data(frames: list[Frame]) -> list[dict[str, Any]]:
    return [f.data for f in frames if isinstance(f.data, dict)]
