"""Plain engine-side structs: what a request asks of the engine.

These are dataclasses, not wire models: the local backend turns a
neutral request into an :class:`EngineRequest` (``local/completions.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.core.events import Event
from sluice.core.request import SamplingParams
from sluice.engine.reasoning import ReasoningLimit


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """An image's rows in a prompt: ``prompt_tokens[start:start + n]`` are placeholders
    (negative ids drawn from the image's content, so that the prompt cache knows an image
    by what it shows), decoded from the projector's embeddings of ``chunk`` in one piece.

    ``chunk`` is the runner's handle (``llama_media``); ``non_causal``: the image's rows
    attend to each other both ways (Gemma 3's projector)."""

    start: int
    n: int
    chunk: Any
    non_causal: bool = False

    @property
    def end(self) -> int:
        return self.start + self.n


@dataclass(slots=True)
class EngineRequest:
    """One sequence to generate. A response with n choices submits n of these.

    Example::

        EngineRequest(prompt_tokens=[1, 2, 3], max_tokens=16, stop=("\\n",))
    """

    prompt_tokens: list[int]
    max_tokens: int | None = None  # None: until EOS or the end of the context
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # number of top alternatives; None = no logprobs
    echo: bool = False  # send the prompt back as text (text completions)
    render_special: bool = False  # control tokens as text (tool markup like [TOOL_CALLS])
    choice: int = 0
    request_id: str = ""
    # The reasoning block: counted (usage), and closed when its budget is spent.
    reasoning: ReasoningLimit | None = None
    # Images in the prompt, in order (placeholders in prompt_tokens; see MediaSpan).
    media: tuple[MediaSpan, ...] = ()

    def media_floor(self, n: int) -> int:
        """``n`` prompt tokens, or fewer so as not to end inside an image."""
        for span in self.media:
            if span.start < n < span.end:
                return span.start
        return n

    def text_tokens(self) -> list[int]:
        """The prompt without the images' placeholders (samplers' penalties, lookups)."""
        if not self.media:
            return self.prompt_tokens
        return [t for t in self.prompt_tokens if t >= 0]


class SlotState(enum.Enum):
    IDLE = "idle"
    PREFILLING = "prefilling"
    GENERATING = "generating"
    FINISHED = "finished"


class EventSink(Protocol):
    """Where the engine thread delivers a request's events (thread-safe).

    Called once per engine step with everything that step produced for the
    request, so a busy batch costs one cross-thread wake-up per request.

    Backpressure: :meth:`backlog` is how many deliveries the consumer has not
    taken yet. Past the engine's bound (``EngineConfig.stream_buffer``) the
    request's sequences are not decoded, and the engine calls :meth:`pause`
    so that the consumer can wake it when it has caught up. A sink whose
    consumer never falls behind returns 0 and may ignore ``pause``.

    Example (a sink that never holds anything back)::

        class Collect:
            def __init__(self) -> None:
                self.events: list[Event] = []
            def put_many(self, events: list[Event]) -> None:
                self.events.extend(events)
            def backlog(self) -> int:
                return 0
            def pause(self, resume_at: int, wake: Callable[[], None]) -> None:
                pass
    """

    def put_many(self, events: list[Event]) -> None:
        """Engine thread: one step's events for this request."""
        ...

    def backlog(self) -> int:
        """Engine thread: deliveries not yet taken by the consumer (cheap: once per step)."""
        ...

    def pause(self, resume_at: int, wake: Callable[[], None]) -> None:
        """Engine thread: decoding for this sink stopped; call ``wake()`` (from any
        thread, at least once) when :meth:`backlog` is at most ``resume_at``,
        at once if it already is."""
        ...
