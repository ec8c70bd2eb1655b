"""Cache affinity: the conversation key of each API's bodies, and HRW with bounded loads."""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.upstream.affinity import (
    DEFAULT_LOAD_FACTOR,
    Affinity,
    Candidate,
    affinity_key,
    key_of,
)

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def up(*outstanding: int, down: tuple[int, ...] = ()) -> list[Candidate]:
    return [Candidate(u, i not in down, o) for i, (u, o) in enumerate(zip(URLS, outstanding))]


# -- the key: one conversation's turns --------------------------------------------------


def grow(body: dict[str, Any], field: str, turns: list[Any]) -> dict[str, Any]:
    """``body`` with ``turns`` appended to its list ``field`` (a later turn's request)."""
    later = copy.deepcopy(body)
    later[field] = [*later[field], *turns]
    return later


def chat(first: str, model: str = "m1", system: str = "be brief") -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": first},
        ],
    }


def later_chat_turns(n: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for i in range(n):
        turns.append({"role": "assistant", "content": f"answer {i}", "tool_calls": None})
        turns.append({"role": "user", "content": [{"type": "text", "text": f"question {i}"}]})
    return turns


def test_openai_chat_turn_5_has_turn_1s_key() -> None:
    turn1 = chat("hello there")
    turn5 = grow(turn1, "messages", later_chat_turns(4))
    turn5["temperature"] = 0.2  # sampling parameters are not the conversation
    key = affinity_key(turn1)
    assert key is not None and key.startswith("p:")
    assert affinity_key(turn5) == key


def test_conversations_differing_only_in_the_first_user_message_differ() -> None:
    keys = {affinity_key(chat(first)) for first in ("hello", "hello!", "Hello", "")}
    assert len(keys) == 4
    # ... and the model or the system prompt alone set them apart too.
    assert affinity_key(chat("hello", model="m2")) != affinity_key(chat("hello"))
    assert affinity_key(chat("hello", system="be long")) != affinity_key(chat("hello"))


def test_anthropic_messages_ignore_moving_cache_control() -> None:
    system: list[dict[str, Any]] = [
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "x"}}
    ]
    turn1: dict[str, Any] = {
        "model": "claude",
        "system": system,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "fix it", "cache_control": {"type": "x"}}],
            }
        ],
    }
    turn5 = copy.deepcopy(turn1)
    del turn5["messages"][0]["content"][0]["cache_control"]  # the marker moved on
    turn5["messages"] += [
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
        {"role": "user", "content": [{"type": "text", "text": "thanks", "cache_control": {}}]},
    ]
    assert affinity_key(turn1) == affinity_key(turn5) is not None
    other = copy.deepcopy(turn1)
    other["system"][0]["text"] = "You are someone else."
    assert affinity_key(other) != affinity_key(turn1)


def test_responses_input_string_and_list_and_instructions() -> None:
    turn1 = {"model": "m", "instructions": "be brief", "input": "hi"}
    turn2 = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
    }
    assert affinity_key(turn1) == affinity_key(turn2) is not None
    assert affinity_key({**turn1, "instructions": "be long"}) != affinity_key(turn1)
    # A transcript in one string: its head stands for the conversation.
    head = "x" * 4096
    assert affinity_key({"input": head + "turn 1"}) == affinity_key({"input": head + "turn 2"})


def test_gemini_contents_up_to_the_first_user_turn() -> None:
    turn1 = {
        "systemInstruction": {"parts": [{"text": "be brief"}]},
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
    }
    turn3 = grow(
        turn1,
        "contents",
        [
            {"role": "model", "parts": [{"text": "hello"}]},
            {"role": "user", "parts": [{"text": "?"}]},
        ],
    )
    assert affinity_key(turn1) == affinity_key(turn3) is not None
    snake = {"system_instruction": turn1["systemInstruction"], "contents": turn1["contents"]}
    assert affinity_key(snake) == affinity_key(turn1)
    other = {**turn1, "contents": [{"role": "user", "parts": [{"text": "bye"}]}]}
    assert affinity_key(other) != affinity_key(turn1)


