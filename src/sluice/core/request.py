"""The dialect-neutral request: the seam between the wire dialects and the backends.

Every route converts its wire body into a :class:`GenerationRequest`; a
backend (the local llama.cpp model now, an upstream server next) answers it
with a :class:`~sluice.core.backend.ResponseStream`. Nothing here is
OpenAI's or LM Studio's shape: messages are the plain dicts chat templates
take, tools are OpenAI-style function definitions (the lingua franca of chat
templates), sampling is the engine's parameter set.

Example::

    request = GenerationRequest(
        model="smollm2",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=32,
    )
    stream = await backend.open(request)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampler chain settings (llama.cpp semantics).

    ``temperature <= 0`` means greedy. ``seed is None`` means random.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None  # GBNF; constrains every sampled token
    grammar_triggers: tuple[str, ...] = ()  # regexes: the grammar engages once one matches
    # The literal texts every trigger match's capture starts with (a hint that lets
    # the local engine run the patterns only when one appears: sluice.engine.trigger).
    grammar_trigger_words: tuple[str, ...] = ()

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request for generated text: a chat (``messages``) or prompts (``prompts``).

    ``n`` choices per prompt; a text request with several prompts answers
    ``len(prompts) * n`` choices, numbered prompt by prompt.
    """

    model: str | None = None
    # chat: role, content (text), and optionally name, tool_calls, tool_call_id,
    # reasoning_content, as chat templates take them
    messages: list[dict[str, Any]] | None = None
    # text completion: prompts as text or token ids
    prompts: list[str | list[int]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    template_kwargs: dict[str, Any] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the backend's default (chat: until EOS or context)
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None  # alternatives per token (0: only the chosen); None: none
    echo: bool = False  # text: the prompt is part of the answer (with logprobs if asked)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None
