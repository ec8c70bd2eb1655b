"""A backend's event stream, metered and cancellable: :class:`MeteredStream`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Literal

from sluice.core.backend import ResponseStream, StreamMeta
from sluice.core.errors import SluiceError
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
)
from sluice.core.interrupt import Interrupt
from sluice.metrics.slots import RequestMeter


class MeteredStream:
    """A ResponseStream that feeds a RequestMeter as its events pass, and can be
    cancelled from outside (``POST /v1/requests/{id}/cancel``).

    ``state`` follows the request: ``queued`` until the engine admits it (a
    ``prompt_processing`` progress event), ``prefilling`` until its first
    token, then ``generating``. :meth:`cancel` ends the consumer's iteration
    with an ``ErrorEvent`` at once, even while it waits for the next event, and
    aborts the backend.
    """

    def __init__(self, stream: ResponseStream, meter: RequestMeter) -> None:
        self.meta: StreamMeta = stream.meta
        self.meter = meter
        self.prefilling = False
        self.on_end: Callable[[], None] | None = None  # called once, when the meter finishes
        self.flight: Any = None  # its entry among the requests in flight (models/flights.py)
        self._stream = stream
        self._error = False
        # Start gives each choice's prompt size; usage (when it comes) is exact.
        self._prompt: dict[int, int] = {}
        self._completion: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self._iterator: AsyncGenerator[Event, None] | None = None
        self._interrupt = Interrupt()  # cancel() ends the consumer's wait for an event

    @property
    def state(self) -> Literal["queued", "prefilling", "generating"]:
        if self.meter.started:
            return "generating"
        return "prefilling" if self.prefilling else "queued"

    @property
    def model(self) -> str:
        return self.meta.model

    @property
    def replica(self) -> str | None:
        return self.meta.replica

    @property
    def prompt_tokens(self) -> int:
        owners = self.meta.prompt_owners
        return sum(n for choice, n in self._prompt.items() if choice in owners)

    def __aiter__(self) -> AsyncIterator[Event]:
        iterator = self._iterator = self._events()
        return iterator

    async def _events(self) -> AsyncGenerator[Event, None]:
        step = aiter(self._stream).__anext__
        interrupt = self._interrupt
        task = asyncio.current_task()
        try:
            # Interrupt.wait, inline: no coroutine per event on the token path.
            while interrupt.error is None:
                interrupt.waiting = task
                try:
                    event = await step()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not interrupt.claims(task):
                        raise
                    break
                finally:
                    interrupt.waiting = None
                self._observe(event)
                yield event
            error = interrupt.error
            assert isinstance(error, SluiceError)
            self._error = True
            self._finish()
            await self._stream.aclose()  # aborts the engine or the upstream request
            yield ErrorEvent(error)
        except Exception:
            self._error = True
            raise
        finally:
            # Normal end, an ErrorEvent, a backend exception, or the consumer
            # stopped iterating (a disconnect: not an error unless one was seen).
            self._finish()

    def cancel(self, error: SluiceError) -> bool:
        """End the stream with ``error`` (an ``ErrorEvent``); False if it already ended."""
        return not self.meter.finished and self._interrupt.fire(error)

    def _observe(self, event: Event) -> None:
        meter = self.meter
        match event:
            case TextDelta(echo=False, token_count=count):
                meter.first_token()
                meter.tokens(count)
            case ReasoningDelta():
                meter.first_token()
                meter.tokens(1)  # carries no count: one per delta
            case ToolCallStart():
                meter.first_token()
            case ToolCallDelta():
                meter.tokens(1)
            case Start(choice=choice, prompt_tokens=prompt):
                self._prompt[choice] = prompt
            case Progress(phase="prompt_processing"):
                self.prefilling = True
            case Finish(usage=usage) if usage is not None:
                self._prompt[usage.choice] = usage.prompt_tokens
                self._completion[usage.choice] = usage.completion_tokens
                self._cached[usage.choice] = usage.cached_tokens
            case ErrorEvent():
                self._error = True
                self._finish()

    def _finish(self) -> None:
        if self.meter.finished:
            return
        # Usage for only some choices (an abort) would undercount the others: then
        # the live count stands.
        exact = len(self._completion) >= self.meta.choices
        owners = self.meta.prompt_owners
        self.meter.finish(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=sum(self._completion.values()) if exact else None,
            error=self._error,
            cached_tokens=sum(n for choice, n in self._cached.items() if choice in owners),
        )
        if self.on_end is not None:
            self.on_end()

    async def aclose(self) -> None:
        self._finish()
        if self._iterator is not None:
            try:
                await self._iterator.aclose()
            except RuntimeError:  # still running in another task; it finishes there
                pass
        await self._stream.aclose()


def metered(stream: ResponseStream, meter: RequestMeter) -> MeteredStream:
    """``stream`` with ``meter`` fed from its events; same ``meta`` and ``aclose``.

    The meter finishes exactly once: at the stream's end, at an ``ErrorEvent``
    (error), at an exception from the backend (error) or at ``aclose`` (a
    disconnect, not an error).

    Example::

        stream = metered(await backend.open(request), slot.request())
    """
    return MeteredStream(stream, meter)