def test_completions_prompt_head() -> None:
    head = "system: be brief\n" + "y" * 5000
    key = affinity_key({"model": "m", "prompt": head + "\nuser: 1"})
    assert key is not None
    assert (
        affinity_key({"model": "m", "prompt": head + "\nuser: 1\nassistant: ...\nuser: 2"}) == key
    )
    assert affinity_key({"model": "m", "prompt": [head + "\nuser: 3", "other"]}) == key
    assert affinity_key({"model": "m", "prompt": "short"}) != key
    tokens = affinity_key({"model": "m", "prompt": [1, 2, 3]})
    assert tokens is not None and tokens == affinity_key({"model": "m", "prompt": [[1, 2, 3]]})
    assert tokens != affinity_key({"model": "m", "prompt": [1, 2, 4]})


def test_long_first_messages_are_told_apart_by_their_ends() -> None:
    doc = "lorem ipsum " * 5000
    assert affinity_key(chat(doc + "A")) != affinity_key(chat(doc + "B"))
    assert affinity_key(chat("A" + doc)) != affinity_key(chat("B" + doc))


# -- the key: explicit sessions ---------------------------------------------------------


@pytest.mark.parametrize(
    "header", ["x-session-id", "x-session-affinity", "session_id", "session-id"]
)
def test_session_headers_name_the_conversation(header: str) -> None:
    a = affinity_key(chat("one"), {header: "sess-1"})
    b = affinity_key(chat("two"), {header: "sess-1"})
    assert a == b == "s:" + key_of("sess-1")
    assert affinity_key(chat("one"), {header: "sess-2"}) != a


def test_session_precedence() -> None:
    body = {**chat("hi"), "prompt_cache_key": "pck", "metadata": {"user_id": "uid"}}
    assert affinity_key(body, {"x-session-id": "h1", "session_id": "h2"}) == "s:" + key_of("h1")
    assert affinity_key(body, {"session_id": "h2"}) == "s:" + key_of("h2")
    assert affinity_key(body, {"x-other": "h3"}) == "s:" + key_of("pck")
    assert affinity_key(body, {"x-session-id": "  "}) == "s:" + key_of("pck")  # blank: none
    del body["prompt_cache_key"]
    assert affinity_key(body) == "s:" + key_of("uid")
    body["metadata"] = {"user_id": 7}  # not a session id: the prompt decides
    assert affinity_key(body) == affinity_key(chat("hi"))


def test_key_of_is_stable_across_processes() -> None:
    # A fixed value: Python's randomized hash() would differ from run to run.
    assert key_of("hello") == "2cf24dba5fb0a30e"
    assert len(key_of("\ud800 lone surrogate")) == 16


# -- the key: nothing to go by, garbage --------------------------------------------------


DEEP: list[Any] = []
for _ in range(100):
    DEEP = [DEEP]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model": "m"},
        {"model": "m", "messages": []},
        {"prompt": ""},
        {"input": None},
        {"contents": []},
        {"messages": "hello"},
        {"messages": [1]},
        {"messages": [{"role": 5, "content": "x"}]},
        {"messages": [{"role": "user", "content": object()}]},
        {"messages": [{"role": "user", "content": {1: "a", "b": 2}}]},
        {"contents": {"role": "user"}},
        {"input": 5},
        {"prompt": [1, "a"]},
        {"prompt": [2**70]},
        {"prompt": {}},
        {"messages": [{"role": "user", "content": DEEP}]},
    ],
)
def test_no_key(body: dict[str, Any]) -> None:
    assert affinity_key(body) is None


def test_not_a_mapping_gives_none() -> None:
    assert affinity_key([1, 2], None) is None  # type: ignore[arg-type]
    assert affinity_key("x", {"x-session-id": 3}) is None  # type: ignore[arg-type,dict-item]


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.builds(object),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = st.sampled_from(
    [
        "messages",
        "system",
        "input",
        "instructions",
        "contents",
        "systemInstruction",
        "prompt",
        "model",
        "metadata",
        "prompt_cache_key",
    ]
)
MESSAGE = st.fixed_dictionaries({}, optional={"role": JSON, "content": JSON, "parts": JSON})


@settings(max_examples=150, deadline=None)
@given(
    body=st.dictionaries(FIELDS, JSON | st.lists(MESSAGE, max_size=3), max_size=4),
    headers=st.none() | st.dictionaries(st.text(max_size=12), JSON, max_size=3),
)
def test_garbage_never_raises(body: dict[str, Any], headers: Any) -> None:
    key = affinity_key(body, headers)
    assert key is None or (key[:2] in ("s:", "p:") and len(key) == 18)


