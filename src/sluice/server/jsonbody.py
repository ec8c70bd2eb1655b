"""A request body as JSON, within limits, before any schema sees it.

Python's ``json`` accepts what no client means and what later code cannot
handle: ``NaN``/``Infinity``, numbers that overflow to infinity, integers of
thousands of digits, lone UTF-16 surrogates (``"\\ud800"``, which no UTF-8
encoder accepts), nesting deep enough to exhaust the recursion limit. Each is
a 400 here that names where in the body it was found. Counts that make later
work expensive (messages, stop strings, logit_bias entries) are checked on the
plain dict, before validation builds an object per element.

Example::

    limits = BodyLimits(max_messages=100)
    data = parse_json_body(raw, limits)      # InvalidRequest on anything above
    check_body_limits(data, limits)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from sluice.core.errors import InvalidRequest

log = logging.getLogger("sluice.api")


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """Limits on a request body; each is a setting of the same name (``--max-...``)."""

    max_json_depth: int = 64
    max_number_digits: int = 20
    max_messages: int = 4096
    max_stop: int = 4
    max_stop_length: int = 256
    max_logit_bias: int = 1024
    max_embedding_inputs: int = 2048


class _Bad:
    """A JSON number that is not a usable value, kept until its place is known."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _may_hold_surrogates(raw: bytes) -> bool:
    """An escape that may be a UTF-16 surrogate (\\ud800-\\udfff, or its neighbours)
    in the raw body: only then can a decoded string hold a lone surrogate, so only
    then are strings checked. (``in`` on bytes is a fast substring search that,
    unlike a regex over megabytes, does not hold the GIL for long.)"""
    return b"\\ud" in raw or b"\\uD" in raw


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while a body is parsed, checked and dropped.

    Parsing a few MB of JSON allocates hundreds of thousands of containers;
    they trigger full collections that walk all of them with the GIL held
    (measured: 3 MB of tiny messages parsed in 39 ms with the collector on,
    29 ms off, plus stalls of 50+ ms on whichever thread the collection lands,
    the event loop's included). The tree is freed by reference counting before
    the collector is back, so it never has to walk it.
    """
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        _gc_pausers += 1
        if _gc_pausers == 1:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def _yield_point(obj: dict[str, Any]) -> dict[str, Any]:
    """Called by the C parser for every object: Python code, where the interpreter
    may hand the GIL to another thread. Without it ``json.loads`` holds the GIL
    for its whole run (7 MB of tiny messages: ~100 ms in which the event loop,
    and so /health, could not run; with it: ~20 ms at worst)."""
    return obj


# A body this small is parsed in microseconds: no point in yielding the GIL on the way.
_QUICK_BYTES = 64 * 1024


@functools.lru_cache(maxsize=16)
def _decoder(max_digits: int, yielding: bool) -> json.JSONDecoder:
    """The decoder for ``--max-number-digits`` (made once: ``json.loads`` with hooks
    builds a decoder and its scanner per call); ``yielding``: with :func:`_yield_point`
    called for every object, for a body big enough to hold the GIL for long."""

    def parse_int(text: str) -> int | _Bad:
        digits = len(text) - (text[0] == "-")
        return int(text) if digits <= max_digits else _Bad(text)

    def parse_float(text: str) -> float | _Bad:
        value = float(text)
        return value if math.isfinite(value) else _Bad(text)

    return json.JSONDecoder(
        parse_int=parse_int,
        parse_float=parse_float,
        parse_constant=_Bad,
        object_hook=_yield_point if yielding else None,
    )


def parse_json_body(raw: bytes, limits: BodyLimits) -> dict[str, Any]:
    """The body as a JSON object, or :class:`InvalidRequest` naming what is wrong."""
    try:
        # Strictly UTF-8 (RFC 8259), a BOM allowed: json.loads on bytes would also take
        # UTF-16/32 and surrogates encoded as UTF-8 (CESU-8), which are not text.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"The body is not valid UTF-8: {exc}") from exc
    try:
        data = _decoder(limits.max_number_digits, len(raw) > _QUICK_BYTES).decode(text)
    except RecursionError as exc:
        raise InvalidRequest(
            f"The body is nested too deeply (the limit is {limits.max_json_depth} levels, "
            "--max-json-depth)."
        ) from exc
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise InvalidRequest(f"The body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("The body must be a JSON object.")
    _check_tree(data, limits, strings=_may_hold_surrogates(raw))
    return data


def _check_tree(root: dict[str, Any], limits: BodyLimits, *, strings: bool) -> None:
    """Depth, numbers and (if ``strings``) lone surrogates, without recursion."""
    max_depth = limits.max_json_depth
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequest(
                f"The body is nested more than {max_depth} levels deep at "
                f"'{_path_to(root, node)}' (--max-json-depth).",
                param=_path_to(root, node) or None,
            )
        # Keys first: every path named below is then made of checked keys.
        if strings and isinstance(node, dict):
            for key in node:
                if not _encodable(key):
                    where = _path_to(root, node)
                    raise InvalidRequest(
                        f"A key in '{where or 'the body'}' contains a lone UTF-16 surrogate.",
                        param=where or None,
                    )
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is _Bad:
                where = _path_to(root, child)
                raise InvalidRequest(
                    f"'{where}' is {_describe(child)}: numbers must be finite and integers "
                    f"at most {limits.max_number_digits} digits (--max-number-digits).",
                    param=where,
                )
            elif strings and kind is str and not _encodable(child):
                where = _path_to(root, child)
                raise InvalidRequest(
                    f"'{where}' contains a lone UTF-16 surrogate escape (such as \\ud800), "
                    "which is not a character.",
                    param=where,
                )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe(bad: _Bad) -> str:
    text = bad.text
    if len(text) > 24:
        return f"a number of {len(text)} characters"
    return f"the number {text}"


def _path_to(root: Any, target: Any) -> str:
    """``messages[0].content`` for the object ``target`` (found by identity; errors only)."""
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if isinstance(node, dict):
            for key, value in node.items():
                stack.append((value, f"{path}.{key}" if path else str(key)))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                stack.append((value, f"{path}[{i}]"))
    return ""


def check_body_limits(data: dict[str, Any], limits: BodyLimits, *, stop: str = "stop") -> None:
    """Counts that would make validation or generation expensive; 400 naming the field
    (``stop``: the dialect's name of the stop strings' field)."""
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise InvalidRequest(
            f"'messages' has {len(messages)} messages; the limit is {limits.max_messages} "
            "(--max-messages).",
            param="messages",
        )
    field = stop
    value = data.get(field)
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if len(stops) > limits.max_stop:
        raise InvalidRequest(
            f"'{field}' has {len(stops)} strings; the limit is {limits.max_stop} (--max-stop).",
            param=field,
        )
    for i, s in enumerate(stops):
        if isinstance(s, str) and len(s) > limits.max_stop_length:
            raise InvalidRequest(
                f"'{field}' string {i} is {len(s)} characters; the limit is "
                f"{limits.max_stop_length} (--max-stop-length).",
                param=field,
            )
    bias = data.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise InvalidRequest(
            f"'logit_bias' has {len(bias)} entries; the limit is {limits.max_logit_bias} "
            "(--max-logit-bias).",
            param="logit_bias",
        )


def field_path(loc: tuple[int | str, ...], data: Any, *, missing: bool = False) -> str:
    """``messages[0].content`` from pydantic's location, without its union-member tags.

    Pydantic puts the member it tried into the location (``prompt.str``,
    ``content.list[ContentPart]``); a step that is not a key or index of the body
    there is such a tag, except the last step of a missing field.
    """
    path = ""
    node = data
    for i, step in enumerate(loc):
        if isinstance(step, int) and isinstance(node, list) and 0 <= step < len(node):
            node = node[step]
            path += f"[{step}]"
        elif (
            isinstance(step, str)
            and isinstance(node, dict)
            and (step in node or (missing and i == len(loc) - 1))
        ):
            node = node.get(step)
            path += f".{step}" if path else step
    return path


M = TypeVar("M", bound=BaseModel)


def validate_body(data: dict[str, Any], model: type[M], *, passthrough: bool = False) -> M:
    """``data`` as ``model``, or a 400 naming the field. Unknown fields are logged as
    ignored, unless the body goes on to an upstream (``passthrough``) that reads them."""
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = field_path(first["loc"], data, missing=first["type"] == "missing")
        raise InvalidRequest(f"Invalid '{loc}': {first['msg']}", param=loc or None) from exc
    unknown = parsed.unknown_fields()  # type: ignore[attr-defined]
    if unknown and not passthrough:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown))
    return parsed


def check_embed_inputs(items: list[Any], limits: BodyLimits) -> list[str] | list[list[int]]:
    """Inputs one request may have: at least one, at most ``max_embedding_inputs``, none
    empty, all texts or all token lists."""
    if not items:
        raise InvalidRequest("'input' is empty", param="input")
    if len(items) > limits.max_embedding_inputs:
        raise InvalidRequest(
            f"'input' has {len(items)} items; the limit is {limits.max_embedding_inputs} "
            "(--max-embedding-inputs)",
            param="input",
        )
    for i, item in enumerate(items):
        if isinstance(item, str | list) and not item:
            raise InvalidRequest(f"input[{i}] is empty", param=f"input[{i}]")
    texts = all(isinstance(x, str) for x in items)
    if not texts and not all(isinstance(x, list) for x in items):
        raise InvalidRequest("'input' mixes texts and token ids", param="input")
    return items
