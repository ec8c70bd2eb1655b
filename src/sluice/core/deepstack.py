"""Work that recurses deep in native code, run on threads with a deep stack.

llguidance compiles a grammar's nested rules (and a JSON schema's ``$ref``
chains) recursively, about 4 KiB of native stack a level: 2,000 nested
``$defs`` (a 126 kB schema) or 4,096 nested rules overflowed a thread's
default 8 MiB and crashed the process with a segfault (16 MiB were enough
for 4,096). :func:`run_deep` runs such work on threads of their own with
``STACK`` bytes of stack (address space, used only as needed). A thread is
started whenever every one is busy, up to ``MAX_THREADS``: one slow compile
never holds up another model's request.

Example::

    matcher = run_deep(lambda: llguidance.LLMatcher(tokenizer, grammar))
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

STACK = 512 << 20
MAX_THREADS = 8

_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_lock = threading.Lock()
_threads = 0
_idle = 0  # threads waiting for a job


def run_deep(fn: Callable[[], T]) -> T:
    """``fn()`` on a deep-stack thread; its result, or its exception raised here."""
    global _threads, _idle
    done: Future[T] = Future()
    with _lock:
        if _idle > 0:
            _idle -= 1  # that thread takes this job
        elif _threads < MAX_THREADS:
            old = threading.stack_size(STACK)
            try:
                name = f"sluice-deep-{_threads}"
                threading.Thread(target=_loop, name=name, daemon=True).start()
            finally:
                threading.stack_size(old)
            _threads += 1
        _jobs.put((fn, done))
    return done.result()


def threads() -> int:
    """How many deep-stack threads have been started."""
    return _threads


def _loop() -> None:
    global _idle
    while True:
        fn, done = _jobs.get()
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome: tuple[Any, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        # Idle before the caller hears back: its next job then finds this thread
        # instead of starting another.
        with _lock:
            _idle += 1
        if outcome[1] is not None:
            done.set_exception(outcome[1])
        else:
            done.set_result(outcome[0])
