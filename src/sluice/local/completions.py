"""The local model's half of the seam: a neutral request -> engine requests -> events.

Everything knowable before the first byte is checked in :meth:`prepare` and
:meth:`open` (fields, template, tokens, context, sampler, capacity), so a
route can still answer with a real HTTP status when any of it fails.

Example::

    service = CompletionService(engine, template, options)
    gen = service.prepare(request)          # a GenerationRequest
    stream = service.open(gen)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.core.backend import StreamMeta
from sluice.core.errors import EngineFailure, InvalidRequest
from sluice.core.events import Event
from sluice.core.media import Picture, Sound
from sluice.core.request import (
    LLAMA_CPP_SAMPLING,
    GenerationRequest,
    SamplerDefaults,
    SamplingParams,
)
from sluice.engine.engine import Engine
from sluice.engine.reasoning import ReasoningLimit
from sluice.engine.types import EngineRequest, MediaSpan
from sluice.grammar.build import after_reasoning
from sluice.local.budget import ReasoningBudgets
from sluice.local.media import has_audio, has_images, pictures, take_images, tokens_with_images
from sluice.local.parsing import parse_stream
from sluice.local.plan import OutputPlan, ToolLimits
from sluice.local.prompt import ControlTextGuard
from sluice.local.stream import EventStream
from sluice.local.templates import ChatTemplate
from sluice.parsers.base import StreamParser
from sluice.parsers.families import format_for
from sluice.parsers.registry import template_opens_think

log = logging.getLogger("sluice.serving")


@dataclass(frozen=True, slots=True)
class ServiceOptions:
    default_max_tokens: int | None = None  # chat; None = until EOS or end of context
    tool_format: str | None = None  # hermes | llama3 | mistral | generic; None: from template
    # /v1/completions: control-token text in a prompt becomes control tokens (the
    # client writes the whole prompt there); chat message text never does.
    prompt_special_tokens: bool = True
    tool_limits: ToolLimits = field(default_factory=ToolLimits)
    sampler: SamplerDefaults = LLAMA_CPP_SAMPLING  # for fields a request leaves out
    budgets: ReasoningBudgets = field(default_factory=ReasoningBudgets)


@dataclass(slots=True)
class Generation:
    """A request that passed validation, ready to submit."""

    meta: StreamMeta
    requests: list[EngineRequest]
    echo_texts: dict[int, str] = field(default_factory=dict)
    parsers: Callable[[int], list[StreamParser]] | None = None  # per choice


class CompletionService:
    """Chat and text completions on one local engine."""

    def __init__(
        self, name: str, engine: Engine, template: ChatTemplate, options: ServiceOptions
    ) -> None:
        self.name = name
        self.engine = engine
        self.runner = engine.runner
        self.template = template
        self.options = options
        source = self.runner.info.chat_template if template.available else None
        # The family's output format, learned from its template once, at load.
        self.format = format_for(
            source, template.render_probe if source else None, options.tool_format
        )
        self.tool_format = self.format.name
        self.reasoning = self.format.reasoning
        self.guard = ControlTextGuard(self.runner.control_texts)
        self.tool_limits = options.tool_limits

    # -- chat ----------------------------------------------------------------

    def prepare(self, request: GenerationRequest) -> Generation:
        if request.is_chat:
            return self.prepare_chat(request)
        return self.prepare_text(request)

    def chat_prompt(
        self, body: GenerationRequest
    ) -> tuple[OutputPlan, list[int], tuple[MediaSpan, ...]]:
        """The output plan (tools, grammar, parsers), the templated prompt's tokens and
        the images among them (``local/media.py``)."""
        assert body.messages is not None
        plan = OutputPlan.build(
            body, fmt=self.format, reasoning=self.reasoning, limits=self.tool_limits
        )
        plan.reasoning_budget = self.options.budgets.resolve(body, forced_call=plan.forced_call)
        if body.continue_final:
            _check_final(body.messages)
        messages = plan.prepare_messages(body.messages)
        extra = {**plan.template_extra(), **(body.template_kwargs or {})}
        if body.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", body.reasoning_effort)
        if plan.reasoning_budget == 0:  # no reasoning: the template's own switch, off
            extra.setdefault("enable_thinking", False)
            extra.setdefault("thinking", False)
        # Everything the request put into the prompt is text, never control tokens.
        messages = self.guard.escape(messages)
        final: tuple[str, str] | None = None  # a continued answer's text and reasoning
        if body.continue_final:
            messages, final = self._final_to_continue(messages, plan)
        images: list[Picture | Sound] = []
        projector = getattr(self.runner, "projector", None)
        if has_audio(messages) and not getattr(projector, "audio", False):
            raise InvalidRequest(
                f"The model '{self.name}' does not accept audio (its projector, if it has "
                "one, has no audio encoder).",
                param="messages",
            )
        if has_images(messages) or has_audio(messages):
            if projector is None:
                raise InvalidRequest(
                    f"The model '{self.name}' has no vision projector: it cannot take "
                    "images. Send text, or give the model its projector (mmproj).",
                    param="messages",
                )
            messages, sources = take_images(messages)
            images = pictures(sources)
        prompt_text = self.template.render(messages, extra=self.guard.escape(extra))
        if final is not None and plan.reasoning is None:
            prompt_text += final[0]
        if plan.opening and not prompt_text.endswith(plan.opening):
            plan.opening = ""  # the prompt did not write it (no generation prompt)
        if plan.reasoning is not None:
            start, end = plan.reasoning.start, plan.reasoning.end
            opened = template_opens_think(prompt_text, start, end) if start else True
            if final is not None:
                prompt_text, opened = _continued(prompt_text, final, start, end, opened)
            if opened and plan.reasoning_budget == 0 and start:
                # A template that opens the block whatever it is told: closed at once, in
                # the prompt (an empty block, as templates write "thinking off").
                prompt_text += end
                opened = False
            plan.reasoning_opened = opened
            lead = plan.reasoning.lead
            if opened and lead and prompt_text.endswith(lead):
                plan.reasoning_lead = lead
            if opened and plan.grammar is not None and not plan.triggers:
                # The prompt opened a reasoning block: the grammar engages after it.
                also = (plan.answer_start,)  # the reader ends reasoning there too
                plan.grammar = after_reasoning(plan.grammar, end, also)
        if images:
            tokens, media = self._tokenize_with_images(prompt_text, images)
            return plan, tokens, media
        return plan, self._tokenize_prompt(prompt_text), ()

    def _final_to_continue(
        self, messages: list[dict[str, Any]], plan: OutputPlan
    ) -> tuple[list[dict[str, Any]], tuple[str, str]]:
        """The messages before the final one, and the final (assistant) message's text
        and reasoning: the answer's beginning, which the prompt ends with (as llama.cpp
        continues a final message: the generation prompt, then the reasoning, closed if
        text follows, then the text)."""
        final = messages[-1] if messages else {}
        if self.format.name == "harmony":
            raise InvalidRequest(
                f"The model '{self.name}' (gpt-oss's channels) cannot continue an "
                "assistant message.",
                param="messages",
            )
        if plan.grammar is not None and not plan.triggers:
            raise InvalidRequest(
                "An assistant message to continue cannot be combined with a response "
                "format or a forced tool call: their grammar starts the answer afresh.",
                param="messages",
            )
        content = final.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise InvalidRequest(
                    "The assistant message to continue can only hold text.",
                    param="messages",
                )
            content = "".join(str(p.get("text") or "") for p in content)
        thought = final.get("reasoning_content")
        return messages[:-1], (content or "", thought if isinstance(thought, str) else "")

    def _reasoning_limit(self, plan: OutputPlan) -> ReasoningLimit | None:
        """Where the engine finds the reasoning block, and the budget's closer."""
        syntax = plan.reasoning
        if syntax is None or not syntax.end:
            return None
        budget = plan.reasoning_budget
        closer: tuple[int, ...] = ()
        if budget >= 0:
            message = self.options.budgets.message
            text = f"{message}{syntax.end}"
            closer = tuple(self.runner.tokenize(text, add_special=False, parse_special=True))
        ends = tuple(e.encode() for e in (syntax.end, plan.answer_start) if e)
        return ReasoningLimit(
            start=syntax.start.encode(),
            ends=ends,
            closer=closer,
            budget=budget if budget >= 0 else None,
            opened=plan.reasoning_opened,
        )

    def prepare_chat(self, body: GenerationRequest) -> Generation:
        plan, tokens, media = self.chat_prompt(body)
        self.engine.check_prompt(len(tokens))
        if media:  # encoded here, on this worker thread: the engine's streams go on
            media = self._encoded(media)
        top_n = body.logprobs
        limit = body.max_tokens
        if limit is None:
            limit = self.options.default_max_tokens
        sampling = replace(
            self._sampling(body.sampling),
            grammar=plan.grammar,
            grammar_triggers=plan.triggers,
            grammar_trigger_words=plan.trigger_words,
        )
        reasoning = self._reasoning_limit(plan)
        requests = [
            EngineRequest(
                prompt_tokens=tokens,
                max_tokens=limit,
                stop=body.stop,
                sampling=_choice_seed(sampling, i),
                logprobs=top_n,
                choice=i,
                render_special=plan.render_special,
                reasoning=reasoning,
                media=media,
            )
            for i in range(body.n)
        ]
        meta = StreamMeta(
            model=self.name,
            slot=self.name,
            choices=body.n,
            prompt_owners=frozenset({0}),
            logprobs=top_n is not None,
        )
        return Generation(meta, requests, parsers=plan.parsers if plan.has_parsers else None)

    # -- text ----------------------------------------------------------------

    def prepare_text(self, body: GenerationRequest) -> Generation:
        assert body.prompts is not None
        requests: list[EngineRequest] = []
        echo_texts: dict[int, str] = {}
        owners: set[int] = set()
        sampling = self._sampling(body.sampling)
        for p_index, prompt in enumerate(body.prompts):
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
                        stop=body.stop,
                        sampling=_choice_seed(sampling, j),
                        logprobs=body.logprobs,
                        echo=with_lp_echo,
                        choice=choice,
                    )
                )
        meta = StreamMeta(
            model=self.name,
            slot=self.name,
            choices=len(requests),
            prompt_owners=frozenset(owners),
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

    def _sampling(self, sampling: SamplingParams) -> SamplingParams:
        for token, _bias in sampling.logit_bias:
            if not 0 <= token < self.runner.n_vocab:
                raise InvalidRequest(
                    f"logit_bias token id {token} is out of range (the vocabulary has "
                    f"{self.runner.n_vocab} tokens)",
                    param="logit_bias",
                )
        return self.options.sampler.fill(sampling)

    def _encoded(self, media: tuple[MediaSpan, ...]) -> tuple[MediaSpan, ...]:
        """Each image's embeddings, computed now."""
        projector = self.runner.projector  # type: ignore[attr-defined]
        out = []
        for k, span in enumerate(media):
            try:
                out.append(replace(span, chunk=projector.encode(span.chunk)))
            except RuntimeError as exc:  # (its bytes were checked: the projector failed)
                raise EngineFailure(f"Image {k + 1} could not be encoded: {exc}") from exc
        return tuple(out)

    def _add_bos(self, text: str) -> bool:
        info = self.runner.info
        # A template that writes the BOS itself must not get a second one.
        return info.add_bos and not (info.bos_token and text.startswith(info.bos_token))

    def _tokenize_prompt(self, text: str) -> list[int]:
        return self.guard.tokenize(text, self.runner.tokenize, add_special=self._add_bos(text))

    def _tokenize_with_images(
        self, text: str, images: list[Picture | Sound]
    ) -> tuple[list[int], tuple[MediaSpan, ...]]:
        add_bos = self._add_bos(text)
        runner = self.runner

        def piece(part: str, first: bool) -> list[int]:
            return self.guard.tokenize(part, runner.tokenize, add_special=add_bos and first)

        bos = runner.tokenize("", add_special=True, parse_special=False) if add_bos else []
        return tokens_with_images(
            text,
            images,
            piece,
            runner.projector.pieces,  # type: ignore[attr-defined]
            bos=bos,
            max_rows=runner.n_batch,
        )


def _choice_seed(sampling: SamplingParams, index: int) -> SamplingParams:
    """Distinct but reproducible seeds for the choices of one request (never 2**32-1,
    which llama.cpp reads as "random")."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) % 0xFFFFFFFF)


def _check_final(messages: list[dict[str, Any]]) -> None:
    """That the request's final message is one the model can continue (as written,
    before a format turns its calls into text)."""
    final = messages[-1] if messages else {}
    if final.get("role") != "assistant":
        raise InvalidRequest(
            "Only an assistant message last in 'messages' can be continued.", param="messages"
        )
    if final.get("tool_calls"):
        raise InvalidRequest(
            "An assistant message with tool calls cannot be continued: it is complete.",
            param="messages",
        )


def _continued(
    prompt: str, final: tuple[str, str], start: str, end: str, opened: bool
) -> tuple[str, bool]:
    """``prompt`` followed by the answer's beginning (``final``: its text and reasoning)
    in a family with a reasoning block (``opened``: the prompt opened it); and whether
    the block is still open, the model continuing the reasoning."""
    text, thought = final
    if not (opened or thought):
        return prompt + text, False
    if not opened:
        prompt += start
    prompt += thought
    if not text:
        return prompt, True
    return prompt + end + text, False
