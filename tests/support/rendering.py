"""Parsed tool calls written back in a family's syntax, as a pattern the walked text must match.

The pattern is exact where the grammar writes one text (markup, names, JSON's
separators, a string value written as text) and open where the grammar lets the
writer choose a spelling that reads back the same (a JSON number's or string's
spelling, a call id, Kimi K3's call index): every such choice is a named group,
checked against the value the parser read (:meth:`Pattern.check`). A text matches
only if the parser read back exactly the calls that were written, in order.

Example::

    pattern = calls_pattern(plan, calls)      # calls: [(name, id, arguments JSON text)]
    assert pattern.check(walked_text), pattern.regex
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.core.syntax import (
    GEMMA_QUOTE,
    KEY_NAME,
    STRING_FLAG,
    TYPE_NAME,
    CallId,
    CallObject,
    GemmaArgs,
    IdName,
    Index,
    JsonArgs,
    Lit,
    Name,
    PythonArgs,
    Recipient,
    TaggedArgs,
    ToolSyntax,
    first_chunk,
)
from sluice.local.plan import FRAMINGS, OutputPlan

_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_JSON_STRING = r'"(?:[^"\\]|\\.)*"'
_MADE_UP = re.compile(r"call_[0-9a-f]{24}")  # an id the parser made up


@dataclass
class Pattern:
    """A regex with checks on its named groups (each: the group's text -> ok)."""

    parts: list[str] = field(default_factory=list)
    checks: dict[str, Callable[[str], bool]] = field(default_factory=dict)

    def lit(self, text: str) -> None:
        self.parts.append(re.escape(text))

    def raw(self, regex: str) -> None:
        self.parts.append(regex)

    def group(self, regex: str, check: Callable[[str], bool] | None = None) -> None:
        name = f"g{len(self.checks)}"
        self.parts.append(f"(?P<{name}>{regex})")
        self.checks[name] = check or (lambda _: True)

    @property
    def regex(self) -> str:
        return "".join(self.parts)

    def check(self, text: str) -> bool:
        found = re.fullmatch(self.regex, text, flags=re.DOTALL)
        if found is None:
            return False
        return all(
            found.group(name) is None or ok(found.group(name)) for name, ok in self.checks.items()
        )


def same(value: Any, other: Any) -> bool:
    """Equal JSON values, types included (True is not 1, 1 is 1.0)."""
    if isinstance(value, bool) or isinstance(other, bool):
        return type(value) is type(other) and value == other
    if isinstance(value, dict):
        return (
            isinstance(other, dict)
            and list(value) == list(other)
            and all(same(v, other[k]) for k, v in value.items())
        )
    if isinstance(value, list):
        return (
            isinstance(other, list)
            and len(value) == len(other)
            and all(same(a, b) for a, b in zip(value, other, strict=True))
        )
    return bool(value == other)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _Invalid()


class _Invalid:
    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


def json_value(p: Pattern, value: Any) -> None:
    """``value`` as JSON the grammar writes it: ", " and ": " between, any spelling of a
    scalar that reads back as that scalar."""
    if isinstance(value, dict):
        p.lit("{")
        for k, (key, item) in enumerate(value.items()):
            if k:
                p.lit(", ")
            p.group(_JSON_STRING, lambda s, key=key: same(_loads(s), key))
            p.lit(": ")
            json_value(p, item)
        p.lit("}")
    elif isinstance(value, list):
        p.lit("[")
        for k, item in enumerate(value):
            if k:
                p.lit(", ")
            json_value(p, item)
        p.lit("]")
    elif isinstance(value, str):
        p.group(_JSON_STRING, lambda s, v=value: same(_loads(s), v))
    elif isinstance(value, bool) or value is None:
        p.lit(json.dumps(value))
    else:
        p.group(_NUMBER, lambda s, v=value: same(_loads(s), v))


def calls_pattern(plan: OutputPlan, calls: list[tuple[str, str, Any]]) -> Pattern:
    """The output a forced call's grammar writes for ``calls`` (name, id, arguments),
    from the first call on (what the prompt wrote of it, ``plan.opening``, included)."""
    p = Pattern()
    tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in plan.tools}
    if plan.syntax is None:
        framing = FRAMINGS[plan.fmt]
        p.lit(framing.prefix)
        for k, (name, _, args) in enumerate(calls):
            if k:
                p.lit(framing.sep)
            p.lit(framing.call_open)
            p.lit(f'{{"{framing.name_key}": {json.dumps(name)}, "{framing.args_key}": ')
            json_value(p, args)
            p.lit("}")
            p.lit(framing.call_close)
        p.lit(framing.suffix)
        return p
    syntax = plan.syntax
    p.lit(syntax.section_start)
    for k, call in enumerate(calls):
        if k:
            p.lit(syntax.separator)
        _call(p, syntax, call, tools.get(call[0], {}))
    p.lit(syntax.section_end)
    return p


