"""EmbedBatcher: concurrent embedding requests share decodes, each gets its vectors in
order, limits hold, and a failed decode fails exactly the requests in it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sluice.engine.embed_batch import EmbedBatcher


class Recorder:
    def __init__(self, delay: float = 0.0, fail_on: int | None = None) -> None:
        self.groups: list[list[list[int]]] = []
        self.delay = delay
        self.fail_on = fail_on
        self.lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0

    def decode(self, group: list[list[int]]) -> list[list[float]]:
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            self.groups.append(group)
            time.sleep(self.delay)
            if self.fail_on is not None and any(self.fail_on in t for t in group):
                raise RuntimeError("decode failed")
            return [[float(sum(t)), float(len(t))] for t in group]
        finally:
            with self.lock:
                self.inside -= 1


def test_one_request_is_cut_into_decodes_by_tokens_and_sequences() -> None:
    rec = Recorder()
    batcher = EmbedBatcher(rec.decode, max_tokens=10, max_seqs=3)
    inputs = [[1, 2, 3], [4, 5, 6], [7], [8, 9, 10, 11, 12, 13, 14, 15], [16]]
    assert batcher.embed(inputs) == [[float(sum(t)), float(len(t))] for t in inputs]
    assert [len(g) for g in rec.groups] == [3, 2]  # 3 sequences, then 8 + 1 tokens
    assert all(sum(len(t) for t in g) <= 10 for g in rec.groups)
    assert batcher.embed([]) == []


def test_concurrent_requests_go_through_shared_decodes_one_at_a_time() -> None:
    rec = Recorder(delay=0.05)
    batcher = EmbedBatcher(rec.decode, max_tokens=1000, max_seqs=64)
    requests = [[[r, i] for i in range(5)] for r in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(batcher.embed, requests))
    for request, answer in zip(requests, answers, strict=True):
        assert answer == [[float(sum(t)), 2.0] for t in request]
    assert rec.most_inside == 1  # never two decodes at once on one context
    assert len(rec.groups) < 8 and sum(len(g) for g in rec.groups) == 40


def test_a_failed_decode_fails_its_requests_and_not_the_next() -> None:
    rec = Recorder(fail_on=99)
    batcher = EmbedBatcher(rec.decode, max_tokens=1000, max_seqs=64)
    with pytest.raises(RuntimeError, match="decode failed"):
        batcher.embed([[1], [99]])
    assert batcher.embed([[2, 3]]) == [[5.0, 2.0]]
