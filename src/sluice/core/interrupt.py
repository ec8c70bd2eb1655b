"""Ending another task's wait with an error, from outside: what cancelling a request in
flight needs (``POST /v1/requests/{id}/cancel``).

The reader awaits through :meth:`Interrupt.wait`; :meth:`Interrupt.fire` from any
task on the loop then ends that wait with the error at once (by cancelling the
waiting task and taking the cancellation back), or, if the reader is busy
elsewhere, its next wait. A cancellation that is not ours (the client went
away) still propagates. Nothing is paid per await but two attribute writes.

Example::

    interrupt = Interrupt()
    chunk = await interrupt.wait(lambda: anext(source))   # in the reader
    interrupt.fire(RequestCancelled("..."))                # elsewhere: the wait raises it
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Interrupt:
    __slots__ = ("_waiting", "error")

    def __init__(self) -> None:
        self.error: Exception | None = None
        self._waiting: asyncio.Task[object] | None = None

    async def wait(self, start: Callable[[], Awaitable[T]]) -> T:
        """``await start()``, unless :meth:`fire` ends it (or has) with its error."""
        if self.error is not None:
            raise self.error
        task = asyncio.current_task()
        self._waiting = task
        try:
            return await start()
        except asyncio.CancelledError:
            if self.error is None or task is None or task.uncancel() > 0:
                raise  # not ours, or ours and someone else's too
            raise self.error from None
        finally:
            self._waiting = None

    def fire(self, error: Exception) -> bool:
        """End the current (or next) wait with ``error``; False if already fired."""
        if self.error is not None:
            return False
        self.error = error
        if self._waiting is not None:
            self._waiting.cancel()
        return True