# -- the choice ---------------------------------------------------------------------------


def test_unkeyed_takes_the_least_busy_in_input_order_on_ties() -> None:
    a = Affinity()
    assert a.order(None, up(2, 1, 1)) == [1, 2, 0]
    assert a.order(None, up(0, 0, 0)) == [0, 1, 2]
    assert a.order(None, up(0, 5, 1, down=(0,))) == [2, 1]
    assert a.stats()["unkeyed"] == 3


def test_hrw_is_deterministic() -> None:
    # Fixed values: every gateway process places a new conversation alike.
    assert Affinity().order("p:0123456789abcdef", up(0, 0, 0)) == [2, 1, 0]
    keys = [key_of(str(i)) for i in range(50)]
    a, b = Affinity(), Affinity()
    assert [a.order(k, up(0, 0, 0)) for k in keys] == [b.order(k, up(0, 0, 0)) for k in keys]
    # A replica's rank does not depend on where it sits in the list.
    for k in keys:
        forward = [URLS[i] for i in a.order(k, up(0, 0, 0))]
        rev = list(reversed(up(0, 0, 0)))
        assert [rev[i].url for i in a.order(k, rev)] == forward


def test_hrw_spreads_keys_evenly() -> None:
    a = Affinity()
    firsts = Counter(a.order(key_of(f"conversation {i}"), up(0, 0, 0))[0] for i in range(3000))
    assert sorted(firsts) == [0, 1, 2]
    assert all(900 <= n <= 1100 for n in firsts.values()), firsts
    assert a.stats()["hashed"] == 3000


