"""The usage ledger and the limits' counters, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest

from sluice.core.errors import InvalidRequest
from sluice.store import UsageRow
from tests.store.conftest import Backend, Store


async def test_usage_upserts_add_up_and_filter(store: Store, backend: Backend) -> None:
    await store.add_usage(
        [
            UsageRow("ci", "qwen", "2026-05-01", requests=1, prompt_tokens=10, completion_tokens=5),
            UsageRow("ci", "qwen", "2026-05-01", requests=1, prompt_tokens=7, errors=1),
            UsageRow("alice", "smol", "2026-05-02", requests=2, cached_tokens=3),
        ]
    )
    await store.add_usage([UsageRow("ci", "qwen", "2026-05-01", requests=1, cached_tokens=4)])
    await store.add_usage([UsageRow("ci", "smol", "2026-05-03", requests=1)])
    await store.add_usage([UsageRow("alice", "qwen", "2026-05-02", completion_tokens=9)])
    await store.add_usage([])

    everything = await store.usage()
    assert everything == [
        UsageRow("ci", "qwen", "2026-05-01", 3, 17, 4, 5, 1),
        UsageRow("alice", "qwen", "2026-05-02", 0, 0, 0, 9, 0),
        UsageRow("alice", "smol", "2026-05-02", 2, 0, 3, 0, 0),
        UsageRow("ci", "smol", "2026-05-03", 1, 0, 0, 0, 0),
    ]
    assert await store.usage(key="ci") == [everything[0], everything[3]]
    assert await store.usage(key="nobody") == []
    assert await store.usage(since="2026-05-02") == everything[1:]
    assert await store.usage(until="2026-05-02") == everything[:3]
    assert await store.usage(key="alice", since="2026-05-02", until="2026-05-02") == [
        everything[1],
        everything[2],
    ]
    with pytest.raises(InvalidRequest):
        await store.usage(since="May 1st")
    with pytest.raises(ValueError):
        await store.add_usage([UsageRow("ci", "qwen", "2026-5-1", requests=1)])
    with pytest.raises(ValueError):
        await store.add_usage([UsageRow("ci", "qwen", "2026-05-01", requests=-1)])

    await store.close()
    async with await backend.open() as reopened:  # it survives a restart
        assert await reopened.usage() == everything


async def test_a_usage_write_whose_caller_left_still_happens(store: Store) -> None:
    task = asyncio.ensure_future(store.add_usage([UsageRow("k", "m", "2026-01-01", requests=1)]))
    await asyncio.sleep(0)  # called: the write is on its way
    task.cancel()
    await store.close()  # waits for it
    assert task.cancelled()


async def test_the_cancelled_write_is_stored(backend: Backend) -> None:
    store = await backend.open()
    task = asyncio.ensure_future(store.add_usage([UsageRow("k", "m", "2026-01-01", requests=1)]))
    await asyncio.sleep(0)
    task.cancel()
    await store.close()
    async with await backend.open() as reopened:
        assert await reopened.usage() == [UsageRow("k", "m", "2026-01-01", requests=1)]


async def test_take_request_holds_the_limit_and_says_when(store: Store) -> None:
    for t in (100.0, 101.0, 102.0):
        assert await store.take_request("ci", limit=3, window=60.0, now=t) == 0.0
    # full: the oldest (100) leaves the window (now - 60, now] at 160
    assert await store.take_request("ci", limit=3, window=60.0, now=103.0) == pytest.approx(57.0)
    assert await store.take_request("ci", limit=3, window=60.0, now=159.5) == pytest.approx(0.5)
    # another key has its own count
    assert await store.take_request("other", limit=3, window=60.0, now=103.0) == 0.0
    # at 160 the request of 100 is out: one more fits, then full until 161
    assert await store.take_request("ci", limit=3, window=60.0, now=160.0) == 0.0
    assert await store.take_request("ci", limit=3, window=60.0, now=160.0) == pytest.approx(1.0)
    # a refused request is not counted: still full, still the same wait
    assert await store.take_request("ci", limit=3, window=60.0, now=160.5) == pytest.approx(0.5)
    # a limit lowered under what was taken (101, 102, 160): two must leave, 102 at 162
    assert await store.take_request("ci", limit=2, window=60.0, now=160.5) == pytest.approx(1.5)
    # a limit of 0 admits nothing, ever
    assert await store.take_request("zero", limit=0, window=60.0, now=1.0) == 60.0
    with pytest.raises(ValueError):
        await store.take_request("ci", limit=3, window=7200.0, now=1.0)


async def test_concurrent_takers_never_exceed_the_limit(store: Store) -> None:
    results = await asyncio.gather(
        *(store.take_request("ci", limit=10, window=60.0, now=1000.0) for _ in range(12))
    )
    assert sorted(results)[:10] == [0.0] * 10
    assert all(r == pytest.approx(60.0) for r in sorted(results)[10:])


async def test_tokens_add_up_within_the_window(store: Store) -> None:
    assert await store.tokens_since("ci", 0.0) == (0, None)
    await store.add_tokens("ci", 100, 10.0)
    await store.add_tokens("ci", 50, 20.0)
    await store.add_tokens("other", 7, 15.0)
    assert await store.tokens_since("ci", 0.0) == (150, 10.0)
    assert await store.tokens_since("ci", 10.0) == (50, 20.0)  # after `since` only
    assert await store.tokens_since("ci", 20.0) == (0, None)
    assert await store.tokens_since("other", 0.0) == (7, 15.0)


async def test_old_counters_are_pruned(store: Store, backend: Backend) -> None:
    await store.take_request("ci", limit=5, window=60.0, now=10.0)
    await store.add_tokens("ci", 5, 10.0)
    await store.take_request("ci", limit=5, window=60.0, now=20.0)
    # an hour and more later the next call prunes what is older than an hour
    await store.take_request("ci", limit=5, window=60.0, now=3615.0)
    await store.add_tokens("ci", 5, 3615.0)
    assert backend.query("SELECT at FROM rate_requests ORDER BY at") == [(20.0,), (3615.0,)]
    assert backend.query("SELECT at FROM rate_tokens ORDER BY at") == [(3615.0,)]
