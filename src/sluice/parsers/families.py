"""Which output format a model's chat template teaches, and the few written by hand.

:func:`format_for` decides, in order: an override (``--tool-format``, a config
entry's ``tool_format``), a hand-written family whose template the probes
cannot read (matched by markers only that family's template has), the
template's analysis (:mod:`sluice.parsers.analysis`), then the older
detection for Llama 3's bare JSON calls, and for a template that knows no
tools, the generic format (tools described in a system block, calls in
Hermes markup).

Example::

    fmt = format_for(source, render)              # OutputFormat(name="auto", tools=..., ...)
    fmt = format_for(source, render, "hermes")    # the override
"""

from __future__ import annotations

from dataclasses import replace

from sluice.core.syntax import (
    KEY_NAME,
    TYPE_NAME,
    GemmaArgs,
    IdName,
    Index,
    JsonArgs,
    Lit,
    Name,
    OutputFormat,
    PythonArgs,
    ReasoningSyntax,
    Recipient,
    TaggedArgs,
    ToolSyntax,
)
from sluice.parsers.analysis import Render, analyze

# Formats with a hand-written parser of their own (sluice.parsers.registry).
LEGACY = ("hermes", "llama3", "mistral", "generic")
PYTHON_TAG = "<|python_tag|>"


def _legacy(source: str) -> str:
    if PYTHON_TAG in source or "ipython" in source:
        return "llama3"
    return "generic"


HARMONY = OutputFormat(
    name="harmony",
    # gpt-oss: messages on channels (sluice.parsers.harmony reads reasoning, answer and
    # calls together); the call syntax is for the grammar of required and named calls.
    tools=ToolSyntax(
        call=(
            Lit("<|channel|>commentary to=functions."),
            Name(),
            Lit(" <|constrain|>json<|message|>"),
            JsonArgs(),
        )
    ),
    reasoning=ReasoningSyntax("<|channel|>analysis<|message|>", "<|end|>"),
)

KIMI_K2 = OutputFormat(
    name="auto",
    # Kimi K2: the call's id is functions.NAME:INDEX, the name inside it.
    tools=ToolSyntax(
        call=(
            Lit("<|tool_call_begin|>"),
            IdName(),
            Lit("<|tool_call_argument_begin|>"),
            JsonArgs(),
            Lit("<|tool_call_end|>"),
        ),
        section_start="<|tool_calls_section_begin|>",
        section_end="<|tool_calls_section_end|>",
    ),
)
GEMMA_4 = OutputFormat(
    name="auto",
    # Gemma 4: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>; thoughts in a
    # channel, which may open (empty) again later in the answer.
    tools=ToolSyntax(call=(Lit("<|tool_call>call:"), Name(), GemmaArgs(), Lit("<tool_call|>"))),
    reasoning=ReasoningSyntax("<|channel>thought", "<channel|>"),
    strip=("<|channel>thought", "<|channel>", "<channel|>"),
)

_MM = "]<]minimax[>["  # MiniMax-M3's namespace token, before each piece of its markup
MINIMAX_M3 = OutputFormat(
    name="auto",
    # MiniMax-M3: each argument's closing tag is named by the argument.
    tools=ToolSyntax(
        call=(
            Lit(_MM + '<invoke name="'),
            Name(),
            Lit('">'),
            TaggedArgs(_MM + "<", ">", "", _MM + "</" + KEY_NAME + ">", nested=True),
            Lit(_MM + "</invoke>\n"),
        ),
        section_start=_MM + "<tool_call>\n",
        section_end=_MM + "</tool_call>",
    ),
    reasoning=ReasoningSyntax("<mm:think>", "</mm:think>"),
    strip=("</mm:think>",),
)

FUNCTIONARY_V3_2 = OutputFormat(
    name="auto",
    # Functionary v3.2: ">>>RECIPIENT\n" before each message; the recipient "all" is the
    # user (the answer), any other a function (its JSON arguments follow). The
    # generation prompt writes the first ">>>".
    tools=ToolSyntax(call=(Lit(">>>"), Name(), Lit("\n"), JsonArgs()), arguments_text=True),
    content_start=">>>all\n",
    opening=">>>",
)