def _call(p: Pattern, syntax: ToolSyntax, call: tuple[str, str, Any], schema: Any) -> None:
    name, call_id, args = call
    for element in syntax.call:
        if isinstance(element, Lit):
            p.lit(element.text)
        elif isinstance(element, (Name, Recipient)):
            p.lit(name)
        elif isinstance(element, CallId):
            p.group("[A-Za-z0-9]{9}")
        elif isinstance(element, IdName):
            p.lit(element.prefix + name + element.sep)
            # the model's id, or one the parser made up for an id written twice
            p.group(
                "[0-9]{1,3}",
                lambda s, i=call_id, e=element: (
                    i == e.prefix + name + e.sep + s or _MADE_UP.fullmatch(i) is not None
                ),
            )
        elif isinstance(element, Index):
            p.group("[1-9][0-9]{0,2}")
        elif isinstance(element, JsonArgs):
            json_value(p, args)
        elif isinstance(element, CallObject):
            if element.name_is_key:
                p.lit("{" + json.dumps(name) + ": ")
                json_value(p, args)
                p.lit("}")
                continue
            p.lit(f'{{"{element.name_key}": {json.dumps(name)}, "{element.args_keys[0]}": ')
            json_value(p, args)
            if element.id_key:
                p.lit(f', "{element.id_key}": "')
                p.group("[A-Za-z0-9]{9}")
                p.lit('"')
            p.lit("}")
        elif isinstance(element, TaggedArgs):
            _members(p, element, args, schema)
        elif isinstance(element, PythonArgs):
            p.lit("(")
            for k, (key, value) in enumerate(args.items()):
                p.lit(f"{', ' if k else ''}{key}=")
                _python(p, value)
            p.lit(")")
        elif isinstance(element, GemmaArgs):
            _gemma(p, args)
        else:
            raise TypeError(element)


