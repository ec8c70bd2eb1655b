"""A model family's output format as data: how it writes reasoning, content and tool calls.

One :class:`OutputFormat` describes a family. Template analysis
(:mod:`sluice.parsers.analysis`) learns it from the chat template; the few
families whose shape analysis cannot see are written out in
:mod:`sluice.parsers.families`. One streaming parser
(:class:`sluice.parsers.formatted.FormatParser`) and one grammar builder read it.

A tool call is a sequence of elements, matched in order::

    # Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>
    ToolSyntax(call=(Lit("<tool_call>\\n<function="), Name(), Lit(">\\n"),
                     TaggedArgs("<parameter=", ">\\n", "", "\\n</parameter>\\n"),
                     Lit("</function>\\n</tool_call>")), separator="\\n")

A literal matches its text with any whitespace (or none) where the text has
whitespace and before it: models do not always space their markup the way
their template does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Lit:
    """Markup written as it is."""

    text: str


@dataclass(frozen=True, slots=True)
class Name:
    """The function's name: letters, digits, ``_ - .``."""


@dataclass(frozen=True, slots=True)
class CallId:
    """The model's id for the call, up to the next markup (kept as the call's id)."""


@dataclass(frozen=True, slots=True)
class IdName:
    """An id that holds the name (Kimi's ``functions.NAME:0``): kept whole as the
    call's id; the name is what comes between ``prefix`` and ``sep``."""

    prefix: str = "functions."
    sep: str = ":"


@dataclass(frozen=True, slots=True)
class Recipient:
    """Where the message goes, written before the call that names the function (Muse
    Glimmer's ``to=NAME``): read and not kept; constrained calls write the name."""


@dataclass(frozen=True, slots=True)
class Index:
    """The call's number in its turn (Kimi K3's ``index="1"``): read and not kept."""


@dataclass(frozen=True, slots=True)
class JsonArgs:
    """The arguments as one JSON object, passed on as written."""


# In TaggedArgs.key_suffix: where the markup says true or false for "the value is a
# string" (DeepSeek's DSML: <｜DSML｜parameter name="x" string="false">42</...>).
STRING_FLAG = "{string}"
# In TaggedArgs.key_suffix: where the markup names the value's JSON type (Kimi K3:
# <|open|>argument key="x" type="number"<|sep|>); the tool's schema decides, as in llama.cpp.
TYPE_NAME = "{type}"
# In TaggedArgs.value_suffix: the argument's name, where the closing markup repeats it
# (MiniMax-M3: <city>Paris</city>).
KEY_NAME = "{key}"
CDATA_OPEN, CDATA_CLOSE = "<![CDATA[", "]]>"  # an XML value taken literally
GEMMA_QUOTE = '<|"|>'  # Gemma 4's string quote (GemmaArgs)


@dataclass(frozen=True, slots=True)
class TaggedArgs:
    """Arguments one by one in markup: ``key_prefix K key_suffix value_prefix V
    value_suffix``, repeated. A value is JSON when it parses as JSON and its
    parameter is not a string; else a string."""

    key_prefix: str
    key_suffix: str
    value_prefix: str
    value_suffix: str
    cdata: bool = False  # a value may come as <![CDATA[...]]> (its inside is the value)
    # Objects and arrays written as nested markup, per the parameter's schema (MiniMax-M3:
    # <number><real>1.5</real></number>, <tags><item>a</item></tags>).
    nested: bool = False


@dataclass(frozen=True, slots=True)
class CallObject:
    """The whole call as a JSON object: ``{"<name_key>": NAME, "<args_key>": {...}}``
    (the arguments may be a JSON string holding the object), or with
    ``name_is_key`` ``{"NAME": {...}}``."""

    name_key: str = "name"
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    id_key: str | None = None
    name_is_key: bool = False


@dataclass(frozen=True, slots=True)
class GemmaArgs:
    """Gemma 4's arguments: ``{key:value,...}`` with bare keys and strings between
    ``<|"|>`` marks (numbers, booleans, null, lists and objects as in JSON)."""


@dataclass(frozen=True, slots=True)
class PythonArgs:
    """Python keyword arguments in parentheses: ``(a=1, b="x", c=[1, 2])``."""


Element = (
    Lit
    | Name
    | CallId
    | IdName
    | Recipient
    | Index
    | JsonArgs
    | TaggedArgs
    | CallObject
    | PythonArgs
    | GemmaArgs
)


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """How calls are written: ``section_start call (separator call)* section_end``.

    Without a ``section_start`` each call's first literal opens it.
    """

    call: tuple[Element, ...]
    section_start: str = ""
    section_end: str = ""
    separator: str = ""
    # The template renders past calls' arguments as given: they must be JSON text.
    arguments_text: bool = False

    @property
    def opener(self) -> str:
        """The markup that starts the tool calls in the output."""
        if self.section_start:
            return self.section_start
        first = self.call[0] if self.call else None
        return first.text if isinstance(first, Lit) else ""


@dataclass(frozen=True, slots=True)
class ReasoningSyntax:
    """Reasoning between ``start`` and ``end``; an empty ``start`` means the output
    begins with reasoning whenever the generation prompt asks for it. ``lead``: what
    the generation prompt writes of that reasoning itself (Apriel's "Here are my
    reasoning steps:"), read as its beginning, as llama.cpp reads it."""

    start: str
    end: str
    lead: str = ""


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """A family's output format (see the module's doc)."""

    name: str
    tools: ToolSyntax | None = None
    reasoning: ReasoningSyntax | None = None
    content_start: str = ""  # markup around the answer (Command R's <|START_RESPONSE|>)
    content_end: str = ""
    end_of_turn: str = ""  # markup that ends the turn (never content)
    strip: tuple[str, ...] = ()  # other markup that is never content
    # Markup the generation prompt ends with and the output goes on from (functionary's
    # ">>>" before the recipient): read as the output's beginning where the prompt has it.
    opening: str = ""
    # Markup the model writes as special tokens, to keep in the text it returns.
    special: tuple[str, ...] = field(default=())


# Markup's pieces: a tag (or its opening part), a bracketed word, a closing ] or >, or a
# run of other text; whitespace may come between any two (models space markup freely).
_PIECE = re.compile(r"<[^<>\s]*>?|\[[^\[\]\s]*\]?|[\]>]|[^<\[\]>\s]+")


def chunks(text: str) -> list[str]:
    """``text``'s pieces of markup, whitespace dropped."""
    return _PIECE.findall(text)


def first_chunk(text: str) -> str:
    """The first piece of markup in ``text`` ("" for whitespace only)."""
    found = _PIECE.search(text)
    return found.group() if found else ""


def regex_text(text: str) -> str:
    """``text`` as a regex (in a grammar's ``/.../``) that matches it alone."""
    return "".join(c if c.isalnum() and c.isascii() else f"\\x{{{ord(c):x}}}" for c in text)
