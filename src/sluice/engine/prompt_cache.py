"""The prompt cache: KV states of recent prompts, kept in RAM after their slot is reused.

A slot's KV cache lasts only until another request takes the slot (or the
engine moves an active sequence over it, see ``Engine._compact``). Before
that (as soon as the engine is idle, else when the slot is taken), the engine
saves the sequence's state (``ModelRunner.save_seq``) here,
keyed by the tokens it holds; a later prompt that shares a long enough prefix
with an entry gets it restored into its slot (``ModelRunner.load_seq``) and
prefills only the rest. This is llama-server's ``--cache-ram``.

The engine thread uses it; the registry may :meth:`PromptCache.reclaim` bytes
from another thread to make room for a load (a lock guards the entries).
Entries are found by longest common prefix; the least recently used go first
when the cache would pass its own budget (``--cache-ram``) or the room left in
the server's memory budget (``room``: the bytes nobody holds, counted when a
state is kept), and an entry whose tokens are a prefix of a newer one is
dropped (the newer one serves every prompt the older one could).

Example::

    cache = PromptCache(budget_bytes=2048 << 20, min_tokens=64)
    if cache.wants(tokens):
        cache.put(tokens, runner.save_seq(seq))
    hit = cache.best(prompt)   # (entry, common prefix length) or None
    if hit is not None:
        cache.used(hit[0])
        runner.load_seq(seq, hit[0].state)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# Sequences shorter than this are not saved, and a restore must spare at least this
# many prompt tokens. Below it the prefill is short (64 tokens: ~0.2-0.4 s on a 2-core
# machine), while every entry costs a save on the engine thread (~15-25 ms per 1000
# tokens for SmolLM2-135M, 22.5 KiB per token) and makes each lookup, a scan of all
# entries, longer: many tiny entries (chat greetings) would cost more than they spare.
MIN_TOKENS = 64

# A restore copies the whole entry back, then trims it to the common prefix: it pays
# only if the prompt tokens it spares are worth the tokens it copies. Restoring is
# ~1000x cheaper per token than prefilling (SmolLM2-135M, 1 thread: ~4-8 ms vs ~6.5 s
# per 1000 tokens), so requiring 1 spared token per 16 copied keeps a wide margin.
RESTORE_RATIO = 16


@dataclass(slots=True)
class CacheEntry:
    key: int
    tokens: list[int]  # the tokens whose KV the state holds, positions 0..
    state: bytearray  # ModelRunner.save_seq's bytes


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists.

    Compares slices (C speed) in growing chunks, then halves the chunk that
    differs: ~8 us for two 2,500-token lists against ~60 us element by element
    in Python, which every admission paid per slot and per cache entry.
    """
    n = min(len(a), len(b))
    lo, hi, step = 0, 0, 32
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 16:  # a[:lo] == b[:lo], and they differ before hi
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


class PromptCache:
    """Saved sequence states within a byte budget, least recently used evicted first."""

    def __init__(self, budget_bytes: int, min_tokens: int = MIN_TOKENS) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self.min_tokens = max(1, min_tokens)
        # Bytes of the server's memory budget that nobody holds (this cache's states
        # included in what is held); None: only ``budget_bytes`` bounds the cache.
        self.room: Callable[[], int] | None = None
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self._ids = 0
        self.size_bytes = 0
        self.hits = 0  # entries chosen for a restore
        self.saves = 0
        self.reclaimed = 0  # bytes dropped to make room for a load or another model

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        """Oldest first (for tests and stats)."""
        with self._lock:
            return list(self._entries.values())

    def wants(self, tokens: list[int]) -> bool:
        """Whether saving a sequence holding ``tokens`` would add anything.

        Checked before the save, which is the costly part: too short, no room
        left in the memory budget, or already held by an entry that starts with
        these tokens, is not worth it.
        """
        if not self.enabled or len(tokens) < self.min_tokens or self._limit() <= 0:
            return False
        with self._lock:
            for key, entry in self._entries.items():
                if len(entry.tokens) >= len(tokens) and common_prefix(entry.tokens, tokens) == len(
                    tokens
                ):
                    self._entries.move_to_end(key)  # still wanted: keep it longer
                    return False
        return True

    def _limit(self) -> int:
        """The bytes the cache may hold now: its own budget, and no more than it holds
        plus the room left in the server's memory budget."""
        if self.room is None:
            return self.budget_bytes
        return min(self.budget_bytes, self.size_bytes + max(0, self.room()))

    def put(self, tokens: list[int], state: bytearray) -> None:
        """Keep ``state`` for ``tokens`` (a copy of the list is kept); evict to fit."""
        if not self.enabled or not tokens or not state:
            return
        tokens = list(tokens)
        with self._lock:  # (room() takes no lock of ours: no deadlock)
            limit = self._limit()  # before the state counts: the cache does not hold it yet
            if len(state) > limit:
                return
            for key in [
                k
                for k, e in self._entries.items()
                if len(e.tokens) <= len(tokens) and common_prefix(e.tokens, tokens) == len(e.tokens)
            ]:
                self._drop(key)
            self._ids += 1
            self._entries[self._ids] = CacheEntry(self._ids, tokens, state)
            self.size_bytes += len(state)
            self.saves += 1
            while self.size_bytes > limit:
                self._drop(next(iter(self._entries)))

    def best(self, prompt: list[int], *, whole: bool = False) -> tuple[CacheEntry, int] | None:
        """The entry sharing the longest prefix with ``prompt``, and that length.

        With ``whole``, only entries that are a prefix of ``prompt`` in full (for
        states that cannot be cut short after a restore). Ties go to the shorter
        entry (less to restore). Call :meth:`used` if it is restored.
        """
        found: tuple[CacheEntry, int] | None = None
        if not prompt:
            return None
        with self._lock:
            for entry in self._entries.values():
                if entry.tokens[0] != prompt[0]:  # most misses end here
                    continue
                n = common_prefix(entry.tokens, prompt)
                if whole and n < len(entry.tokens):
                    continue
                if (
                    found is None
                    or n > found[1]
                    or (n == found[1] and len(entry.tokens) < len(found[0].tokens))
                ):
                    found = (entry, n)
        return found

    def used(self, entry: CacheEntry) -> None:
        """An entry is being restored: it is now the most recently used."""
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
                self.hits += 1

    def discard(self, entry: CacheEntry) -> None:
        """Forget an entry (its state would not restore)."""
        with self._lock:
            if entry.key in self._entries:
                self._drop(entry.key)

    def reclaim(self, nbytes: int) -> int:
        """Drop the least recently used entries until ``nbytes`` are freed (or the cache
        is empty); the bytes freed. Safe from any thread (a restore under way keeps its
        state alive until it is done)."""
        freed = 0
        with self._lock:
            while freed < nbytes and self._entries:
                freed += self._drop(next(iter(self._entries)))
            self.reclaimed += freed
        return freed

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.size_bytes = 0

    def _drop(self, key: int) -> int:
        entry = self._entries.pop(key)
        self.size_bytes -= len(entry.state)
        return len(entry.state)
