"""Deep-stack threads: results and errors come back, the stack is deep, and a slow job
never holds up another."""

from __future__ import annotations

import sys
import threading

import pytest

from sluice.core import deepstack
from sluice.core.deepstack import run_deep


def test_results_and_errors_come_back() -> None:
    assert run_deep(lambda: 6 * 7) == 42
    with pytest.raises(ZeroDivisionError):
        run_deep(lambda: 1 // 0)


def test_the_stack_is_deep() -> None:
    def depth(n: int) -> int:
        return 0 if n == 0 else 1 + depth(n - 1)

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(200_000)
    try:
        # ~100k Python frames need far more than a default thread's 8 MiB of C stack.
        assert run_deep(lambda: depth(100_000)) == 100_000
    finally:
        sys.setrecursionlimit(old)


def test_slow_jobs_do_not_hold_up_the_next() -> None:
    release = threading.Event()
    started = threading.Semaphore(0)

    def slow() -> str:
        started.release()
        assert release.wait(10)
        return "slow"

    results: list[str] = []
    waiters = [threading.Thread(target=lambda: results.append(run_deep(slow))) for _ in "ab"]
    for waiter in waiters:
        waiter.start()
    for _ in waiters:
        assert started.acquire(timeout=5)
    try:
        done = threading.Event()
        quick = threading.Thread(
            target=lambda: (results.append(run_deep(lambda: "quick")), done.set())
        )
        quick.start()
        assert done.wait(5), "the quick job waited for the slow one"
    finally:
        release.set()
        for waiter in waiters:
            waiter.join(10)
    assert results == ["quick", "slow", "slow"]
    assert deepstack.threads() <= deepstack.MAX_THREADS


def test_jobs_one_after_another_reuse_a_thread() -> None:
    before = deepstack.threads()
    for i in range(50):
        assert run_deep(lambda: i) == i  # noqa: B023 - called at once
    assert deepstack.threads() <= max(before, 1)
