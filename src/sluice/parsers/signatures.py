"""Tools written as compact signatures, for models whose template cannot show tools.

A JSON Schema spends most of its tokens on syntax (``{"type": "object",
"properties": {...`` for every parameter). A signature says the same in a
fraction: ``read(path: string, offset?: integer, limit?: integer)``, then one
line per described parameter. Descriptions keep what the model needs to choose
(their first sentences, whitespace folded); the pages of usage notes and
examples agents attach are left out. Enums, arrays, nested objects, unions,
defaults and bounds are written inline the way gpt-oss's own template writes
its tools.

Example::

    signature({"name": "read", "description": "Read a file.", "parameters": {...}})
    # 'read(path: string, limit?: integer) - Read a file.\\n  path: absolute path'
"""

from __future__ import annotations

import json
import re
from typing import Any

_SPACE = re.compile(r"\s+")
_MAX_DEPTH = 6
# A tool's description past this many characters is cut at a sentence (agents' tools
# carry pages of usage notes: opencode's bash alone is 1,100 tokens).
DESCRIPTION_CHARS = 600
PARAMETER_CHARS = 200


def _text(value: Any) -> str:
    return _SPACE.sub(" ", str(value)).strip()


_BLOCKS = re.compile(r"```.*?```|<example>.*?</example>|<(\w+)>.*?</\1>", re.DOTALL)
_SENTENCE_END = re.compile(r"[.!?:](?=\s|$)")


def brief(description: str, limit: int = DESCRIPTION_CHARS) -> str:
    """A description folded to one line: code blocks and tagged sections (examples,
    usage notes) left out, and past ``limit`` characters cut at a sentence's end."""
    text = _text(_BLOCKS.sub(" ", description))
    if len(text) <= limit:
        return text
    ends = [m.end() for m in _SENTENCE_END.finditer(text, 0, limit)]
    cut = ends[-1] if ends and ends[-1] > limit // 3 else text.rfind(" ", 0, limit)
    return text[: cut if cut > 0 else limit].rstrip() + " ..."


def signature(fn: dict[str, Any]) -> str:
    """One function: its call shape and description, then its parameters' descriptions."""
    found = fn.get("parameters")
    params: dict[str, Any] = found if isinstance(found, dict) else {}
    defs = {**(params.get("$defs") or {}), **(params.get("definitions") or {})}
    given = params.get("properties")
    props: dict[str, Any] = given if isinstance(given, dict) else {}
    required = set(params.get("required") or [])
    args = ", ".join(
        f"{name}{'' if name in required else '?'}: {type_of(schema, defs)}"
        for name, schema in props.items()
    )
    head = f"{fn.get('name', '')}({args})"
    description = brief(fn.get("description") or "")
    lines = [f"{head} - {description}" if description else head]
    for name, schema in props.items():
        said = (
            brief(schema.get("description") or "", PARAMETER_CHARS)
            if isinstance(schema, dict)
            else ""
        )
        if said:
            lines.append(f"  {name}: {said}")
    return "\n".join(lines)


def type_of(schema: Any, defs: dict[str, Any], depth: int = 0) -> str:
    """A schema as a short type: ``string``, ``"a"|"b"``, ``integer 1..3``, ``string[]``,
    ``{path: string, line?: integer}``, ``string|null``, ``= default``."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return "any"
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = defs.get(ref.rsplit("/", 1)[-1])
        return type_of(target, defs, depth + 1) if target is not None else "any"
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    if isinstance(schema.get("enum"), list):
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return "|".join(dict.fromkeys(type_of(s, defs, depth + 1) for s in schema[key]))
    kind = schema.get("type")
    if isinstance(kind, list):
        out = "|".join(type_of({**schema, "type": k}, defs, depth + 1) for k in kind)
    elif kind == "array":
        item = type_of(schema.get("items"), defs, depth + 1)
        out = f"({item})[]" if "|" in item else f"{item}[]"
    elif kind == "object" or isinstance(schema.get("properties"), dict):
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            out = "object"
        else:
            required = set(schema.get("required") or [])
            inner = ", ".join(
                f"{k}{'' if k in required else '?'}: {type_of(v, defs, depth + 1)}"
                for k, v in props.items()
            )
            out = f"{{{inner}}}"
    elif isinstance(kind, str):
        out = kind + _bounds(schema)
    else:
        out = "any"
    if "default" in schema:
        out += f" = {json.dumps(schema['default'], ensure_ascii=False)}"
    return out


def _bounds(schema: dict[str, Any]) -> str:
    low = schema.get("minimum", schema.get("minLength"))
    high = schema.get("maximum", schema.get("maxLength"))
    if low is None and high is None:
        return ""
    return f" {'' if low is None else low}..{'' if high is None else high}"
