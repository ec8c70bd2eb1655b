"""Mid-stream failover: another replica continues an answer the first one dropped.

When an upstream fails after it streamed part of an answer (a dropped connection, a
silence past the timeout, a stream ended without its finish), another replica of the
slot is asked to continue from what was already sent: the same request with the
partial answer as the assistant's final message to continue (``continue_final_message``
and ``add_generation_prompt: false``, which vLLM, SGLang and llama.cpp's server read;
llama-server also continues a final assistant message by itself), or for
``/v1/completions`` the prompt followed by the text so far. Its stream is spliced on, so
the client reads one answer: nothing repeated or lost, one ``finish_reason``, usage
summed (the continuation's completion tokens plus those already sent; its prompt
tokens less those, which were the first answer's).

What cannot be continued is not: an answer with tool calls begun (no server continues
one), several choices (``n`` > 1), a prompt of token ids. Then the failure ends the
stream as before.

Example::

    partial = Partial()
    partial.add_chunk(chunk)                       # each parsed chunk forwarded
    body = continuation_body(request_body, chat=True, partial=partial)   # or None
    usage = spliced_usage(continuation_usage, sent=tokens_before_it)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.core.events import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart


@dataclass(slots=True)
class Partial:
    """What one answer streamed so far (its first choice), and whether it can go on."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tokens: int = 0  # content-bearing chunks: one token each on the servers that stream so
    resumable: bool = True

    def add_chunk(self, chunk: Mapping[str, Any]) -> None:
        """One parsed OpenAI chunk (chat ``delta`` or completions ``text``)."""
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


@dataclass(frozen=True, slots=True)
class Continuation:
    """The request that continues an answer, and the whitespace its text ended with,
    held back from it: a prefix that ends in a space would be tokenized with the space
    alone where the model wrote it as the next word's first character, and the model
    then continues differently (what "token healing" repairs). The continuation writes
    that space again; :func:`heal` drops it."""

    body: dict[str, Any]
    skip: str


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
    for name in ("max_tokens", "max_completion_tokens"):
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - partial.tokens < 1:
                return None  # the answer is as long as it may be: nothing to continue
            out[name] = limit - partial.tokens
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        last: dict[str, Any] = {"role": "assistant", "content": text}
        if partial.reasoning:
            last["reasoning_content"] = "".join(partial.reasoning)
        out["messages"] = [*messages, last]
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
