"""Run each choice's text through its parser chain (reasoning, then tool calls).

Example::

    events = parse_stream(stream, plan.parsers)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from sluice.core.events import Event, Finish, TextDelta
from sluice.parsers.base import StreamParser


class ParserChain:
    """One choice's parsers; each passes only its content on to the next."""

    def __init__(self, parsers: list[StreamParser]) -> None:
        self.parsers = parsers

    @property
    def called_tools(self) -> bool:
        return any(p.called_tools for p in self.parsers)

    def feed(self, text: str) -> list[Event]:
        return self._run(0, lambda p: p.feed(text))

    def flush(self) -> list[Event]:
        out: list[Event] = []
        for i in range(len(self.parsers)):
            out.extend(self._run(i, lambda p: p.flush()))
        return out

    def _run(self, start: int, first: Callable[[StreamParser], list[Event]]) -> list[Event]:
        """Apply ``first`` to parser ``start``, then pipe its content through the rest."""
        events = first(self.parsers[start])
        for parser in self.parsers[start + 1 :]:
            piped: list[Event] = []
            for event in events:
                if isinstance(event, TextDelta):
                    piped.extend(parser.feed(event.text))
                else:
                    piped.append(event)
            events = piped
        return events


async def parse_stream(
    events: AsyncIterator[Event], make_parsers: Callable[[int], list[StreamParser]]
) -> AsyncIterator[Event]:
    """Rewrite text deltas into content / reasoning / tool-call events per choice.

    Token counts and logprobs of a delta stay with the first content delta it
    produced (or an empty delta, which formatters do not send but do count),
    and a choice that called tools and stopped finishes with ``tool_calls``.
    """
    chains: dict[int, ParserChain] = {}
    async for event in events:
        if isinstance(event, TextDelta) and not event.echo:
            chain = chains.get(event.choice)
            if chain is None:
                chain = chains[event.choice] = ParserChain(make_parsers(event.choice))
            if not chain.parsers:
                yield event
                continue
            for out in _attach(chain.feed(event.text), event):
                yield out
        elif isinstance(event, Finish):
            chain = chains.get(event.choice)
            if chain is not None and chain.parsers:
                for out in chain.flush():
                    yield out
                if chain.called_tools and event.reason == "stop":
                    event = replace(event, reason="tool_calls")
            yield event
        else:
            yield event


def _attach(parsed: list[Event], source: TextDelta) -> list[Event]:
    """Keep the source delta's token count and logprobs on the content it became."""
    for i, event in enumerate(parsed):
        if isinstance(event, TextDelta):
            parsed[i] = replace(event, token_count=source.token_count, logprobs=source.logprobs)
            return parsed
    if source.token_count or source.logprobs:
        return [*parsed, TextDelta(source.choice, "", source.token_count, None)]
    return parsed
