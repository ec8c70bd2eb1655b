"""A family's output format, learned by rendering its chat template.

The template is rendered with probe conversations (an answer, an answer with
reasoning, one tool call, two tool calls) whose names and values are unique
strings; where those strings land in the renderings says how the model writes
them: the reasoning markers, and the tool calls' markup around the function
name, the arguments (one JSON object, or one marked-up key and value each) and
between calls. This is llama.cpp's approach (``common/chat-diff-analyzer.cpp``),
written anew. Families whose shape the probes cannot show are described in
:mod:`sluice.parsers.families`, which is consulted first.

Example::

    fmt = analyze(render)   # render(messages, add_generation_prompt, extra) -> str
    fmt.tools.call          # (Lit('<tool_call>\\n<function='), Name(), Lit('>\\n'), ...)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sluice.core.syntax import (
    CDATA_OPEN,
    STRING_FLAG,
    CallId,
    CallObject,
    Element,
    JsonArgs,
    Lit,
    Name,
    OutputFormat,
    ReasoningSyntax,
    TaggedArgs,
    ToolSyntax,
    first_chunk,
)

Render = Callable[[list[dict[str, Any]], bool, dict[str, Any]], str]
"""``render(messages, add_generation_prompt, extra_variables) -> prompt``; raises on a
template error."""

FUN_1 = "FFF_FIRST_FUN_F"
FUN_2 = "SSS_SECOND_FUN_S"
ARG_1 = "AA_ARG_FST_AA"
ARG_2 = "BB_ARG_SND_BB"
VAL_1 = "XXXX_VAL"
VAL_2 = "YYYY_VAL"
VAL_3 = "ZZZZ_VAL"
ID_1 = "call00001"
ID_2 = "call00002"
USER = "U_USER_MSG Hello END_U"
ANSWER = "A_ASST_MSG I can help END_A"
ANSWER_2 = "B_ASST_MSG Something else END_B"
THOUGHT = "REASON_PART I am thinking END_R"
_MARKER_OPENERS = "<[{"

_PARAMS = {
    "type": "object",
    "properties": {ARG_1: {"type": "string"}, ARG_2: {"type": "string"}},
    "required": [ARG_1],
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": "d", "parameters": _PARAMS}}
    for n in (FUN_1, FUN_2)
]


def _call(name: str, call_id: str, args: dict[str, str], as_text: bool) -> dict[str, Any]:
    arguments: Any = json.dumps(args) if as_text else args
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _user() -> dict[str, Any]:
    return {"role": "user", "content": USER}


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common_suffix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


def _from_marker(text: str) -> str:
    """The longest tail of ``text`` that starts where markup starts (a ``<``, ``[`` or
    ``{``); ``text`` if there is none."""
    for i, c in enumerate(text):
        if c in _MARKER_OPENERS:
            return text[i:]
    return text


def _to_marker_end(text: str) -> str:
    """The longest head of ``text`` that ends where markup ends (``>``, ``]`` or ``}``,
    and any whitespace after it)."""
    for i in range(len(text) - 1, -1, -1):
        if text[i] in ">]}":
            end = i + 1
            while end < len(text) and text[end] in " \t\r\n":
                end += 1
            return text[:end]
    return ""


class _Probe:
    def __init__(self, render: Render, source: str = "") -> None:
        self.render = render
        self.source = source

    def __call__(
        self, messages: list[dict[str, Any]], gen: bool = False, **extra: Any
    ) -> str | None:
        try:
            return self.render(messages, gen, extra)
        except Exception:  # noqa: BLE001 - a probe the template refuses tells us nothing
            return None


def analyze_reasoning(probe: _Probe) -> ReasoningSyntax | None:
    """The reasoning markers, from an answer rendered with and without its reasoning."""
    plain = probe([_user(), {"role": "assistant", "content": ANSWER}])
    thought = probe(
        [_user(), {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}]
    )
    if plain and thought and THOUGHT in thought:
        at = thought.index(THOUGHT)
        head = _marker_start(thought, common_prefix(plain, thought))
        start = thought[head:at].strip()
        answer_at = thought.find(ANSWER, at)
        if answer_at != -1:
            end = thought[at + len(THOUGHT) : answer_at].strip()
            # What also comes before the plain answer is the answer's markup, not the end's.
            before_answer = plain[head : plain.find(ANSWER)].strip() if ANSWER in plain else ""
            if before_answer and end.endswith(before_answer) and end != before_answer:
                end = end[: len(end) - len(before_answer)].strip()
            if not start:
                start = _opening_of(end, thought[:at])
            if _is_markup(end) and (not start or _is_markup(start)):
                return ReasoningSyntax(start, end, "" if start else _lead(probe, plain))
    # A block the generation prompt opens (and a template that never shows reasoning).
    gen = probe([_user()], True)
    if gen:
        tail = gen.rstrip()
        for start, end in _KNOWN_BLOCKS:
            if tail.endswith(start):
                return ReasoningSyntax(start, end)
    # A template that only names its markers (in instructions, or in code the probes
    # do not reach, as DeepSeek-R1's distills cut past reasoning from history). Naming
    # ``<think>`` alone is enough: sluice has always read it wherever a template says it.
    for start, end in _KNOWN_BLOCKS:
        if start in probe.source and (end in probe.source or start == "<think>"):
            return ReasoningSyntax(start, end)
    return None


def _lead(probe: _Probe, plain: str) -> str:
    """What a generation prompt writes after the assistant's turn opens, beyond what an
    answered turn has there: the start of reasoning the turn opens without markup."""
    gen = probe([_user()], True)
    if not gen or ANSWER not in plain:
        return ""
    head = plain[: plain.index(ANSWER)]
    at = common_prefix(head, gen)
    return gen[at:] if at == len(head) else ""


def _is_markup(text: str) -> bool:
    """Whether ``text`` reads as markup (``<think>``, ``[/THINK]``, ``<|x|>...<|y|>``), not
    as words a template writes around earlier turns' reasoning."""
    return text[:1] in "<[" and text[-1:] in ">]"