def test_removing_a_replica_moves_only_its_keys() -> None:
    a = Affinity()
    keys = [key_of(f"k{i}") for i in range(300)]
    before = {k: a.order(k, up(0, 0, 0))[0] for k in keys}
    after = {k: a.order(k, up(0, 0, 0, down=(1,)))[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != 1)


def test_pinned_key_stays_moves_and_follows_remember() -> None:
    a = Affinity()
    key = "s:abc"
    hrw = a.order(key, up(0, 0, 0))
    assert a.stats()["hashed"] == 1
    pin = next(i for i in range(3) if i != hrw[0])  # not where HRW would put it
    a.remember(key, URLS[pin])
    assert a.pinned(key) == URLS[pin]

    # Within the bound (3 replicas, 5 outstanding: ceil(1.1 * 6 / 3) = 3): stays.
    # Even though HRW's first choice is less busy.
    load = [2, 2, 2]
    load[hrw[0]] = 1
    assert a.order(key, up(*load))[0] == pin
    assert a.stats()["pinned"] == 1

    # Over the bound (pinned at 3 of 5): moves to the first HRW choice within it.
    load = [1, 1, 1]
    load[pin] = 3
    order = a.order(key, up(*load))
    assert order[0] != pin and sorted(order) == [0, 1, 2]
    # Down: moves, and never offers the down replica.
    order = a.order(key, up(0, 0, 0, down=(pin,)))
    assert pin not in order and order == [i for i in hrw if i != pin]
    assert a.stats()["moved"] == 2

    # The caller remembers who answered: the key is pinned there now, and stays even
    # when its old replica is back and idle.
    a.remember(key, URLS[order[0]])
    assert a.order(key, up(0, 0, 0))[0] == order[0]
    assert a.stats() == {"pinned": 2, "hashed": 1, "moved": 2, "unkeyed": 0}


def test_a_pin_to_a_replica_no_longer_listed_moves() -> None:
    a = Affinity()
    a.remember("k", "http://gone:1")
    assert a.order("k", up(0, 0, 0)) == Affinity().order("k", up(0, 0, 0))
    assert a.stats()["moved"] == 1


def place(affinity: Affinity, keys: list[str]) -> list[int]:
    """Place each key while all earlier requests are still outstanding; the load."""
    load = [0, 0, 0]
    for key in keys:
        load[affinity.order(key, up(*load))[0]] += 1
    return load


def test_30_concurrent_conversations_are_balanced() -> None:
    load = place(Affinity(), [key_of(f"conversation {i}") for i in range(30)])
    assert sum(load) == 30 and all(8 <= n <= 12 for n in load), load


def hrw_favours_0_then_1(n: int) -> list[str]:
    probe, keys, i = Affinity(), list[str](), 0
    while len(keys) < n:
        key = key_of(f"c{i}")
        i += 1
        if probe.order(key, up(0, 0, 0))[:2] == [0, 1]:
            keys.append(key)
    return keys


def test_30_conversations_are_balanced_whatever_the_hashes() -> None:
    """Why the default is 1.1: the worst case keeps every replica within +-20 %."""
    keys = hrw_favours_0_then_1(30)
    load = place(Affinity(), keys)
    assert all(8 <= n <= 12 for n in load), load
    assert max(load) == 11  # ceil(1.1 * 30 / 3)
    assert max(place(Affinity(load_factor=1.25), keys)) == 13  # what 1.25 would allow
    assert DEFAULT_LOAD_FACTOR == 1.1


def test_pinned_keys_keep_their_replica_under_even_load() -> None:
    a = Affinity()
    keys = [key_of(f"conversation {i}") for i in range(30)]
    load = [0, 0, 0]
    home = {}
    for key in keys:
        i = a.order(key, up(*load))[0]
        load[i] += 1
        a.remember(key, URLS[i])
        home[key] = i
    # The next turn of each, one at a time (the others' requests done): every one home.
    assert all(a.order(k, up(0, 0, 0))[0] == home[k] for k in keys)
    assert a.stats()["pinned"] == 30


CANDIDATES = st.lists(
    st.builds(Candidate, st.sampled_from(URLS + ["http://x:1"]), st.booleans(), st.integers(0, 50)),
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(
    key=st.none() | st.text(max_size=10),
    replicas=CANDIDATES,
    pin=st.none() | st.sampled_from(URLS),
    load_factor=st.floats(1.0, 3.0),
)
def test_order_offers_every_usable_replica_once_and_no_other(
    key: str | None, replicas: list[Candidate], pin: str | None, load_factor: float
) -> None:
    a = Affinity(load_factor=load_factor)
    if key is not None and pin is not None:
        a.remember(key, pin)
    order = a.order(key, replicas)
    assert sorted(order) == [i for i, r in enumerate(replicas) if r.usable]
    if order and key is not None:
        usable = [r for r in replicas if r.usable]
        total = sum(r.outstanding for r in usable)
        bound = math.ceil(load_factor * (total + 1) / len(usable))
        assert replicas[order[0]].outstanding + 1 <= bound


def test_no_usable_replica_gives_an_empty_order() -> None:
    assert Affinity().order("k", up(0, 0, down=(0, 1))) == []
    assert Affinity().order(None, []) == []


def test_alias_finds_the_conversation() -> None:
    a = Affinity()
    a.remember("conv", URLS[2])
    a.alias("resp_1", "conv")
    assert a.pinned("resp_1") == URLS[2]
    assert a.order("resp_1", up(0, 0, 0))[0] == 2
    a.alias("resp_2", "resp_1")  # the next response of the same conversation
    a.remember("resp_2", URLS[0])  # answered elsewhere: the conversation moves
    assert a.pinned("conv") == a.pinned("resp_1") == a.pinned("resp_2") == URLS[0]
    # An aliased key is placed like its conversation, pinned or not.
    b = Affinity()
    b.alias("resp_9", "conv")
    assert b.order("resp_9", up(0, 0, 0)) == b.order("conv", up(0, 0, 0))


def test_table_is_a_bounded_lru() -> None:
    a = Affinity(table_size=2)
    a.remember("a", URLS[0])
    a.remember("b", URLS[1])
    a.order("a", up(0, 0, 0))  # a used: b is the oldest now
    a.remember("c", URLS[2])
    assert (a.pinned("a"), a.pinned("b"), a.pinned("c")) == (URLS[0], None, URLS[2])
    for i in range(5):
        a.alias(f"r{i}", "a")
    assert a.pinned("r4") == URLS[0] and a.pinned("r0") is None


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Affinity(load_factor=0.9)
    with pytest.raises(ValueError):
        Affinity(table_size=-1)
