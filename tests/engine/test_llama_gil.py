"""The engine thread's short llama.cpp calls keep the GIL (llama_runner._GIL_HELD).

Released, a call hands the GIL to any thread that runs Python meanwhile (the event
loop, the workers preparing requests) and gets it back only after the 5 ms switch
interval: a prompt-cache save took ~10 ms instead of ~0.2 beside one busy thread.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import pytest

from sluice.engine.runner import BatchEntry
from tests.support.llama import real_runner


@pytest.mark.perf  # a median save under 2.5 ms (half the switch interval)
def test_a_state_save_beside_a_busy_python_thread_is_not_held_to_the_switch_interval() -> None:
    with real_runner(n_ctx=512) as runner:
        tokens = runner.tokenize("The quick brown fox. " * 30, add_special=True)[:170]
        runner.decode([BatchEntry(0, tokens, 0, True)])
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                sum(range(100))

        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        try:
            times = []
            for _ in range(15):
                started = time.perf_counter()
                state = runner.save_seq(0)
                times.append(time.perf_counter() - started)
                assert len(state) > 1 << 20  # 170 tokens of KV: a few MiB
        finally:
            stop.set()
            thread.join()
        # Releasing the GIL twice per save (size, then data) costs ~2 switch intervals.
        assert statistics.median(times) < sys.getswitchinterval() / 2, times
        assert runner.load_seq(1, state) == len(tokens)  # and the state is whole
