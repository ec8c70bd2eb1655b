"""Forced calls as the server plans them, walked and read back (tests/grammar/test_agreement.py).

:func:`formats` lists one shipped template per distinct output format, and the
hand-written formats by ``tool_format``. :func:`planned` builds a request's
:class:`OutputPlan` through :meth:`CompletionService.chat_prompt`, the server's own
path (grammar, reasoning block opened by the prompt, parsers), on a stand-in model
that has only the template. :func:`read` runs a text through the plan's parser chain
and folds the events into what a client gets; :func:`problems` says how a reading
differs from the text that was walked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from types import SimpleNamespace
from typing import Any

import jsonschema

from sluice.core.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart
from sluice.core.syntax import (
    GEMMA_QUOTE,
    KEY_NAME,
    STRING_FLAG,
    TYPE_NAME,
    GemmaArgs,
    Lit,
    OutputFormat,
    TaggedArgs,
)
from sluice.dialects.openai.schema import ChatCompletionRequest
from sluice.local.completions import CompletionService, ServiceOptions
from sluice.local.parsing import ParserChain
from sluice.local.plan import FRAMINGS, OutputPlan
from sluice.local.templates import ChatTemplate
from sluice.templates import bundled, names
from tests.support.rendering import calls_pattern

# Formats written by hand and chosen by tool_format (on a template that shows no calls).
OVERRIDES = ("hermes", "generic", "mistral", "llama3")


@cache
def service(template: str, tool_format: str | None = None) -> CompletionService:
    """A chat service for ``template`` on a model that is only its template."""
    source = bundled(template)
    assert source is not None, template
    chat = ChatTemplate(source, bos_token="<s>", eos_token="</s>", model_id=template)
    runner = SimpleNamespace(
        info=SimpleNamespace(chat_template=source, add_bos=False, bos_token=""),
        control_texts=(),
        tokenize=lambda text, **_: [],
    )
    engine: Any = SimpleNamespace(runner=runner)
    return CompletionService(template, engine, chat, ServiceOptions(tool_format=tool_format))


def _key(fmt: OutputFormat) -> str:
    """What of a format a forced call's grammar and parsers read (not its end of turn)."""
    return repr((fmt.name, fmt.tools, fmt.reasoning, fmt.content_start, fmt.content_end))


@cache
def formats() -> list[tuple[str, str | None]]:
    """(template, tool_format): one template for each format the server can use."""
    out: dict[str, tuple[str, str | None]] = {}
    for name in names():
        fmt = service(name).format
        if fmt.tools is not None or fmt.name == "harmony":
            out.setdefault(_key(fmt), (name, None))
    for override in OVERRIDES:
        out.setdefault(override, ("Qwen-Qwen3-0.6B", override))
    return list(out.values())


def request(tools: list[dict[str, Any]], choice: Any, parallel: bool | None, thinking: bool) -> Any:
    extra: dict[str, Any] = {} if thinking else {"thinking_budget_tokens": 0}
    if parallel is not None:
        extra["parallel_tool_calls"] = parallel
    return ChatCompletionRequest(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice=choice,
        max_tokens=4096,
        **extra,
    ).to_request()


def planned(template: str, tool_format: str | None, body: Any) -> OutputPlan:
    plan, _, _ = service(template, tool_format).chat_prompt(body)
    assert plan.grammar is not None
    return plan


def markup(plan: OutputPlan, fmt: OutputFormat) -> list[str]:
    """The family's markup: what the grammar writes around names and values."""
    texts = [*plan.markup, plan.opening, fmt.end_of_turn]
    if plan.reasoning is not None:
        texts += [plan.reasoning.start, plan.reasoning.end, plan.reasoning.lead]
    if plan.syntax is not None:
        s = plan.syntax
        texts += [s.section_start, s.section_end, s.separator]
        for e in s.call:
            if isinstance(e, Lit):
                texts.append(e.text)
            elif isinstance(e, TaggedArgs):
                texts += [e.key_prefix, e.value_prefix]
                texts += (
                    e.key_suffix.replace(STRING_FLAG, "\0").replace(TYPE_NAME, "\0").split("\0")
                )
                texts += e.value_suffix.split(KEY_NAME)
            elif isinstance(e, GemmaArgs):
                texts.append(GEMMA_QUOTE)
    else:
        framing = FRAMINGS[plan.fmt]
        texts += [framing.prefix, framing.call_open, framing.call_close, framing.sep]
        texts += [framing.suffix]
    return [t for t in dict.fromkeys(texts) if t and t.strip()]


