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

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

# A GGUF's recommended sampling (llama.cpp's general.sampling.* keys) -> the field.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "penalty_last_n",
}


@dataclass(frozen=True, slots=True)
class SamplerDefaults:
    """What a request that leaves a sampling field out gets: the model's declared
    defaults (its config entry, else its GGUF's ``general.sampling.*``), else
    llama.cpp's own server's (which LM Studio and Ollama share but for Ollama's top-p
    0.9): what keeps small local models coherent. An explicit value always wins.

    Example::

        SamplerDefaults().fill(SamplingParams(top_k=0))  # top_k stays 0: no top-k
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # 1.0: none
    penalty_last_n: int = 64  # tokens the penalties look back over
    source: str = "llama.cpp"  # where they come from: llama.cpp | gguf | config

    def fill(self, s: SamplingParams) -> SamplingParams:
        if None not in (
            s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.penalty_last_n
        ):  # fmt: skip
            return s
        return replace(
            s,
            temperature=self.temperature if s.temperature is None else s.temperature,
            top_k=self.top_k if s.top_k is None else s.top_k,
            top_p=self.top_p if s.top_p is None else s.top_p,
            min_p=self.min_p if s.min_p is None else s.min_p,
            repeat_penalty=self.repeat_penalty if s.repeat_penalty is None else s.repeat_penalty,
            penalty_last_n=self.penalty_last_n if s.penalty_last_n is None else s.penalty_last_n,
        )

    def over(self, values: dict[str, float], source: str) -> SamplerDefaults:
        """These defaults with ``values`` (field -> value) on top, if any."""
        known = {k: v for k, v in values.items() if k in _DEFAULTED}
        if not known:
            return self
        for integer in ("top_k", "penalty_last_n"):
            if integer in known:
                known[integer] = int(known[integer])
        return replace(self, source=source, **known)  # type: ignore[arg-type]

    @staticmethod
    def from_gguf(read: Callable[[str], Any]) -> dict[str, float]:
        """A GGUF's declared values (field -> value); ``read(key)`` gives a metadata
        value or None. A value that is not a number is left out."""
        out: dict[str, float] = {}
        for key, name in GGUF_SAMPLING_KEYS.items():
            value = read(key)
            if value is None:
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number) and (name != "repeat_penalty" or number > 0):
                out[name] = number
        return out

    @classmethod
    def declared(
        cls, gguf: dict[str, float], config: tuple[tuple[str, float], ...] = ()
    ) -> SamplerDefaults:
        """A model's defaults: its config entry's values, else its GGUF's, else llama.cpp's."""
        return cls().over(gguf, "gguf").over(dict(config), "config")

    def as_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.penalty_last_n,
            "source": self.source,
        }


_DEFAULTED = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "penalty_last_n")
LLAMA_CPP_SAMPLING = SamplerDefaults()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampler chain settings (llama.cpp semantics).

    ``temperature <= 0`` means greedy. ``seed is None`` means random. The fields
    that may be ``None`` were left out by the client: the backend fills them (a local
    model with its :class:`SamplerDefaults`; an upstream is not sent them).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None  # llguidance Lark (sluice.grammar); constrains sampling
    grammar_triggers: tuple[str, ...] = ()  # regexes: the grammar engages once one matches
    # The literal texts every trigger match's capture starts with (a hint that lets
    # the local engine run the patterns only when one appears: sluice.engine.trigger).
    grammar_trigger_words: tuple[str, ...] = ()
    # Fewer decode steps (a local model; None: the server's setting): the most tokens a
    # prompt-lookup draft may propose (0: no speculation), and whether tokens a grammar
    # forces are decoded without sampling (jump-forward). Neither changes the output.
    max_draft: int | None = None
    jump_forward: bool | None = None

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repeat_penalty not in (None, 1.0)
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
    # Tokens the reasoning block may take (0: none, -1: no limit; None: from the effort
    # or the server's setting; see sluice.local.budget).
    reasoning_budget: int | None = None
    template_kwargs: dict[str, Any] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the backend's default (chat: until EOS or context)
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None  # alternatives per token (0: only the chosen); None: none
    echo: bool = False  # text: the prompt is part of the answer (with logprobs if asked)
    # chat: the final (assistant) message is the answer's beginning, which the model
    # continues (Anthropic's prefill, OpenAI-compatible servers' continue_final_message);
    # the answer holds only what follows it
    continue_final: bool = False

    @property
    def is_chat(self) -> bool:
        return self.messages is not None
