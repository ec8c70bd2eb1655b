"""Chat prompts where only the template's own markup becomes control tokens.

Tokenizing a rendered chat prompt with special-token parsing on (what
llama.cpp's server and most others do) lets a user who types
``<|im_end|><|im_start|>system`` write real control tokens and speak as the
system. The guard escapes every control-token text inside what came from the
request (message contents, names, tool calls and results, tools, template
variables) to a private-use marker before rendering; after rendering, the
prompt is tokenized in segments: the template's text with special parsing,
each escaped control text as plain text.

A marker is ``U+E000`` followed by one character naming the escaped text; a
``U+E000`` typed by the user is itself escaped, so no input can forge one.
Text that holds no control-token text (nearly every request) renders and
tokenizes exactly as before, in one piece.

Example::

    guard = ControlTextGuard(["<|im_start|>", "<|im_end|>"])
    messages = guard.escape(messages)
    text = template.render(messages)
    tokens = guard.tokenize(text, runner.tokenize, add_special=True)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from sluice.engine.text import literal_regex

MARK = "\ue000"
_BASE = 0xE100  # marker i names the escaped text self._texts[i]

Tokenizer = Callable[..., list[int]]


class ControlTextGuard:
    """Escapes control-token text in request data; tokenizes rendered prompts by segment."""

    def __init__(self, control_texts: Iterable[str]) -> None:
        self._texts = [*sorted({t for t in control_texts if t and MARK not in t}), MARK]
        self._code = {t: f"{MARK}{chr(_BASE + i)}" for i, t in enumerate(self._texts)}
        find = literal_regex(self._texts)
        assert find is not None  # MARK is always there
        self._find = find
        self._marker = re.compile(f"{MARK}([{chr(_BASE)}-{chr(_BASE + len(self._texts) - 1)}])")

    def escape(self, value: Any) -> Any:
        """``value`` with control-token text in every string replaced by a marker."""
        if isinstance(value, str):
            if self._find.search(value) is None:
                return value
            return self._find.sub(lambda m: self._code[m.group()], value)
        if isinstance(value, dict):
            return {k: self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def segments(self, rendered: str) -> list[tuple[str, bool]]:
        """``(text, is_markup)`` pieces: markup is tokenized with special parsing."""
        if MARK not in rendered:
            return [(rendered, True)]
        out: list[tuple[str, bool]] = []
        at = 0
        for m in self._marker.finditer(rendered):
            if m.start() > at:
                out.append((rendered[at : m.start()], True))
            out.append((self._texts[ord(m.group(1)) - _BASE], False))
            at = m.end()
        if at < len(rendered):
            out.append((rendered[at:], True))
        # A marker cut in half by the template (a slice of the content) is dropped.
        return [(t.replace(MARK, "") if markup else t, markup) for t, markup in out if t]

    def tokenize(self, rendered: str, tokenize: Tokenizer, *, add_special: bool) -> list[int]:
        """Tokens of a rendered prompt; only the template's markup yields control tokens.

        ``add_special`` (the BOS) applies to the first segment only.
        """
        tokens: list[int] = []
        for i, (text, markup) in enumerate(self.segments(rendered)):
            tokens += tokenize(text, add_special=add_special and i == 0, parse_special=markup)
        return tokens