@cache
def every_markup() -> tuple[str, ...]:
    """Every family's markup (what a walk splices into free text)."""
    found: dict[str, None] = {}
    for template, tool_format in formats():
        fmt = service(template, tool_format).format
        tools = [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
            }
        ]
        plan = planned(template, tool_format, request(tools, "required", None, True))
        for text in markup(plan, fmt):
            found[text] = None
            for piece in re.findall(r"\S+", text):
                found[piece] = None
    return tuple(found)


@dataclass
class Reading:
    content: str = ""
    reasoning: str = ""
    calls: list[list[str]] = field(default_factory=list)  # [name, id, arguments]


def read(plan: OutputPlan, chunks: Iterable[str]) -> Reading:
    """What the parser chain makes of the text, fed in ``chunks``."""
    chain = ParserChain(plan.parsers(0))
    events = []
    for chunk in chunks:
        events += chain.feed(chunk)
    events += chain.flush()
    out = Reading()
    for event in events:
        if isinstance(event, TextDelta):
            out.content += event.text
        elif isinstance(event, ReasoningDelta):
            out.reasoning += event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == len(out.calls), events
            out.calls.append([event.name, event.id, ""])
        elif isinstance(event, ToolCallDelta):
            out.calls[event.index][2] += event.arguments
    return out


_VALIDATORS: dict[tuple[int, str], Any] = {}


def _validator(plan: OutputPlan, name: str) -> Any:
    """A checker for the arguments of ``plan``'s tool ``name`` (made once per plan)."""
    key = (id(plan), name)
    if key not in _VALIDATORS:
        tool = next((t for t in plan.tools if t["function"]["name"] == name), None)
        schema = (tool or {}).get("function", {}).get("parameters") or {"type": "object"}
        _VALIDATORS[key] = jsonschema.validators.validator_for(schema)(schema)
    return _VALIDATORS[key]


def problems(plan: OutputPlan, text: str, reading: Reading, named: str | None) -> list[str]:
    """How ``reading`` fails to be exactly the forced call(s) walked in ``text``."""
    out = []
    if reading.content:
        out.append(f"content {reading.content!r}")
    if not reading.calls:
        return [*out, "no call"]
    tools = {t["function"]["name"]: t["function"].get("parameters") for t in plan.tools}
    calls: list[tuple[str, str, Any]] = []
    for name, call_id, arguments in reading.calls:
        if name not in tools or (named is not None and name != named):
            out.append(f"name {name!r}")
        try:
            args = json.loads(arguments)
        except ValueError:
            out.append(f"arguments of {name!r} are not JSON: {arguments!r}")
            continue
        error = jsonschema.exceptions.best_match(_validator(plan, name).iter_errors(args))
        if error is not None:
            out.append(f"arguments of {name!r} invalid: {error.message}")
        calls.append((name, call_id, args))
    if out:
        return out
    answer = plan.opening + text
    if plan.reasoning_opened and plan.reasoning is not None:
        end = plan.reasoning.end
        lead = plan.reasoning_lead
        if not reading.reasoning.startswith(lead):
            return [f"reasoning {reading.reasoning!r} lost the prompt's {lead!r}"]
        thinking = reading.reasoning[len(lead) :]
        if not text.startswith(thinking + end):
            return [f"reasoning read as {reading.reasoning!r}"]
        answer = text[len(thinking + end) :]
        # the grammar may write up to two line breaks after the reasoning (a section
        # that opens with a line break may take them)
        gap = re.match(r"(\r?\n){0,2}", answer)
        assert gap is not None
        answers = [answer[len(m) :] for m in dict.fromkeys(_prefixes(gap.group()))]
    elif reading.reasoning:
        return [f"reasoning {reading.reasoning!r} where the prompt opened none"]
    else:
        answers = [answer]
    pattern = calls_pattern(plan, calls)
    if not any(pattern.check(a) for a in answers):
        return [f"calls read as {calls!r}, which do not write {answer!r}"]
    return []


def _prefixes(gap: str) -> list[str]:
    """The line breaks of ``gap`` that the reasoning's end may have taken (whole breaks)."""
    out = [""]
    for m in re.finditer(r"\r?\n", gap):
        out.append(gap[: m.end()])
    return out