def _marker_start(text: str, i: int) -> int:
    """``i`` moved back to the start of the markup it falls inside (``text[i]`` right
    after a ``<`` or ``[`` that no ``>``/``]`` closed yet)."""
    for j in range(i - 1, max(-1, i - 64), -1):
        c = text[j]
        if c in ">]" or c in " \t\r\n":
            return i
        if c in "<[":
            return j
    return i


def _opening_of(end: str, before: str) -> str:
    """The start marker matching ``end`` (``</x>`` -> ``<x>``) if ``before`` ends with it:
    a block the probe's answer opened in markup the plain answer shares."""
    for close, open_ in (("</", "<"), ("[/", "[")):
        if end.startswith(close):
            start = open_ + end[len(close) :]
            if before.rstrip().endswith(start):
                return start
    return ""


# Reasoning blocks a generation prompt may open, by their start marker.
_KNOWN_BLOCKS = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<mm:think>", "</mm:think>"),
    ("<think:opensource>", "</think:opensource>"),
)


def analyze_tools(probe: _Probe) -> ToolSyntax | None:
    """The tool-call syntax, from one and two calls rendered as the last turn."""
    user = _user()
    plain = probe([user, {"role": "assistant", "content": ANSWER}], tools=TOOLS)
    if plain is None:
        return None
    one = two = None
    for as_text in (False, True):
        calls = [_call(FUN_1, ID_1, {ARG_1: VAL_1, ARG_2: VAL_2}, as_text)]
        one = probe([user, {"role": "assistant", "content": "", "tool_calls": calls}], tools=TOOLS)
        if one is not None and FUN_1 in one and (VAL_1 in one):
            calls = [*calls, _call(FUN_2, ID_2, {ARG_1: VAL_3}, as_text)]
            two = probe(
                [user, {"role": "assistant", "content": "", "tool_calls": calls}], tools=TOOLS
            )
            break
        one = None
    if one is None:
        return None
    haystack = _differing(plain, one)
    pair = _differing(plain, two) if two is not None and FUN_2 in two else None
    found = _syntax(haystack, pair)
    if found is not None and as_text:  # it renders arguments only as given, as JSON text
        found = replace(found, arguments_text=True)
    if found is not None and CDATA_OPEN in probe.source:  # MiniCPM5 wraps values in CDATA
        found = replace(
            found,
            call=tuple(
                replace(e, cdata=True) if isinstance(e, TaggedArgs) else e for e in found.call
            ),
        )
    return found


