"""The RAM prompt cache: a prompt's KV state outlives its slot.

Through the real app and engine on the scripted runner, whose saved state is
its per-sequence token history: a restore shows up as that history put back.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import httpx

from sluice.engine.prompt_cache import PromptCache, common_prefix
from tests.support.fakes import EOS, ScriptedRunner, chat_prompt
from tests.support.helpers import (
    CHAT,
    health,
    prompt_for,
    scripted_server,
    served,
    user,
    wait_until,
)

LONG = "tell me about " + " ".join(f"w{i}" for i in range(30))  # ~140 prompt tokens
SHARED = len("<|im_start|>user\n")  # what every single-message prompt shares


def tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


def chat(base: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(base + CHAT, json={"messages": messages, "temperature": 0}, timeout=20)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def next_turn() -> list[dict[str, str]]:
    return [*user(LONG), {"role": "assistant", "content": "Hello world!"}, *user("and more")]


def other(i: int) -> str:
    return f"other request {i}: " + "x" * 60


def fill_every_slot(base: str, runner: ScriptedRunner, n: int) -> None:
    """``n`` different prompts at once, so every slot takes one (LONG's cache is gone)."""
    threads = [threading.Thread(target=chat, args=(base, user(other(i)))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    starts = {seq: hist[: len(prompt_for(LONG))] for seq, hist in runner.history.items()}
    assert tokens(prompt_for(LONG)) not in starts.values(), "a slot still holds LONG"


def test_prompt_comes_back_from_ram_after_every_slot_was_reused() -> None:
    runner = ScriptedRunner(step_delay=0.005)
    with scripted_server(runner, parallel=2) as base:
        assert cached(chat(base, user(LONG))) == 0
        fill_every_slot(base, runner, 2)
        n_decodes = len(runner.decodes)
        body = chat(base, next_turn())
        first = len(prompt_for(LONG))
        # The whole first prompt came back: LONG's rendering, not just a shared preamble.
        assert cached(body) == first
        _, restored = runner.loads[-1]
        assert restored[:first] == tokens(prompt_for(LONG))
        # Only the rest of the prompt was decoded, from where the restored prefix ends
        # (on whichever seq compaction put it: it is the only active one).
        prefill = [e for d in runner.decodes[n_decodes:] for e in d]
        assert prefill[0].pos0 == first
        assert [t for e in prefill if len(e.tokens) > 1 for t in e.tokens] == tokens(
            chat_prompt(("user", LONG), ("assistant", "Hello world!"), ("user", "and more"))[first:]
        )
        stats = health(base)["models"]["scripted"]["prompt_cache"]
        assert stats["restores"] == 1 and stats["entries"] >= 1 and stats["bytes"] > 0


def test_same_prompt_again_reuses_all_but_its_last_token() -> None:
    runner = ScriptedRunner()
    with scripted_server(runner, parallel=1) as base:
        chat(base, user(LONG))
        chat(base, user(other(0)))  # takes the only slot
        body = chat(base, user(LONG))
        assert cached(body) == len(prompt_for(LONG)) - 1
        assert len(runner.loads) == 1


def test_a_state_that_cannot_be_cut_is_restored_only_whole() -> None:
    """Sliding-window models: a restored state is used only when all of it is a prefix."""
    runner = ScriptedRunner({prompt_for(LONG): [EOS]}, trim_after_restore=False)
    with scripted_server(runner, parallel=1) as base:
        chat(base, user(LONG))  # answers nothing: the slot holds exactly LONG's prompt
        chat(base, user(other(0)))
        # The same prompt again would need the state cut by a token: prefilled instead.
        assert cached(chat(base, user(LONG))) == SHARED
        assert runner.loads == []
        chat(base, user(other(1)))
        # A next turn starts with all of it.
        turn = [*user(LONG), {"role": "assistant", "content": ""}, *user("and more")]
        assert cached(chat(base, turn)) == len(prompt_for(LONG))
        assert [hist for _, hist in runner.loads] == [tokens(prompt_for(LONG))]


def test_compaction_saves_the_slot_it_overwrites() -> None:
    """A sequence moved onto a lower idle slot replaces that slot's cache: saved first."""
    long_script = [f"<{k}>".encode() for k in range(40)] + [EOS]
    runner = ScriptedRunner({prompt_for("busy"): long_script}, step_delay=0.03)
    head = tokens(prompt_for(LONG))[: SHARED + 4]
    with scripted_server(runner, parallel=2) as base:
        first = threading.Thread(target=chat, args=(base, user(LONG)))
        first.start()
        wait_until(lambda: any(h[: len(head)] == head for h in runner.history.values()) or None)
        busy = threading.Thread(target=chat, args=(base, user("busy")))
        busy.start()  # seq 1, while LONG still runs on seq 0
        first.join(20)
        assert wait_until(lambda: runner.moves or None) == [(1, 0)]  # "busy" onto LONG's seq
        saved = [hist for seq, hist in runner.saves if seq == 0]
        assert saved and saved[0][: len(prompt_for(LONG))] == tokens(prompt_for(LONG))
        busy.join(20)
        assert cached(chat(base, next_turn())) == len(prompt_for(LONG))


def test_a_restore_goes_to_the_lowest_idle_sequence() -> None:
    """Where compaction leaves it: restored elsewhere, the whole state would be copied over."""
    long_script = [f"<{k}>".encode() for k in range(40)] + [EOS]
    runner = ScriptedRunner({prompt_for("busy"): long_script}, step_delay=0.03)
    busy_prompt = tokens(prompt_for("busy"))
    with scripted_server(runner, parallel=2) as base:
        chat(base, user(LONG))  # seq 0
        busy = threading.Thread(target=chat, args=(base, user("busy")))
        busy.start()  # takes seq 0 (it shares the template's start with LONG): LONG saved
        wait_until(lambda: runner.history.get(0, [])[: len(busy_prompt)] == busy_prompt or None)
        chat(base, user("x"))  # seq 1, the shorter cache once "busy" is done
        busy.join(20)
        assert runner.moves == []
        assert cached(chat(base, next_turn())) == len(prompt_for(LONG))
        assert [seq for seq, _ in runner.loads] == [0]
        assert runner.moves == []


def test_least_recently_used_entries_go_past_the_budget() -> None:
    # 3 KiB per token: the 1 MiB budget holds two ~135-token prompts, not three.
    runner = ScriptedRunner(state_bytes_per_token=3072)
    prompts = [f"{name} " + name * 80 for name in "abcd"]
    with scripted_server(runner, parallel=1, cache_ram_mb=1) as base:
        for p in prompts:  # each one is saved as the engine goes idle after it
            chat(base, user(p))
        wait_until(lambda: len(runner.saves) == 4)
        saved = [hist[: len(prompt_for(p))] for p, (_, hist) in zip(prompts, runner.saves)]
        assert saved == [tokens(prompt_for(p)) for p in prompts]
        # a was the least recently used when c was saved: gone.
        assert cached(chat(base, user(prompts[0]))) == SHARED
        assert runner.loads == []
        # d is still there (a's save, once a was answered again, pushed out c instead).
        wait_until(lambda: len(runner.saves) == 5)
        assert cached(chat(base, user(prompts[3]))) == len(prompt_for(prompts[3])) - 1
        assert [hist[:5] for _, hist in runner.loads] == [tokens(prompt_for(prompts[3]))[:5]]
        assert cached(chat(base, user(prompts[2]))) == SHARED


def test_a_finished_slot_is_saved_while_the_engine_is_idle() -> None:
    """Not in front of the next request's prefill: that request's admission saves nothing."""
    runner = ScriptedRunner(state_bytes_per_token=64)
    with scripted_server(runner, parallel=1) as base:
        chat(base, user(LONG))
        wait_until(lambda: len(runner.saves) == 1)  # no request is waiting for it
        assert runner.saves[0][1][: len(prompt_for(LONG))] == tokens(prompt_for(LONG))
        chat(base, user("something else entirely"))
        assert cached(chat(base, next_turn())) == len(prompt_for(LONG))  # restored
        assert len(runner.loads) == 1


def test_nothing_saved_below_the_minimum() -> None:
    runner = ScriptedRunner()
    with scripted_server(runner, parallel=1) as base:
        for word in ["hi", "yo", "ok", "hi"]:  # ~50 prompt tokens + 3 generated < 64
            chat(base, user(word))
        assert runner.saves == []
        assert runner.loads == []


def test_zero_turns_it_off() -> None:
    runner = ScriptedRunner(step_delay=0.005)
    with scripted_server(runner, parallel=2, cache_ram_mb=0) as base:
        chat(base, user(LONG))
        fill_every_slot(base, runner, 2)
        body = chat(base, next_turn())
        assert cached(body) == SHARED  # only what an idle slot still shares
        assert runner.saves == [] and runner.loads == []


# -- the cache on its own -----------------------------------------------------------------


def test_lookup_is_by_longest_common_prefix() -> None:
    cache = PromptCache(budget_bytes=1 << 20, min_tokens=2)
    cache.put([1, 2, 3, 4], bytearray(b"a"))
    cache.put([1, 2, 9, 9, 9], bytearray(b"b"))
    hit = cache.best([1, 2, 3, 7])
    assert hit is not None and hit[0].tokens == [1, 2, 3, 4] and hit[1] == 3
    assert cache.best([5, 1]) is None


def test_an_entry_that_is_a_prefix_of_a_newer_one_is_dropped() -> None:
    cache = PromptCache(budget_bytes=1 << 20, min_tokens=2)
    cache.put([1, 2, 3], bytearray(b"abc"))
    assert not cache.wants([1, 2])  # held by [1, 2, 3] already: no save needed
    cache.put([1, 2, 3, 4, 5], bytearray(b"abcde"))
    assert [e.tokens for e in cache.entries()] == [[1, 2, 3, 4, 5]]
    assert cache.size_bytes == 5


def test_used_entries_are_evicted_last() -> None:
    cache = PromptCache(budget_bytes=10, min_tokens=1)
    cache.put([1], bytearray(4))
    cache.put([2], bytearray(4))
    hit = cache.best([1])
    assert hit is not None
    cache.used(hit[0])
    cache.put([3], bytearray(4))  # 12 bytes > 10: the least recently used, [2], goes
    assert [e.tokens for e in cache.entries()] == [[1], [3]]
    cache.put([4], bytearray(11))  # larger than the whole budget: not kept
    assert len(cache) == 2
    assert not PromptCache(budget_bytes=0).wants(list(range(100)))


def test_common_prefix_finds_the_first_difference_anywhere() -> None:
    base = list(range(1000, 4000))
    for at in [0, 1, 15, 16, 17, 31, 32, 33, 95, 96, 97, 500, 2047, 2999]:
        other = [*base[:at], -1, *base[at + 1 :]]
        assert common_prefix(base, other) == at
        assert common_prefix(other, base) == at
        assert common_prefix(base, base[:at]) == at
    assert common_prefix(base, list(base)) == len(base)
    assert common_prefix([], base) == 0
    rng = random.Random(7)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(300))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n


def test_the_cache_grows_only_into_the_memory_budget_left() -> None:
    cache = PromptCache(budget_bytes=100, min_tokens=1)
    free = [10]  # what no model holds; the states kept count as held
    cache.room = lambda: free[0]
    cache.put([1], bytearray(6))
    free[0] -= 6
    cache.put([2], bytearray(6))  # 12 > 6 held + 4 free: the older state goes
    assert [e.tokens for e in cache.entries()] == [[2]] and cache.size_bytes == 6
    cache.put([3], bytearray(11))  # more than it holds plus the room left: not kept
    assert [e.tokens for e in cache.entries()] == [[2]]
    free[0] = 0
    assert cache.wants([4])  # it may still replace what it holds
    cache.clear()
    assert not cache.wants([4])  # nothing held and no room: not worth a save


def test_reclaim_drops_least_recently_used_states_from_any_thread() -> None:
    cache = PromptCache(budget_bytes=100, min_tokens=1)
    for t in range(1, 5):
        cache.put([t], bytearray(10))
    hit = cache.best([1])
    assert hit is not None
    cache.used(hit[0])  # [1] is now the most recently used
    freed: list[int] = []
    thread = threading.Thread(target=lambda: freed.append(cache.reclaim(15)))
    thread.start()
    thread.join(5)
    assert freed == [20] and cache.reclaimed == 20
    assert [e.tokens for e in cache.entries()] == [[4], [1]] and cache.size_bytes == 20
    assert cache.reclaim(1000) == 20 and len(cache) == 0


def test_saved_states_stay_within_the_memory_budget() -> None:
    """--memory-budget-mb bounds the prompt cache below its own --cache-ram."""
    runner = ScriptedRunner(state_bytes_per_token=3072)  # ~135 tokens: ~0.4 MiB a state
    prompts = [f"{name} " + name * 80 for name in "abcd"]
    with served(runner, parallel=1, cache_ram_mb=2048, memory_budget_mb=1) as (base, engine):
        for p in prompts:
            chat(base, user(p))
        wait_until(lambda: len(runner.saves) == 4)
        assert 0 < engine.prompt_cache.size_bytes <= 1 << 20
        assert len(engine.prompt_cache) == 2  # the oldest two went
        stats = health(base)["models"]["scripted"]["prompt_cache"]
        assert stats["bytes"] == engine.prompt_cache.size_bytes