def _props(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _may_be_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    alternatives = schema.get("anyOf") or schema.get("oneOf") or []
    return (
        kind == "string"
        or (isinstance(kind, list) and "string" in kind)
        or any(_may_be_string(a) for a in alternatives)
    )


def _json_type(schema: Any) -> str:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "integer":
        return "number"
    return kind if isinstance(kind, str) else "string"


def _members(p: Pattern, spec: TaggedArgs, args: Any, schema: Any) -> None:
    if not isinstance(args, dict):
        p.raw("(?!)")  # markup arguments are an object
        return
    props = _props(schema)
    for key, value in args.items():
        sub = props.get(key, {})
        flag = "true" if _is_string(sub) else "false"
        suffix = spec.key_suffix.replace(STRING_FLAG, flag).replace(TYPE_NAME, _json_type(sub))
        p.lit(spec.key_prefix + key + suffix + spec.value_prefix)
        closing = spec.value_suffix.replace(KEY_NAME, key)
        if _is_string(sub) or (spec.nested and _may_be_string(sub)):
            # the reader ends a string at the closing's tag, and takes the whitespace the
            # closing opens with off the value: the writer may leave it out
            tag = closing if KEY_NAME in spec.value_suffix else first_chunk(closing)
            lead, _, rest = closing.partition(tag)
            _tagged_value(p, spec, value, sub, "")
            p.raw(f"(?:{re.escape(lead)})?" if lead else "")
            p.lit(tag + rest)
            continue
        _tagged_value(p, spec, value, sub, closing)


def _tagged_value(p: Pattern, spec: TaggedArgs, value: Any, schema: Any, closing: str) -> None:
    stringy = _is_string(schema) or (spec.nested and _may_be_string(schema))
    alternatives = schema.get("anyOf") or schema.get("oneOf") if isinstance(schema, dict) else None
    if stringy:
        if not isinstance(value, str):
            p.raw("(?!)")
        elif spec.cdata:  # a value may be written in CDATA
            p.raw(f"(?:{re.escape(value)}|{re.escape('<![CDATA[' + value + ']]>')})")
        else:
            p.lit(value)
    elif spec.nested and isinstance(alternatives, list) and alternatives:
        options = []
        for alternative in alternatives:
            sub = Pattern(checks=p.checks)
            _tagged_value(
                sub, spec, value, alternative if isinstance(alternative, dict) else {}, ""
            )
            options.append(sub.regex)
        p.raw("(?:" + "|".join(options) + ")")
    elif spec.nested and _props(schema) and isinstance(value, dict):
        _members(p, spec, value, schema)
    elif spec.nested and isinstance(schema, dict) and schema.get("type") == "array":
        items = schema.get("items")
        for item in value if isinstance(value, list) else []:
            p.lit(spec.key_prefix + "item" + spec.key_suffix + spec.value_prefix)
            _tagged_value(p, spec, item, items if isinstance(items, dict) else {}, "")
            p.lit(spec.value_suffix.replace(KEY_NAME, "item"))
    else:
        json_value(p, value)
    p.lit(closing)


def _python(p: Pattern, value: Any) -> None:
    """A Python literal as LFM2's grammar writes it (JSON's strings, either spelling of
    true, false and null)."""
    if isinstance(value, bool):
        p.group("True|False|true|false", lambda s, v=value: s.lower() == str(v).lower())
    elif value is None:
        p.raw("(?:None|null)")
    elif isinstance(value, str):
        p.group(_JSON_STRING, lambda s, v=value: same(_loads(s), v))
    elif isinstance(value, list):
        p.lit("[")
        for k, item in enumerate(value):
            if k:
                p.lit(", ")
            _python(p, item)
        p.lit("]")
    elif isinstance(value, dict):
        p.lit("{")
        for k, (key, item) in enumerate(value.items()):
            if k:
                p.lit(", ")
            p.group(_JSON_STRING, lambda s, v=key: same(_loads(s), v))
            p.lit(": ")
            _python(p, item)
        p.lit("}")
    else:
        p.group(_NUMBER, lambda s, v=value: same(_loads(s), v))


def _gemma(p: Pattern, value: Any) -> None:
    """A value in Gemma 4's notation: bare keys, strings between its quote marks."""
    if isinstance(value, dict):
        p.lit("{")
        for k, (key, item) in enumerate(value.items()):
            p.lit(f"{',' if k else ''}{key}:")
            _gemma(p, item)
        p.lit("}")
    elif isinstance(value, list):
        p.lit("[")
        for k, item in enumerate(value):
            if k:
                p.lit(",")
            _gemma(p, item)
        p.lit("]")
    elif isinstance(value, str):
        p.lit(GEMMA_QUOTE + value + GEMMA_QUOTE)
    elif isinstance(value, bool) or value is None:
        p.lit(json.dumps(value))
    else:
        p.group(_NUMBER, lambda s, v=value: same(_loads(s), v))