def _differing(plain: str, other: str) -> str:
    """The part of ``other`` that differs from ``plain``, widened to whole markers."""
    head = common_prefix(plain, other)
    head = _marker_start(other, head)
    tail = common_suffix(plain[head:], other[head:])
    end = len(other) - tail
    # A common tail starting inside a marker (``|><|end|>``) belongs with that marker.
    common = other[end:]
    end += len(common) - len(_from_marker(common)) if any(c in common for c in "<[") else 0
    return other[head:end]


def _json_at(text: str, start: int) -> tuple[Any, int] | None:
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


def _find_json(text: str, test: Callable[[Any], bool]) -> tuple[int, int, Any] | None:
    """The first JSON value in ``text`` for which ``test`` holds: (start, end, value)."""
    for i, c in enumerate(text):
        if c in "{[":
            hit = _json_at(text, i)
            if hit is not None and test(hit[0]):
                return i, hit[1], hit[0]
    return None


def _is_args(value: Any) -> bool:
    return isinstance(value, dict) and value.get(ARG_1) == VAL_1


def _object_keys(value: Any) -> CallObject | None:
    """The keys of a call written as one JSON object, if ``value`` is one."""
    if not isinstance(value, dict):
        return None
    name_key = next((k for k, v in value.items() if v == FUN_1), None)
    if name_key is None:
        if _is_args(value.get(FUN_1)):
            return CallObject(name_is_key=True)
        return None
    args_key = next(
        (
            k
            for k, v in value.items()
            if _is_args(v) or (isinstance(v, str) and ARG_1 in v and VAL_1 in v)
        ),
        None,
    )
    if args_key is None:
        return None
    id_key = next((k for k, v in value.items() if v == ID_1), None)
    if id_key is None:  # a template that numbers the calls itself (Command R: "0", "1")
        id_key = next(
            (k for k, v in value.items() if k.lower().endswith("id") and isinstance(v, str)),
            None,
        )
    return CallObject(name_key=name_key, args_keys=(args_key,), id_key=id_key)


def _call_elements(text: str) -> tuple[list[Element], int, int] | None:
    """The elements of the first call in ``text`` and where its variable part starts
    and ends: (elements between the fixed head and tail, start, end)."""
    # The whole call as one JSON object (maybe inside an array)?
    hit = _find_json(text, lambda v: isinstance(v, dict) and _object_keys(v) is not None)
    name_at = text.find(FUN_1)
    if hit is not None and hit[0] < name_at < hit[1]:
        spec = _object_keys(hit[2])
        assert spec is not None
        return [spec], hit[0], hit[1]
    if name_at == -1:
        return None
    name_end = name_at + len(FUN_1)
    # The name in markup, the arguments one JSON object?
    args = _find_json(text[name_end:], _is_args)
    if args is not None:
        a_start, a_end = name_end + args[0], name_end + args[1]
        between = text[name_end:a_start]
        elements: list[Element] = [Name()]
        if ID_1 in between:
            at = between.index(ID_1)
            elements += [Lit(between[:at]), CallId(), Lit(between[at + len(ID_1) :])]
        else:
            elements.append(Lit(between))
        elements.append(JsonArgs())
        return elements, name_at, a_end
    # Each argument in markup.
    k1 = text.find(ARG_1, name_end)
    v1 = text.find(VAL_1, k1)
    k2 = text.find(ARG_2, v1)
    v2 = text.find(VAL_2, k2)
    if min(k1, v1, k2, v2) == -1:
        return None
    to_first = text[name_end:k1]
    between_args = text[v1 + len(VAL_1) : k2]
    key_prefix = _from_marker(to_first[len(to_first) - common_suffix(to_first, between_args) :])
    if not key_prefix.strip():
        return None
    value_suffix = between_args[: len(between_args) - len(key_prefix)]
    key_suffix = text[k1 + len(ARG_1) : v1]
    if '="true"' in key_suffix:  # the markup says whether the value is a string (DSML)
        key_suffix = key_suffix.replace('="true"', f'="{STRING_FLAG}"', 1)
    tagged = TaggedArgs(
        key_prefix=key_prefix,
        key_suffix=key_suffix,
        value_prefix="",
        value_suffix=value_suffix,
    )
    name_suffix = to_first[: len(to_first) - len(key_prefix)]
    end = v2 + len(VAL_2)
    if text.startswith(value_suffix, end):
        end += len(value_suffix)
    elif text.startswith(value_suffix.rstrip(), end):
        end += len(value_suffix.rstrip())
    return [Name(), Lit(name_suffix), tagged], name_at, end


