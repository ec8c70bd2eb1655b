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
from typing import Any, TypeVar

T = TypeVar("T")


class Interrupt:
    """See the module. :meth:`wait` for one await; on a per-token path, where a
    coroutine per await costs, the reader sets :attr:`waiting` around its own await
    and asks :meth:`claims` of a ``CancelledError`` (what :meth:`wait` does)."""

    __slots__ = ("error", "waiting")

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.waiting: asyncio.Task[Any] | None = None  # the reader, while it awaits

    async def wait(self, start: Callable[[], Awaitable[T]]) -> T:
        """``await start()``, unless :meth:`fire` ends it (or has) with its error."""
        if self.error is not None:
            raise self.error
        task = asyncio.current_task()
        self.waiting = task
        try:
            return await start()
        except asyncio.CancelledError:
            error = self.error
            if error is None or not self.claims(task):
                raise
            raise error from None
        finally:
            self.waiting = None

    def claims(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether the ``CancelledError`` ``task`` got is this interrupt's (taken back,
        then): False for anyone else's, or ours and someone else's too."""
        return self.error is not None and task is not None and task.uncancel() == 0

    def fire(self, error: Exception) -> bool:
        """End the current (or next) wait with ``error``; False if already fired."""
        if self.error is not None:
            return False
        self.error = error
        if self.waiting is not None:
            self.waiting.cancel()
        return True
