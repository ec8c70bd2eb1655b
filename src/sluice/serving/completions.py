"""The completion service: wire request -> validated engine requests -> event stream.

Everything knowable before the first byte is checked in ``prepare_*`` and
``open`` (model, fields, template, tokens, context, sampler, capacity), so a
route can still answer with a real HTTP status when any of it fails.

Example::

    service = CompletionService(engine, template, settings)
    gen = service.prepare_chat(ChatCompletionRequest.model_validate(body))
    stream = service.open(gen)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.engine.engine import Engine
from sluice.engine.types import EngineRequest, SamplingParams
from sluice.errors import InvalidRequest, ModelNotFound, UnsupportedParameter
from sluice.events import Event
from sluice.parsers.base import StreamParser
from sluice.parsers.registry import detect_reasoning, detect_tool_format, template_opens_think
from sluice.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from sluice.serving.formatters.openai import ResponseMeta
from sluice.serving.parsing import parse_stream
from sluice.serving.prompt import ControlTextGuard
from sluice.serving.stream import EventStream
from sluice.serving.templates import ChatTemplate
from sluice.serving.tools import OutputPlan, ReasoningMarkers, ToolLimits

log = logging.getLogger("sluice.serving")


@dataclass(frozen=True, slots=True)
class ServiceOptions:
    strict_model_names: bool = False
    default_max_tokens: int | None = None  # chat; None = until EOS or end of context
    tool_format: str | None = None  # hermes | llama3 | mistral | generic; None: from template
    # /v1/completions: control-token text in a prompt becomes control tokens (the
    # client writes the whole prompt there); chat message text never does.
    prompt_special_tokens: bool = True
    tool_limits: ToolLimits = field(default_factory=ToolLimits)


@dataclass(slots=True)
class Generation:
    """A request that passed validation, ready to submit."""

    meta: ResponseMeta
    requests: list[EngineRequest]
    echo_texts: dict[int, str] = field(default_factory=dict)
    parsers: Callable[[int], list[StreamParser]] | None = None  # per choice


class CompletionService:
    """Chat and text completions on one local engine."""

    def __init__(self, engine: Engine, template: ChatTemplate, options: ServiceOptions) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.template = template
        self.options = options
        self.model_id = self.runner.info.id
        source = self.runner.info.chat_template if template.available else None
        self.tool_format = options.tool_format or detect_tool_format(source)
        markers = detect_reasoning(source)
        self.reasoning = ReasoningMarkers(*markers) if markers else None
        self.guard = ControlTextGuard(self.runner.control_texts)
        # No output can be longer than this many characters: a schema maximum past it
        # is the same as none (and costs no grammar repetitions).
        self.tool_limits = replace(
            options.tool_limits,
            max_output_chars=self.runner.n_ctx_seq * self.runner.max_piece_bytes,
        )

    # -- models --------------------------------------------------------------

    def resolve_model(self, requested: str | None) -> str:
        """The served model id for a request's ``model`` field.

        With one model served, any name selects it (as llama.cpp's server and
        spec 000's examples, ``model="local-model"``, expect) unless strict
        names are configured.
        """
        if requested is None or requested == self.model_id:
            return self.model_id
        if self.options.strict_model_names:
            raise ModelNotFound(requested)
        return self.model_id

    def model_card(self) -> dict[str, Any]:
        info = self.runner.info
        return {
            "id": info.id,
            "object": "model",
            "created": 0,
            "owned_by": "sluice",
            "meta": {
                "n_ctx": self.runner.n_ctx_seq,
                "n_ctx_train": info.n_ctx_train,
                "n_params": info.n_params,
                "size": info.size_bytes,
                "description": info.description,
                "chat_template": info.chat_template is not None,
            },
        }

    # -- chat ----------------------------------------------------------------

    def prepare_chat(self, body: ChatCompletionRequest) -> Generation:
        _reject_unsupported_chat(body)
        model = self.resolve_model(body.model)
        plan = OutputPlan.build(
            body, fmt=self.tool_format, reasoning=self.reasoning, limits=self.tool_limits
        )
        messages = plan.prepare_messages(
            [_template_message(i, m) for i, m in enumerate(body.messages)]
        )
        extra = {**plan.template_extra(), **(body.chat_template_kwargs or {})}
        if body.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", body.reasoning_effort)
        # Everything the request put into the prompt is text, never control tokens.
        prompt_text = self.template.render(
            self.guard.escape(messages), extra=self.guard.escape(extra)
        )
        if plan.reasoning is not None:
            # A grammar that engages from the first token leaves no room for reasoning:
            # the output is the answer (or the calls) even if the template opened a block.
            constrained = plan.grammar is not None and not plan.triggers
            plan.reasoning_opened = template_opens_think(prompt_text) and not constrained
        tokens = self._tokenize_prompt(prompt_text)
        self.engine.check_prompt(len(tokens))
        top_n = body.top_logprobs_n()
        limit = body.token_limit()
        if limit is None:
            limit = self.options.default_max_tokens
        sampling = replace(
            self._sampling(body), grammar=plan.grammar, grammar_triggers=plan.triggers
        )
        requests = [
            EngineRequest(
                prompt_tokens=tokens,
                max_tokens=limit,
                stop=body.stop_strings(),
                sampling=_choice_seed(sampling, i),
                logprobs=top_n,
                choice=i,
                render_special=plan.render_special,
            )
            for i in range(body.n)
        ]
        meta = ResponseMeta(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            prompt_owners=frozenset({0}),
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            logprobs=top_n is not None,
        )
        return Generation(meta, requests, parsers=plan.parsers if plan.has_parsers else None)

    # -- text ----------------------------------------------------------------

    def prepare_text(self, body: CompletionRequest) -> Generation:
        if body.suffix:
            raise UnsupportedParameter("suffix", "(fill-in-the-middle) is not supported")
        if body.best_of is not None and body.best_of != body.n:
            raise UnsupportedParameter("best_of", "other than n is not supported")
        model = self.resolve_model(body.model)
        requests: list[EngineRequest] = []
        echo_texts: dict[int, str] = {}
        owners: set[int] = set()
        sampling = self._sampling(body)
        for p_index, prompt in enumerate(body.prompts()):
            if isinstance(prompt, str):
                tokens = self.runner.tokenize(
                    prompt, add_special=True, parse_special=self.options.prompt_special_tokens
                )
                text = prompt
            else:
                bad = [t for t in prompt if not 0 <= t < self.runner.n_vocab]
                if bad:
                    raise InvalidRequest(
                        f"prompt token id {bad[0]} is out of range", param="prompt"
                    )
                tokens = list(prompt)
                text = b"".join(self.runner.token_bytes(t) for t in tokens).decode(
                    "utf-8", "replace"
                )
            self.engine.check_prompt(len(tokens), param="prompt")
            for j in range(body.n):
                choice = p_index * body.n + j
                if j == 0:
                    owners.add(choice)
                with_lp_echo = body.echo and body.logprobs is not None
                if body.echo and not with_lp_echo:
                    echo_texts[choice] = text
                requests.append(
                    EngineRequest(
                        prompt_tokens=tokens,
                        max_tokens=body.max_tokens,
                        stop=body.stop_strings(),
                        sampling=_choice_seed(sampling, j),
                        logprobs=body.logprobs,
                        echo=with_lp_echo,
                        choice=choice,
                    )
                )
        meta = ResponseMeta(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            prompt_owners=frozenset(owners),
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            logprobs=body.logprobs is not None,
        )
        return Generation(meta, requests, echo_texts)

    # -- both ----------------------------------------------------------------

    def open(self, gen: Generation, loop: asyncio.AbstractEventLoop | None = None) -> EventStream:
        """Submit to the engine (capacity is checked here) and return the stream.

        With ``loop`` given this may run on a worker thread (sampler and grammar
        set-up happen here); events are delivered to ``loop``.
        """
        return EventStream.open(self.engine, gen.requests, gen.echo_texts, loop=loop)

    def events(self, gen: Generation, stream: EventStream) -> AsyncIterator[Event]:
        """The response's events: the engine's, through the output parsers if any."""
        if gen.parsers is None:
            return stream.__aiter__()
        return parse_stream(stream.__aiter__(), gen.parsers)

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        sampling = body.sampling_params()
        for token, _bias in sampling.logit_bias:
            if not 0 <= token < self.runner.n_vocab:
                raise InvalidRequest(
                    f"logit_bias token id {token} is out of range (the vocabulary has "
                    f"{self.runner.n_vocab} tokens)",
                    param="logit_bias",
                )
        return sampling

    def _tokenize_prompt(self, text: str) -> list[int]:
        info = self.runner.info
        # A template that writes the BOS itself must not get a second one.
        add_bos = info.add_bos and not (info.bos_token and text.startswith(info.bos_token))
        return self.guard.tokenize(text, self.runner.tokenize, add_special=add_bos)


def _choice_seed(sampling: SamplingParams, index: int) -> SamplingParams:
    """Distinct but reproducible seeds for the choices of one request (never 2**32-1,
    which llama.cpp reads as "random")."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) % 0xFFFFFFFF)


def _reject_unsupported_chat(body: ChatCompletionRequest) -> None:
    if body.functions or body.function_call:
        raise UnsupportedParameter(
            "functions", "(the deprecated function-calling API) is not supported; use 'tools'"
        )
    if body.audio is not None or (body.modalities and set(body.modalities) - {"text"}):
        raise UnsupportedParameter("modalities", "other than text are not supported")
    if body.prediction is not None:
        raise UnsupportedParameter("prediction", "(predicted outputs) is not supported")


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A wire message as the plain dict chat templates expect."""
    content: str | None
    if isinstance(message.content, list):
        parts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise UnsupportedParameter(
                    f"messages[{index}].content", f"parts of type '{part.type}' are not supported"
                )
            parts.append(part.text)
        content = "".join(parts)
    else:
        content = message.content
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content or message.reasoning
    if reasoning:
        out["reasoning_content"] = reasoning
    return out