def _syntax(one: str, two: str | None) -> ToolSyntax | None:
    found = _call_elements(one)
    if found is None:
        return None
    middle, start, end = found
    before, after = one[:start], one[end:]
    section_start, call_head, call_tail, separator, section_end = "", before, after, "", ""
    if two is not None:
        split = _split_pair(two, middle)
        if split is not None:
            lead, between, trail = split
            # between = call_tail + separator + call_head; lead = section_start + call_head
            call_head = _from_marker(lead[len(lead) - common_suffix(lead, between) :])
            if ID_1 in lead and ID_2 in between:  # the model's id starts each call
                lead_at, between_at = lead.rindex(ID_1), between.rindex(ID_2)
                same = common_suffix(lead[:lead_at], between[:between_at])
                call_head = _from_marker(lead[lead_at - same :])
            if not lead.endswith(call_head):
                call_head = ""
            section_start = lead[: len(lead) - len(call_head)]
            rest = between[: len(between) - len(call_head)]
            call_tail = _to_marker_end(rest[: common_prefix(rest, trail)])
            separator = rest[len(call_tail) :]
            section_end = trail[len(call_tail) :]
    if not call_head.strip():
        call_head = ""
    if not section_start.strip():
        section_start = ""
    elements: list[Element] = []
    if ID_1 in call_head:  # the model's id before the name
        at = call_head.index(ID_1)
        elements += [Lit(call_head[:at]), CallId()]
        call_head = call_head[at + len(ID_1) :]
    if call_head:
        elements.append(Lit(call_head))
    elements += [e for e in middle if not (isinstance(e, Lit) and not e.text)]
    if call_tail.strip():
        elements.append(Lit(call_tail))
    if not elements or (not isinstance(elements[0], Lit) and not section_start):
        return None  # nothing marks a call: not a format this can read
    return ToolSyntax(
        call=tuple(elements),
        section_start=section_start,
        section_end=section_end if section_end.strip() else "",
        separator=separator,
    )


def _split_pair(two: str, middle: list[Element]) -> tuple[str, str, str] | None:
    """Two calls' rendering cut into (before the first call's variable part, between
    the two, after the second's)."""
    spec = middle[0]
    if isinstance(spec, CallObject):
        key = spec.name_key

        def is_first(v: Any) -> bool:
            if not isinstance(v, dict):
                return False
            return FUN_1 in v if spec.name_is_key else v.get(key) == FUN_1

        first = _find_json(two, is_first)
        if first is None:
            return None
        second = _find_json(
            two[first[1] :], lambda v: isinstance(v, dict) and FUN_2 in json.dumps(v)
        )
        if second is None:
            return None
        s2, e2 = first[1] + second[0], first[1] + second[1]
        return two[: first[0]], two[first[1] : s2], two[e2:]
    n1 = two.find(FUN_1)
    n2 = two.find(FUN_2)
    if n1 == -1 or n2 == -1:
        return None
    if isinstance(middle[-1], JsonArgs):
        a1 = _find_json(two[n1:], _is_args)
        a2 = _find_json(two[n2:], lambda v: isinstance(v, dict) and v.get(ARG_1) == VAL_3)
        if a1 is None or a2 is None:
            return None
        end1, end2 = n1 + a1[1], n2 + a2[1]
    else:
        tagged = middle[-1]
        assert isinstance(tagged, TaggedArgs)
        v2 = two.find(VAL_2, n1)
        v3 = two.find(VAL_3, n2)
        if v2 == -1 or v3 == -1:
            return None
        end1, end2 = v2 + len(VAL_2), v3 + len(VAL_3)
        for suffix in (tagged.value_suffix, tagged.value_suffix.rstrip()):
            if two.startswith(suffix, end1) and two.startswith(suffix, end2):
                end1, end2 = end1 + len(suffix), end2 + len(suffix)
                break
    return two[:n1], two[end1:n2], two[end2:]