_MUSE = "<|start|>assistant"
MUSE_GLIMMER = OutputFormat(
    name="auto",
    # Muse Glimmer: the turn is messages "<|start|>assistant to=RECIPIENT<|message|>...",
    # each ended by <|eom|> (another follows) or <|eot|>: reasoning to "self", the
    # answer to "user", a call to the function, in ATEM markup. The generation
    # prompt writes the first "<|start|>assistant".
    tools=ToolSyntax(
        call=(
            Lit(_MUSE + " to="),
            Recipient(),
            Lit('<|message|><atem:function_calls>\n<atem:invoke name="'),
            Name(),
            Lit('">\n'),
            TaggedArgs('<atem:parameter name="', '">', "", "</atem:parameter>\n"),
            Lit("</atem:invoke>\n</atem:function_calls>"),
        ),
        separator="<|eom|>",
    ),
    reasoning=ReasoningSyntax(_MUSE + " to=self<|message|>", "<|eom|>"),
    content_start=_MUSE + " to=user<|message|>",
    strip=(_MUSE + "<|message|>", "<|eom|>"),
    opening=_MUSE,
)

KIMI_K3 = OutputFormat(
    name="auto",
    # Kimi K3: sections in <|open|>TAG ATTRS<|sep|> ... <|close|>TAG<|sep|> markup:
    # think, response, then tools with one call each, an argument per key with its type.
    tools=ToolSyntax(
        call=(
            Lit('<|open|>call tool="'),
            Name(),
            Lit('" index="'),
            Index(),
            Lit('"<|sep|>'),
            TaggedArgs(
                '<|open|>argument key="',
                '" type="' + TYPE_NAME + '"<|sep|>',
                "",
                "<|close|>argument<|sep|>",
            ),
            Lit("<|close|>call<|sep|>"),
        ),
        section_start="<|open|>tools<|sep|>",
        section_end="<|close|>tools<|sep|>",
    ),
    reasoning=ReasoningSyntax("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    content_start="<|open|>response<|sep|>",
    content_end="<|close|>response<|sep|>",
    strip=("<|close|>message<|sep|>",),
    end_of_turn="<|end_of_msg|>",
)

# Hand-written families: (alternatives of markers only that family's template has, its
# format); as llama.cpp recognises them (common/chat.cpp, specialized templates).
FAMILIES: tuple[tuple[tuple[tuple[str, ...], ...], OutputFormat], ...] = (
    ((("<|channel|>", "<|message|>"),), HARMONY),
    ((("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),), KIMI_K2),
    ((("<|tool_call>call:",),), GEMMA_4),
    (((_MM, "<invoke name="),), MINIMAX_M3),
    ((("'>>>all", "recipient"),), FUNCTIONARY_V3_2),
    ((("<|open|>", "<|close|>", "open_tag('call'"),), KIMI_K3),
    ((("<atem:function_calls>", "to=self"),), MUSE_GLIMMER),
    (
        (("<|tool_list_start|>", "<|tool_list_end|>"), ("List of tools: [",)),
        OutputFormat(
            name="auto",
            # LFM2: Python calls in a list, <|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>
            tools=ToolSyntax(
                call=(Name(), PythonArgs()),
                section_start="<|tool_call_start|>[",
                section_end="]<|tool_call_end|>",
                separator=", ",
            ),
        ),
    ),
)


def format_for(
    source: str | None, render: Render | None, override: str | None = None
) -> OutputFormat:
    """The output format for a template (``source``, rendered by ``render``)."""
    text = source or ""
    if override and override != "auto":
        reasoning = analyze(render, text).reasoning if render is not None and text else None
        return OutputFormat(name=override, reasoning=reasoning)
    if not text or render is None:
        return OutputFormat(name="generic")
    found = analyze(render, text)
    for alternatives, family in FAMILIES:
        if any(all(m in text for m in markers) for markers in alternatives):
            return replace(
                family,
                reasoning=family.reasoning or found.reasoning,
                end_of_turn=family.end_of_turn or found.end_of_turn,
            )
    if found.tools is None:
        return replace(found, name=_legacy(text))
    return found


__all__ = ["LEGACY", "OutputFormat", "ReasoningSyntax", "format_for"]
