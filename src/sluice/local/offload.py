"""Work that must not run on the event loop: a few daemon worker threads.

Parsing a large body, rendering a chat template over thousands of messages,
tokenizing megabytes and compiling a grammar take from milliseconds to
seconds; on the event loop they would stall every other stream and
``/health``. They run here instead. The threads are daemons on purpose (not
``asyncio.to_thread`` or anyio's workers, which the interpreter joins at
exit): a long C call in one of them must never keep the process from exiting
on SIGTERM.

Example::

    offload = Offload(workers=2)
    stream = await offload.run(open_stream, on_abandon=lambda s: s.close())
    offload.close()
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("sluice.serving")

T = TypeVar("T")


class _Job:
    __slots__ = ("fn", "future", "loop", "on_abandon")

    def __init__(
        self,
        fn: Callable[[], Any],
        future: asyncio.Future[Any],
        loop: asyncio.AbstractEventLoop,
        on_abandon: Callable[[Any], None] | None,
    ) -> None:
        self.fn = fn
        self.future = future
        self.loop = loop
        self.on_abandon = on_abandon


class Offload:
    """A fixed pool of daemon threads that runs blocking calls for the event loop."""

    def __init__(self, workers: int = 2, name: str = "sluice-prepare") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for thread in self._threads:
            thread.start()

    async def run(self, fn: Callable[[], T], *, on_abandon: Callable[[T], None] | None = None) -> T:
        """``fn()`` on a worker thread. If the caller is cancelled before it
        finishes, its result is handed to ``on_abandon`` (to release it) instead."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put(_Job(fn, future, loop, on_abandon))
        return await future

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.future.cancelled():
                continue
            try:
                result = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                self._deliver(job, None, exc)
            else:
                self._deliver(job, result, None)

    @staticmethod
    def _deliver(job: _Job, result: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if not job.future.cancelled():
                if error is not None:
                    job.future.set_exception(error)
                else:
                    job.future.set_result(result)
            elif error is None and job.on_abandon is not None:
                job.on_abandon(result)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is gone: nobody will take the result
            if error is None and job.on_abandon is not None:
                try:
                    job.on_abandon(result)
                except Exception:  # pragma: no cover - best effort at shutdown
                    log.exception("releasing an abandoned result failed")


def post_to_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> bool:
    """``fn`` on ``loop`` from any thread; False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        return False
    return True


def run_in_thread(
    fn: Callable[[], T], name: str, abandon: Callable[[T], None] | None = None
) -> asyncio.Future[T]:
    """Run ``fn`` on a new daemon thread of its own (a load or an unload: seconds, rare);
    ``abandon`` disposes of a result nobody awaits any more."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def work() -> None:
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiters
            error = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))

            def fail() -> None:
                if not future.cancelled():
                    future.set_exception(error)

            post_to_loop(loop, fail)
            return

        def succeed() -> None:
            if not future.cancelled():
                future.set_result(value)
            elif abandon is not None:
                threading.Thread(target=abandon, args=(value,), daemon=True).start()

        if not post_to_loop(loop, succeed) and abandon is not None:
            abandon(value)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future