def analyze_content(probe: _Probe) -> tuple[str, str, str]:
    """Markup around an answer: (before it, after it, the end of the turn), each only
    where it is markup (``<|START_RESPONSE|>``, ``<|END_RESPONSE|>``, ``<|im_end|>``)."""
    plain = probe([_user(), {"role": "assistant", "content": ANSWER}])
    if plain is None or ANSWER not in plain:
        return "", "", ""
    at = plain.index(ANSWER)
    gen = probe([_user()], True) or ""
    before = plain[_marker_start(plain, common_prefix(gen, plain)) : at].strip()
    after = plain[at + len(ANSWER) :]
    other = probe([_user(), {"role": "assistant", "content": ANSWER_2}])
    # The end of the turn: what follows any answer, up to the next turn's markup.
    if other is not None and ANSWER_2 in other:
        tail = other[other.index(ANSWER_2) + len(ANSWER_2) :]
        after = after[: common_prefix(after, tail)] or after
    pieces = after.strip()
    end_of_turn = first_chunk(pieces) if pieces[:1] in "<[" else ""
    content_end = ""
    call = probe(
        [
            _user(),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call(FUN_1, ID_1, {ARG_1: VAL_1}, False)],
            },
        ],
        tools=TOOLS,
    )
    if call is not None:  # what follows the answer but not a call ends the answer itself
        end_at = len(plain) - common_suffix(plain, call)
        common = plain[end_at:]
        if any(c in common for c in "<["):  # a shared tail starting inside a marker
            end_at = len(plain) - len(_from_marker(common))
        own = plain[at + len(ANSWER) : end_at]
        if own.rfind("<") > own.rfind(">"):  # cut inside a marker: take all of it
            close = plain.find(">", end_at)
            end_at = close + 1 if close != -1 else end_at
            own = plain[at + len(ANSWER) : end_at]
        own = own.strip()
        if own[:1] in "<[":
            content_end = own
            rest = plain[end_at:].strip()
            end_of_turn = first_chunk(rest) if rest[:1] in "<[" else ""
    if not before.startswith(("<", "[")):
        before = ""
    return before, content_end, end_of_turn


def analyze(render: Render, source: str = "") -> OutputFormat:
    """The output format of the template behind ``render`` (``name``: "auto")."""
    probe = _Probe(render, source)
    start, end, end_of_turn = analyze_content(probe)
    reasoning = analyze_reasoning(probe)
    if reasoning is not None and reasoning.end and reasoning.end in start:
        start = start[start.index(reasoning.end) + len(reasoning.end) :].strip()
    if reasoning is not None and reasoning.start and reasoning.start in start:
        start = ""  # an empty reasoning block the template writes before every answer
    tools = analyze_tools(probe)
    if tools is not None and reasoning is not None and reasoning.end in tools.section_start:
        # An empty reasoning block the template writes before calls is not the section's.
        after = tools.section_start.split(reasoning.end, 1)[1]
        tools = replace(tools, section_start=after.lstrip())
    if tools is not None and end_of_turn and end_of_turn in tools.opener:
        end_of_turn = ""  # it also opens calls (GigaChat): not an end
    return OutputFormat(
        name="auto",
        tools=tools,
        reasoning=reasoning,
        content_start=start,
        content_end=end,
        end_of_turn=end_of_turn,
    )
