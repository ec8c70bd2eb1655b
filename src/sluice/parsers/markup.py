"""Markup that is never content: the answer's own wrapper and the end of the turn.

Some families wrap the answer (Command R's ``<|START_RESPONSE|>...<|END_RESPONSE|>``,
gpt-oss's ``<|channel|>final<|message|>...<|return|>``) or write their end-of-turn
marker as text the parsers see; this parser takes those strings out of the
content, holding back a possible prefix of one until it is decided.

Example::

    parser = MarkupStripper(0, ("<|START_RESPONSE|>", "<|END_RESPONSE|>"))
    parser.feed("<|START_RESPONSE|>Hi<|END_")   # [TextDelta("Hi")]
    parser.feed("RESPONSE|>")                    # []
"""

from __future__ import annotations

from sluice.core.events import Event, TextDelta
from sluice.parsers.common import partial_tag_len


class MarkupStripper:
    """Content without the given markup strings (one per choice)."""

    __slots__ = ("_buf", "choice", "markup")

    def __init__(self, choice: int, markup: tuple[str, ...]) -> None:
        self.choice = choice
        self.markup = tuple(sorted({m for m in markup if m}, key=len, reverse=True))
        self._buf = ""

    @property
    def called_tools(self) -> bool:
        return False

    def feed(self, text: str) -> list[Event]:
        buf = self._buf + text
        # Hold what may still become markup (a marker may also begin a longer one).
        keep = partial_tag_len(buf, self.markup)
        self._buf = buf[len(buf) - keep :]
        out = self._strip(buf[: len(buf) - keep])
        return [TextDelta(self.choice, out)] if out else []

    def _strip(self, text: str) -> str:
        for marker in self.markup:  # longest first
            if marker in text:
                text = text.replace(marker, "")
        return text

    def flush(self) -> list[Event]:
        out, self._buf = self._strip(self._buf), ""
        return [TextDelta(self.choice, out)] if out else []


class Prepend:
    """The output as if it began with ``text``: markup the generation prompt ended with
    and the model's output goes on from (functionary's ``>>>`` before a recipient)."""

    __slots__ = ("_text", "choice")

    def __init__(self, choice: int, text: str) -> None:
        self.choice = choice
        self._text = text

    @property
    def called_tools(self) -> bool:
        return False

    def feed(self, text: str) -> list[Event]:
        if self._text and text:
            text, self._text = self._text + text, ""
        return [TextDelta(self.choice, text)] if text else []

    def flush(self) -> list[Event]:
        return []  # no output: nothing went on from the prompt
