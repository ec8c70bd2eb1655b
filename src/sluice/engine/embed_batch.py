"""Concurrent embedding requests share decodes.

Each request's inputs queue up; whichever waiting thread finds the context free
takes as many queued inputs as fit one decode (first come first served, across
requests: ``max_tokens`` tokens and ``max_seqs`` sequences), decodes them with the
lock released, hands every request its vectors and lets the next one lead. Eight
requests of eight texts then cost one decode of 64 rather than eight of eight, as
llama.cpp's server batches its slots.

Example::

    batcher = EmbedBatcher(decode, max_tokens=4096, max_seqs=64)
    vectors = batcher.embed([[1, 2, 3], [4, 5]])  # from any number of threads
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from sluice.core.backend import Vector

Decode = Callable[[list[list[int]]], list[Vector]]


class _Job:
    __slots__ = ("done", "error", "inputs", "next", "results", "waiting")

    def __init__(self, inputs: Sequence[list[int]]) -> None:
        self.inputs = list(inputs)
        self.results: list[Vector | None] = [None] * len(self.inputs)
        self.next = 0  # the first input not taken into a decode yet
        self.waiting = len(self.inputs)  # inputs without a vector yet
        self.error: BaseException | None = None
        self.done = not self.inputs


class EmbedBatcher:
    def __init__(self, decode: Decode, *, max_tokens: int, max_seqs: int) -> None:
        self._decode = decode
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._busy = False
        self.decodes = 0  # decodes run (tests and logs)

    def embed(self, inputs: Sequence[list[int]]) -> list[Vector]:
        """One vector per input, in order (each input at most ``max_tokens`` tokens)."""
        job = _Job(inputs)
        with self._cond:
            if not job.done:
                self._queue.append(job)
            while not job.done:
                if self._busy:
                    self._cond.wait()
                    continue
                self._lead()
        if job.error is not None:
            raise job.error
        return [v for v in job.results if v is not None]

    def _lead(self) -> None:
        """Take a decode's worth of queued inputs, decode them unlocked, hand out."""
        taken = self._take()
        self._busy = True
        self._cond.release()
        error: BaseException | None = None
        vectors: list[Vector] = []
        try:
            vectors = self._decode([job.inputs[i] for job, i in taken])
            self.decodes += 1
        except Exception as exc:  # noqa: BLE001 - re-raised in every request of the decode
            error = exc
        finally:
            self._cond.acquire()
            self._busy = False
        for k, (job, i) in enumerate(taken):
            if error is not None:
                job.error = error
                job.done = True
                if job in self._queue:
                    self._queue.remove(job)
                continue
            job.results[i] = vectors[k]
            job.waiting -= 1
            if job.waiting == 0:
                job.done = True
        self._cond.notify_all()

    def _take(self) -> list[tuple[_Job, int]]:
        taken: list[tuple[_Job, int]] = []
        used = 0
        while self._queue and len(taken) < self.max_seqs:
            job = self._queue[0]
            size = len(job.inputs[job.next])
            if taken and used + size > self.max_tokens:
                break
            taken.append((job, job.next))
            used += size
            job.next += 1
            if job.next == len(job.inputs):
                self._queue.popleft()
        return taken
