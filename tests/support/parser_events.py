"""Folding parser events for assertions, and the ways to cut a text into feeds."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sluice.core.events import (
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from sluice.parsers.base import StreamParser

ID = re.compile(r"call_[0-9a-f]{24}")


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""
    ended: bool = False


@dataclass
class Folded:
    content: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)

    @property
    def summary(self) -> tuple[str, str, list[tuple[str, str]]]:
        """What a client ends up with: (content, reasoning, [(name, arguments)])."""
        return self.content, self.reasoning, [(c.name, c.arguments) for c in self.calls]


def fold(events: Iterable[Event], choice: int = 0) -> Folded:
    """Events -> (content, reasoning, calls), checking the tool-call event contract."""
    out = Folded()
    open_call: Call | None = None
    for ev in events:
        assert getattr(ev, "choice", choice) == choice, ev
        if isinstance(ev, TextDelta):
            assert ev.text, "empty content delta"
            assert open_call is None, f"content {ev.text!r} inside an open call"
            out.content += ev.text
        elif isinstance(ev, ReasoningDelta):
            assert ev.text, "empty reasoning delta"
            out.reasoning += ev.text
        elif isinstance(ev, ToolCallStart):
            assert open_call is None, "a call started while another is open"
            assert ev.index == len(out.calls), f"index {ev.index} is not dense"
            assert ID.fullmatch(ev.id), ev.id
            assert ev.id not in {c.id for c in out.calls}, "duplicate id"
            assert ev.name, "empty name"
            open_call = Call(ev.id, ev.name)
            out.calls.append(open_call)
        elif isinstance(ev, ToolCallDelta):
            assert open_call is not None and ev.index == len(out.calls) - 1, ev
            assert ev.arguments, "empty arguments delta"
            open_call.arguments += ev.arguments
        elif isinstance(ev, ToolCallEnd):
            assert open_call is not None and ev.index == len(out.calls) - 1, ev
            open_call.ended = True
            open_call = None
        else:
            raise TypeError(f"unexpected event {ev!r}")
    assert open_call is None, "a call was never ended"
    return out


def run(parser: StreamParser, pieces: Iterable[str]) -> list[Event]:
    """Feed ``pieces`` in order, then flush."""
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.flush()


def splits(text: str, *, random_cuts: int = 20, seed: int = 0) -> list[list[str]]:
    """Whole; cut in two at every position; one character at a time; random multi-cuts."""
    out = [[text]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(random_cuts if len(text) > 2 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8))))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return out


def fold_every_split(
    make: Callable[[], StreamParser], text: str
) -> tuple[str, str, list[tuple[str, str]]]:
    """Fold ``text`` fed whole, and assert every other way to feed it folds the same."""
    whole = fold(run(make(), [text])).summary
    for pieces in splits(text):
        assert fold(run(make(), pieces)).summary == whole, f"differs when fed as {pieces!r}"
    return whole
