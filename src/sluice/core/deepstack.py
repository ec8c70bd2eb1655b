"""Work that recurses deep in native code, run on threads with a deep stack.

llguidance compiles a grammar's nested rules (and a JSON schema's ``$ref``
chains) recursively, about 4 KiB of native stack a level: 2,000 nested
``$defs`` (a 126 kB schema) or 4,096 nested rules overflowed a thread's
default 8 MiB and crashed the process with a segfault (16 MiB were enough
for 4,096). :func:`run_deep` runs such work on threads of their own with
``STACK`` bytes of stack (address space, used only as needed).

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
THREADS = 2

_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_started = False
_lock = threading.Lock()


def run_deep(fn: Callable[[], T]) -> T:
    """``fn()`` on a deep-stack thread; its result, or its exception raised here."""
    global _started
    with _lock:
        if not _started:
            old = threading.stack_size(STACK)
            try:
                for i in range(THREADS):
                    name = f"sluice-deep-{i}"
                    threading.Thread(target=_loop, name=name, daemon=True).start()
            finally:
                threading.stack_size(old)
            _started = True
    done: Future[T] = Future()
    _jobs.put((fn, done))
    return done.result()


def _loop() -> None:
    while True:
        fn, done = _jobs.get()
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            done.set_exception(exc)
