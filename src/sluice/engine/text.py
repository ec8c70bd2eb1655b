"""Incremental text transformers: UTF-8 reassembly and stop-string hold-back.

Both share the engine's transformer shape: ``feed(...)`` returns what is
decided now, ``flush()`` returns what was held back once nothing more comes.

Example::

    out = SequenceText(stops=("\\n\\n",), logprobs=False)
    ready, stop = out.feed_token(b"Hi\\n", None)   # "Hi" ready, "\\n" held back
    ready, stop = out.feed_token(b"\\n", None)     # stop == "\\n\\n", nothing more
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sluice.core.events import TokenLogprob


class Utf8Assembler:
    """Bytes of token pieces in, complete UTF-8 text out.

    A multi-byte character split across tokens is held until complete; truly
    invalid bytes become U+FFFD (there is no other text to give for them). An
    incomplete character still held when the sequence ends was cut (by
    ``max_tokens``, a stop, the end of the context) and is dropped, never sent
    as U+FFFD (pitfall 7).
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data, False)

    def flush(self) -> str:
        # The decoder holds back only a valid prefix of a character; drop it.
        self._decoder.reset()
        return ""


class StopMatcher:
    """Finds stop strings in text and says how much of a tail may still begin one."""

    __slots__ = ("_max_len", "stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._max_len = max((len(s) for s in self.stops), default=0)

    def find(self, text: str) -> tuple[int, str] | None:
        """Earliest complete stop string in ``text``: (index, stop)."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        if not self.stops:
            return 0
        longest = min(len(text), self._max_len - 1)
        for n in range(longest, 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self.stops):
                return n
        return 0


@dataclass(slots=True)
class Ready:
    """Text decided in one feed, with the tokens it completes."""

    text: str
    tokens: int
    logprobs: list[TokenLogprob] | None


@dataclass(slots=True)
class _Pending:
    text: str
    logprob: TokenLogprob | None
    is_token: bool = True


@dataclass(slots=True)
class SequenceText:
    """Turns one sequence's sampled token pieces into releasable text.

    Holds back, at token granularity (so logprobs stay one per token):
    incomplete UTF-8 and any tail that may still become a stop string.
    """

    stops: tuple[str, ...] = ()
    logprobs: bool = False
    _utf8: Utf8Assembler = field(default_factory=Utf8Assembler)
    _matcher: StopMatcher = field(init=False)
    _pending: list[_Pending] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._matcher = StopMatcher(self.stops)

    def feed_token(
        self, piece: bytes, logprob: TokenLogprob | None
    ) -> tuple[Ready | None, str | None]:
        """Add one token's bytes; returns (ready text or None, stop string hit or None)."""
        self._pending.append(_Pending(self._utf8.feed(piece), logprob))
        if not self._matcher.stops:
            return self._release(len(self._pending[-1].text) + self._held_chars(), cut=False), None
        text = "".join(p.text for p in self._pending)
        hit = self._matcher.find(text)
        if hit is not None:
            return self._release(hit[0], cut=True), hit[1]
        return self._release(len(text) - self._matcher.holdback(text), cut=False), None

    def flush(self) -> Ready | None:
        """Everything still held (the sequence ended without a stop string)."""
        tail = self._utf8.flush()
        if tail:
            self._pending.append(_Pending(tail, None, is_token=False))
        # Everything pending, the last token included (``_held_chars`` leaves it out).
        return self._release(sum(len(p.text) for p in self._pending), cut=True)

    def _held_chars(self) -> int:
        return sum(len(p.text) for p in self._pending[:-1]) if len(self._pending) > 1 else 0

    def _release(self, limit: int, *, cut: bool) -> Ready | None:
        """Release the whole pending tokens that end within ``limit`` chars.

        Without ``cut``, tokens whose bytes are still an incomplete character
        stay pending with what follows. With ``cut`` (a stop string starts at
        ``limit``, or the sequence ended) the straddling token is released
        truncated and everything after it is dropped.
        """
        pending = self._pending
        n = 0
        used = 0
        for p in pending:
            if used + len(p.text) > limit:
                break
            used += len(p.text)
            n += 1
        released = pending[:n]
        if cut:
            if n < len(pending) and used < limit:
                straddler = pending[n]
                released.append(_Pending(straddler.text[: limit - used], straddler.logprob))
            self._pending = []
        else:
            while released and released[-1].text == "":
                released.pop()
            self._pending = pending[len(released) :]
        if not released:
            return None
        lps = [p.logprob for p in released if p.logprob is not None]
        return Ready(
            "".join(p.text for p in released),
            sum(1 for p in released if p.is_token),
            lps if self.logprobs else None,
        )


def literal_regex(texts: Iterable[str]) -> re.Pattern[str] | None:
    """One regex for many literal texts, shaped as a trie.

    Matching costs the length of the text, not the number of literals (an
    alternation of Gemma's 6,000 control-token texts would try each one at
    every position); at a position it matches the longest literal.

    >>> literal_regex(["<a>", "<ab>"]).findall("x<ab><a>")
    ['<ab>', '<a>']
    """
    trie: dict[str, Any] = {}
    for text in texts:
        if not text:
            continue
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}
    if not trie:
        return None

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie))
