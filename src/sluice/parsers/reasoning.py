"""Reasoning split: ``<think>…</think>`` becomes ReasoningDelta, the rest TextDelta.

One reasoning block is recognised, at the start of the output (after optional
whitespace), as the families that think this way emit it. After the block the
parser passes content straight through, so a later literal ``<think>`` in an
answer (say, one that explains the tags) stays content and costs no latency.

Example::

    parser = ReasoningParser(0)
    parser.feed("<thi")               # [] (may be the start tag)
    parser.feed("nk>Let me see</th")  # [ReasoningDelta(0, "Let me see")]
    parser.feed("ink>\\n\\nHello")       # [TextDelta(0, "Hello")]
"""

from __future__ import annotations

from enum import Enum, auto

from sluice.core.events import Event, ReasoningDelta, TextDelta
from sluice.parsers.common import WHITESPACE, partial_tag_len


class _State(Enum):
    START = auto()  # nothing but whitespace yet: a start tag may still come
    REASONING = auto()
    AFTER_END = auto()  # just closed: drop the whitespace that follows the end tag
    CONTENT = auto()  # pass-through
    HELD = auto()  # a call's markup inside reasoning: held until the reasoning closes or not


class ReasoningParser:
    """Text inside ``start``/``end`` markers as reasoning, outside as content.

    ``opened=True`` means the prompt already ends with the start tag, so the
    output begins inside reasoning (a start tag written again is reasoning text, as
    llama.cpp reads it); ``lead`` is what the prompt wrote inside it, reported as the
    reasoning's beginning; ``answer`` (the answer's opening markup) ends a reasoning
    block the model left open, as llama.cpp reads it. ``interrupt``: a tool call's opening markup; inside reasoning
    that never closes it ends the reasoning (a model that calls without closing its
    reasoning first), inside reasoning that closes later it is reasoning text.
    """

    __slots__ = (
        "_buf",
        "_lead",
        "_state",
        "answer",
        "choice",
        "end",
        "interrupt",
        "opened",
        "start",
    )

    def __init__(
        self,
        choice: int,
        start: str = "<think>",
        end: str = "</think>",
        opened: bool = False,
        interrupt: tuple[str, ...] = (),
        lead: str = "",
        answer: str = "",
    ) -> None:
        self.choice = choice
        self.start = start
        self.end = end
        self.opened = opened
        self.interrupt = tuple(m for m in interrupt if m)
        self._state = _State.REASONING if opened else _State.START
        self._buf = ""
        self._lead = lead if opened else ""  # the prompt's part of the reasoning
        self.answer = answer  # the answer's opening markup: it ends reasoning left open

    @property
    def called_tools(self) -> bool:
        return False

    def feed(self, text: str) -> list[Event]:
        if self._state is _State.CONTENT:  # hot path once the answer is under way
            return [TextDelta(self.choice, text)] if text else []
        self._buf += text
        events: list[Event] = []
        while self._buf:
            if self._state is _State.START:
                if not self._start():
                    break
            elif self._state is _State.REASONING:
                buf = self._buf
                at = buf.find(self.end)
                cut = self._interrupted(buf, at)
                if cut is not None:
                    # A call's markup inside reasoning: a call if the reasoning never
                    # closes, reasoning text if it does. Hold it until one is known.
                    self._reasoning(events, buf[:cut])
                    self._buf = buf[cut:]
                    self._state = _State.HELD
                    continue
                answer_at = buf.find(self.answer) if self.answer else -1
                if answer_at != -1 and (at == -1 or answer_at < at):
                    # The answer opens without the reasoning's end: it ends there.
                    self._reasoning(events, buf[:answer_at])
                    self._buf = buf[answer_at:]
                    self._state = _State.AFTER_END
                    continue
                if at != -1:
                    self._reasoning(events, buf[:at])
                    self._buf = buf[at + len(self.end) :]
                    self._state = _State.AFTER_END
                    continue
                keep = partial_tag_len(buf, (self.end, self.answer, *self.interrupt))
                self._reasoning(events, buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            elif self._state is _State.HELD:
                at = self._buf.find(self.end)
                if at == -1:
                    break
                self._reasoning(events, self._buf[:at])
                self._buf = self._buf[at + len(self.end) :]
                self._state = _State.AFTER_END
            elif self._state is _State.AFTER_END:
                rest = self._buf.lstrip(WHITESPACE)
                self._buf = rest
                if rest:
                    self._state = _State.CONTENT
            else:
                events.append(TextDelta(self.choice, self._buf))
                self._buf = ""
        return events

    def flush(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._state is _State.HELD:  # never closed: the reasoning ended at the call
            return [TextDelta(self.choice, buf)]
        if not buf or self._state in (_State.AFTER_END, _State.CONTENT):
            return []
        if self._state is _State.REASONING or self.opened:
            return [ReasoningDelta(self.choice, buf)]
        return [TextDelta(self.choice, buf)]

    def _start(self) -> bool:
        """Decide how the output begins; False while it is still undecided."""
        rest = self._buf.lstrip(WHITESPACE)
        if rest.startswith(self.start):
            self._buf = rest[len(self.start) :]
            self._state = _State.REASONING
            return True
        if not rest or self.start.startswith(rest):
            return False  # only whitespace, or a possible start tag so far
        self._state = _State.REASONING if self.opened else _State.CONTENT
        return True

    def _interrupted(self, buf: str, end_at: int) -> int | None:
        """Where an interrupting marker starts in ``buf``, if before the end tag."""
        best = None
        for marker in self.interrupt:
            at = buf.find(marker)
            if at != -1 and (end_at == -1 or at < end_at) and (best is None or at < best):
                best = at
        return best

    def _reasoning(self, events: list[Event], text: str) -> None:
        if self._lead:
            text, self._lead = self._lead + text, ""
        if text:
            events.append(ReasoningDelta(self.choice, text))
