"""llama.cpp's JSON-schema converter, subclassed: bounded repetitions, safe literals."""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
from typing import Any

from sluice.grammar.integers import _integer_rule
from sluice.grammar.pattern import (
    _atomic,
    _class_char,
    _merge,
    _Pattern,
    gbnf_literal,
)
from sluice.grammar.spec import (
    REPEAT_SETTING,
    _clip,
    _OverBudget,
    _SchemaProblem,
)


def _count(schema: dict[str, Any], key: str) -> int | None:
    """A non-negative integer keyword (``maxLength``...); None when absent."""
    value = schema.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not value.is_integer())
        or value < 0
    ):
        raise _SchemaProblem(f"'{key}' must be a non-negative integer")
    return int(value)


@functools.cache
def _converter_class() -> Any:
    lg: Any = importlib.import_module("llama_cpp.llama_grammar")

    class Converter(lg.SchemaConverter):  # type: ignore[misc]
        """llama.cpp's converter with bounded repetitions, safe literals and integer bounds."""

        def __init__(
            self, max_repeat: int, max_output_chars: int | None, max_alternatives: int | None
        ) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
            self.max_repeat = max_repeat
            self.max_output_chars = max_output_chars
            self.max_alternatives = max_alternatives
            self.paths: dict[str, str] = {}  # rule -> the schema path it was written for
            self.values: set[str] = set()  # rules of schemas: each matches one JSON value
            self.used = 0  # repetition rules written so far
            self._keys: dict[tuple[str, str], str] = {(k, v): k for k, v in self._rules.items()}
            self._next_suffix: dict[str, int] = {}
            self._chains: dict[tuple[str, bool], list[str]] = {}
            self._ref_rules: dict[str, str] = {}

        # -- rules ------------------------------------------------------------------

        def _add_rule(self, name: str, rule: str) -> str:
            # The port's collision scan is quadratic in rules of one name; same result.
            esc = lg.INVALID_RULE_CHARS_RE.sub("-", name)
            key = self._keys.get((esc, rule))
            if key is not None:
                return key
            if esc in self._rules:
                i = self._next_suffix.get(esc, 0)
                while f"{esc}{i}" in self._rules:
                    i += 1
                self._next_suffix[esc] = i + 1
                esc_key = f"{esc}{i}"
            else:
                esc_key = esc
            self._rules[esc_key] = rule
            self._keys[(esc, rule)] = esc_key
            return esc_key

        def _format_literal(self, literal: str) -> str:
            # The port leaves backslashes unescaped: a property name could end the literal.
            return gbnf_literal(literal)

        def _literal_trie(
            self, name: str, entries: list[tuple[str, str]], *, split_start: bool = True
        ) -> str:
            """Alternatives ``text tail`` for each (text, GBNF tail), sharing their prefixes.

            Written one after another, texts with a common start (``"value1"``,
            ``"value2"``...) each hold a parse stack until they differ, and every
            stack costs a pass over the vocabulary per token; as a trie they hold
            one per distinct next character, and characters followed alike share
            a class. Returns the root's alternatives. ``split_start=False`` writes
            the start all texts share into each first branch (``"\"f\"" | "\"g\""``).
            """
            items = sorted(set(entries))
            texts = [text for text, _ in items]
            nodes: list[list[tuple[str, str, int | None]]] = []  # (edge, tail, child node)
            todo: list[tuple[int, int, int]] = []  # (first item, end, depth) per node

            def node(lo: int, hi: int, depth: int) -> int:
                nodes.append([])
                todo.append((lo, hi, depth))
                return len(nodes) - 1

            node(0, len(items), 0)
            done = 0
            while done < len(todo):
                lo, hi, depth = todo[done]
                alts = nodes[done]
                done += 1
                i = lo
                while i < hi and len(texts[i]) == depth:  # texts ending here sort first
                    alts.append(("", items[i][1], None))
                    i += 1
                while i < hi:
                    j = i + 1
                    while j < hi and texts[j][depth] == texts[i][depth]:
                        j += 1
                    if j - i == 1:
                        alts.append((texts[i][depth:], items[i][1], None))
                    else:
                        stop = len(os.path.commonprefix([texts[i], texts[j - 1]]))
                        alts.append((texts[i][depth:stop], "", node(i, j, stop)))
                    i = j
            rules: dict[int, str] = {}

            def body(k: int, prefix: str) -> str:
                lead = gbnf_literal(prefix) if prefix else ""
                alts = [" ".join(filter(None, [lead, t])) or '""' for e, t, _ in nodes[k] if not e]
                # Edges that go on alike (same rest, same subtree: the digits of "1".."99")
                # become one character class: one stack, not one per character.
                heads: dict[tuple[str, str, str], list[int]] = {}
                for edge, tail, child in nodes[k]:
                    if edge:
                        after = (edge[1:], tail, rules[child] if child is not None else "")
                        heads.setdefault(after, []).append(ord(edge[0]))
                for (rest, tail, child_rule), firsts in heads.items():
                    if len(firsts) == 1:
                        head = gbnf_literal(prefix + chr(firsts[0]) + rest)
                    else:
                        spec = "".join(
                            _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                            for lo, hi in _merge([(c, c) for c in firsts])
                        )
                        head = " ".join(
                            filter(None, [lead, f"[{spec}]", gbnf_literal(rest) if rest else ""])
                        )
                    alts.append(" ".join(filter(None, [head, tail, child_rule])))
                return " | ".join(alts)

            start = nodes[0][0] if len(nodes[0]) == 1 else ("", "", None)
            lifted = start[2] if not split_start and not start[1] else None
            for k in range(len(nodes) - 1, 0, -1):  # children first
                if k != lifted:
                    rules[k] = str(self._add_rule(f"{name}-trie", body(k, "")))
                    self.paths.setdefault(rules[k], name)
            return body(lifted, start[0]) if lifted is not None else body(0, "")

        def resolve_refs(self, schema: Any, url: str) -> Any:
            # Every local $ref, at any depth (the port skips what lies beside a $ref,
            # and would fetch remote ones if allowed); ``url`` keeps tools apart.
            def walk(node: Any) -> None:
                if isinstance(node, list):
                    for x in node:
                        walk(x)
                elif isinstance(node, dict):
                    ref = node.get("$ref")
                    if isinstance(ref, str):
                        if not ref.startswith("#"):
                            raise _SchemaProblem("only local $refs ('#/...') are supported")
                        node["$ref"] = f"{url}{ref}"
                        self._refs.setdefault(f"{url}{ref}", _pointer(schema, ref))
                    for value in node.values():
                        walk(value)

            walk(schema)
            return schema

        def _resolve_ref(self, ref: Any) -> str:
            # The port returns a recursive ref's raw last segment as GBNF text.
            key = self._ref_rules.get(ref)
            if key is not None:
                return key
            if not isinstance(ref, str) or ref not in self._refs:
                raise _SchemaProblem(f"unresolved $ref {_clip(repr(ref))}")
            base = ref.split("/")[-1][:40] or "ref"
            base = base + "-" if base in lg.RESERVED_NAMES else base
            key = self._add_rule(base, f"\0{ref}")  # a placeholder until the target is built
            self._ref_rules[ref] = key
            target = self.visit(self._refs[ref], f"{base}-def")
            self._rules[key] = target
            return key

        # -- repetitions --------------------------------------------------------------

        def _repeat(self, item: str, lo: int, hi: int | None, *, sep: str = "", what: str) -> str:
            """``lo`` to ``hi`` (None: any number of) copies of the atom ``item``, ``sep`` between.

            ``item`` must not match the empty string. Copies are chains of shared
            rules (``r-x3 ::= r r-x2``), each new link charged to the budget.
            """
            if hi is not None and self.max_output_chars is not None and hi > self.max_output_chars:
                hi = None  # each copy is at least one character: never reached
            if sep:
                if hi == 0:
                    return ""
                unit = self._unit(f"{sep} {item}")
                first = _atomic(item)
                more = None if hi is None else hi - 1  # copies after the first
                if lo >= 1:
                    return " ".join(filter(None, [first, self._tail(unit, lo - 1, more, what)]))
                rest = self._tail(unit, 0, more, what)
                return f"({first} {rest})?" if rest else f"{first}?"
            return self._tail(self._unit(item), lo, hi, what)

        def _unit(self, text: str) -> str:
            if re.fullmatch(r"[A-Za-z0-9-]{1,32}", text):
                return text
            return str(self._add_rule("rep", text))

        def _tail(self, unit: str, lo: int, hi: int | None, what: str) -> str:
            n_opt = 0 if hi is None else hi - lo
            exact = self._chains.get((unit, False), [])
            opt = self._chains.get((unit, True), [])
            new = max(0, lo - len(exact)) + max(0, n_opt - len(opt))
            if new:
                self.used += new
                if self.used > self.max_repeat:
                    more = f" ({self.used:,} in all)" if self.used != new else ""
                    raise _OverBudget(
                        f"{what} needs {new:,} grammar repetitions{more}; "
                        f"the limit is {self.max_repeat} ({REPEAT_SETTING})"
                    )
            parts = [self._chain(unit, lo, optional=False) if lo else ""]
            if hi is None:
                parts.append(f"{unit}*")
            elif n_opt:
                parts.append(self._chain(unit, n_opt, optional=True))
            return " ".join(p for p in parts if p)

        def _chain(self, unit: str, n: int, *, optional: bool) -> str:
            """The rule for exactly (or at most) ``n`` copies of ``unit``; links shared."""
            links = self._chains.setdefault((unit, optional), [])
            suffix = "o" if optional else "x"
            while len(links) < n:
                body = f"{unit} {links[-1]}" if links else unit
                links.append(
                    self._add_rule(
                        f"{unit}-{suffix}{len(links) + 1}", f'{body} | ""' if optional else body
                    )
                )
            return links[n - 1]

        # -- schemas ------------------------------------------------------------------

        def visit(self, schema: Any, name: str) -> str:
            rule = self._visit_schema(schema, name)
            self.paths.setdefault(rule, name)
            self.values.add(rule)
            return rule

        def _visit_schema(self, schema: Any, name: str) -> str:
            """The port's dispatch, in its order, with its repetitions bounded."""
            if not isinstance(schema, dict):
                raise _SchemaProblem(f"a schema must be an object, not {type(schema).__name__}")
            kind = schema.get("type")
            fmt = schema.get("format")
            rule_name = name + "-" if name in lg.RESERVED_NAMES else name or "root"
            if schema.get("$ref") is not None:
                return str(self._add_rule(rule_name, self._resolve_ref(schema["$ref"])))
            if "oneOf" in schema or "anyOf" in schema:
                alts = schema.get("oneOf") or schema.get("anyOf")
                if not isinstance(alts, list) or not alts:
                    raise _SchemaProblem("'anyOf' and 'oneOf' must be non-empty arrays")
                return str(self._add_rule(rule_name, self._generate_union_rule(name, alts)))
            if isinstance(kind, list):
                if not kind:
                    raise _SchemaProblem("'type' must not be an empty array")
                alts = [{"type": t} for t in kind]
                return str(self._add_rule(rule_name, self._generate_union_rule(name, alts)))
            if "const" in schema:
                return str(self._add_rule(rule_name, self._generate_constant_rule(schema["const"])))
            if "enum" in schema:
                values = schema["enum"]
                if not isinstance(values, list) or not values:
                    raise _SchemaProblem("'enum' must be a non-empty array")
                trie = self._literal_trie(rule_name, [(json.dumps(v), "") for v in values])
                return str(self._add_rule(rule_name, trie))
            if kind is not None and not isinstance(kind, str):
                raise _SchemaProblem("'type' must be a string or an array of strings")
            if kind in (None, "object") and (
                "properties" in schema
                or ("additionalProperties" in schema and schema["additionalProperties"] is not True)
            ):
                props = schema.get("properties", {})
                required = schema.get("required", [])
                if not isinstance(props, dict):
                    raise _SchemaProblem("'properties' must be an object")
                if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                    raise _SchemaProblem("'required' must be an array of strings")
                extra = schema.get("additionalProperties")
                body = self._build_object_rule(list(props.items()), set(required), name, extra)
                return str(self._add_rule(rule_name, body))
            if kind in (None, "object") and "allOf" in schema:
                parts = schema["allOf"]
                if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                    raise _SchemaProblem("'allOf' must be an array of schemas")
                return str(super().visit(schema, name))
            if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
                return self._visit_array(schema, name, rule_name)
            if kind in (None, "string") and "pattern" in schema:
                return str(self._visit_pattern(schema["pattern"], rule_name))
            if (
                kind in (None, "string")
                and isinstance(fmt, str)
                and (re.match(r"^uuid[1-5]?$", fmt) or f"{fmt}-string" in lg.STRING_FORMAT_RULES)
            ):
                return str(super().visit(schema, name))
            if kind == "string" and ("minLength" in schema or "maxLength" in schema):
                lo, hi = _count(schema, "minLength") or 0, _count(schema, "maxLength")
                if hi is not None and hi < lo:
                    raise _SchemaProblem("'maxLength' is less than 'minLength'")
                char = self._add_primitive("char", lg.PRIMITIVE_RULES["char"])
                what = _what(schema, "minLength", "maxLength")
                rep = self._repeat(char, lo, hi, what=what)
                body = " ".join(filter(None, ['"\\""', rep, '"\\"" space']))
                return str(self._add_rule(rule_name, body))
            if kind == "integer":
                rule = _integer_rule(schema)
                if rule is not None:
                    return str(self._add_rule(rule_name, f"({rule}) space"))
            if kind == "object" or len(schema) == 0:
                return str(super().visit(schema, name))
            if kind not in lg.PRIMITIVE_RULES:
                raise _SchemaProblem(f"unsupported schema at '{_clip(name)}' (type {kind!r})")
            return str(super().visit(schema, name))

        def _visit_array(self, schema: dict[str, Any], name: str, rule_name: str) -> str:
            items = schema.get("items")
            if not items and "prefixItems" in schema:
                items = schema["prefixItems"]
            sub = f"{name}{'-' if name else ''}"
            if isinstance(items, list):
                tuple_rules = [self.visit(item, f"{sub}tuple-{i}") for i, item in enumerate(items)]
                body = '"[" space ' + ' "," space '.join(tuple_rules) + ' "]" space'
                return str(self._add_rule(rule_name, body))
            item_rule = self.visit(items, f"{sub}item")
            lo, hi = _count(schema, "minItems") or 0, _count(schema, "maxItems")
            if hi is not None and hi < lo:
                raise _SchemaProblem("'maxItems' is less than 'minItems'")
            what = _what(schema, "minItems", "maxItems")
            rep = self._repeat(item_rule, lo, hi, sep='"," space', what=what)
            return str(
                self._add_rule(rule_name, " ".join(filter(None, ['"[" space', rep, '"]" space'])))
            )

        def _visit_pattern(self, pattern: Any, name: str) -> str:
            if not isinstance(pattern, str):
                raise _SchemaProblem("'pattern' must be a string")
            expr = _Pattern(self, pattern).translate()
            return str(self._add_rule(name, f'"\\"" ({expr}) "\\"" space'))

        def _build_object_rule(
            self,
            properties: list[tuple[str, Any]],
            required: set[str],
            name: str,
            additional_properties: Any,
        ) -> str:
            # The upstream rule shape, built in linear time (the port recurses once per
            # optional property from every optional property, and omits the comma
            # before additional properties).
            sub = f"{name}{'-' if name else ''}"
            kv: dict[str, str] = {}
            for prop_name, prop_schema in properties:
                value = self.visit(prop_schema, f"{sub}{prop_name}")
                kv[prop_name] = self._add_rule(
                    f"{sub}{prop_name}-kv",
                    f'{self._format_literal(json.dumps(prop_name))} space ":" space {value}',
                )
            required_props = [k for k, _ in properties if k in required]
            # (rule name, kv rule, is the additional-properties entry)
            optional = [(k, kv[k], False) for k, _ in properties if k not in required]
            if additional_properties is True or isinstance(additional_properties, dict):
                value = self.visit(
                    {} if additional_properties is True else additional_properties,
                    f"{sub}additional-value",
                )
                string = self._add_primitive("string", lg.PRIMITIVE_RULES["string"])
                extra = self._add_rule(f"{sub}additional-kv", f'{string} ":" space {value}')
                optional.append(("additional", extra, True))

            # pick[j]: one of the optional properties from j on, then maybe (after a
            # comma) more from the next one on. Each choice sits after one shared comma,
            # and its alternatives differ by name right away: llama.cpp keeps one parse
            # stack per property name still possible (upstream kept two per property).
            pick = ""
            for j in range(len(optional) - 1, -1, -1):
                key, kv_rule, many = optional[j]
                if many:  # additional properties: always the last entry, any number of them
                    body = f'{kv_rule} ( "," space {kv_rule} )*'
                else:
                    body = f'{kv_rule} ( "," space {pick} )?' if pick else kv_rule
                    body = f"{body} | {pick}" if pick else body
                pick = self._add_rule(f"{sub}{key}-pick", body)
                self.paths.setdefault(pick, name)
            rule = '"{" space ' + ' "," space '.join(kv[k] for k in required_props)
            if pick:
                rule += f' ( "," space {pick} )?' if required_props else f" {pick}?"
            return rule + ' "}" space'

        def format_grammar(self) -> str:
            # This port lets raw control characters into strings, which is not JSON
            # (json.loads rejects them); llama.cpp's current converter excludes them.
            if self._rules.get("char") == lg.PRIMITIVE_RULES["char"].content:
                self._rules["char"] = (
                    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
                )
            return "\n".join(f"{k} ::= {v}" for k, v in sorted(self._rules.items()))

    return Converter


def _pointer(schema: Any, ref: str) -> Any:
    """The part of ``schema`` a local ``$ref`` (``#/$defs/x``) points at."""
    target = schema
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise _SchemaProblem(f"$ref {_clip(repr(ref))} points at nothing")
    return target


def _what(schema: dict[str, Any], lo_key: str, hi_key: str) -> str:
    keys = [f"{k} {schema[k]}" for k in (lo_key, hi_key) if schema.get(k) is not None]
    return " and ".join(keys) or lo_key


def _converter(max_repeat: int, max_output_chars: int | None, max_alternatives: int | None) -> Any:
    return _converter_class()(max_repeat, max_output_chars, max_alternatives)
