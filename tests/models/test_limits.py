"""Limits per key (models/limits.py), on a clock the test moves: the sliding minute,
tokens a minute, streams at once, budgets per period, the models list, the headers, and
how the config file's entries are checked."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sluice.config.file import ConfigError
from sluice.core.errors import BudgetSpent, RateLimited, TokensLimited, spec_for
from sluice.models.limits import (
    KeyLimits,
    Limiter,
    MemoryCounters,
    duration,
    parse_limits,
    period_end,
    period_start,
)
from sluice.server.auth import config_keys

T0 = datetime(2026, 11, 29, 23, 59, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock, spent: int = 0, **limits: Any) -> Limiter:
    async def read_spent(key: str, since: str | None) -> int:
        return spent

    return Limiter({"ci": KeyLimits(**limits)}, MemoryCounters(), read_spent, clock=clock)


async def admitted(lim: Limiter, dialect: str = "openai") -> Any:
    gate = lim.gate("ci", dialect)
    assert gate is not None
    await gate.admit()
    return gate


async def test_requests_a_minute_slide() -> None:
    clock = Clock()
    lim = limiter(clock, rpm=3)
    for i in range(3):
        gate = await admitted(lim)
        gate.release()
        assert gate.headers["x-ratelimit-remaining-requests"] == str(2 - i)
        clock.now += 10
    with pytest.raises(RateLimited) as refused:
        await admitted(lim)
    # The oldest (at T0) leaves the window at T0 + 60; it is now T0 + 30.
    assert refused.value.retry_after == pytest.approx(30)
    headers = refused.value.headers()
    assert headers["Retry-After"] == "30" and headers["retry-after-ms"] == "30000"
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert spec_for(refused.value).status == 429
    clock.now = T0 + 60.5  # the first has left: one more
    (await admitted(lim)).release()
    with pytest.raises(RateLimited):
        await admitted(lim)


async def test_a_request_is_counted_once_and_a_refused_one_not_at_all() -> None:
    clock = Clock()
    lim = limiter(clock, rpm=1)
    gate = await admitted(lim)
    await gate.admit()  # a second model call of the same request (a tool round)
    gate.release()
    with pytest.raises(RateLimited):
        await admitted(lim)
    clock.now += 61
    (await admitted(lim)).release()  # the refusal above took nothing


async def test_streams_at_once_are_held_until_released() -> None:
    lim = limiter(Clock(), max_streams=2)
    first, second = await admitted(lim), await admitted(lim)
    with pytest.raises(RateLimited) as refused:
        await admitted(lim)
    assert refused.value.retry_after == 1.0
    assert lim.streams("ci") == 2
    second.hold()  # a background run carries it on past its request
    second.release()
    with pytest.raises(RateLimited):
        await admitted(lim)
    second.release()
    third = await admitted(lim)
    first.release()
    third.release()
    assert lim.streams("ci") == 0


class SharedLeases:
    """A shared store's stream leases, as two instances see them (in memory)."""

    def __init__(self) -> None:
        self.held: dict[int, str] = {}
        self.next = 0

    async def take_stream(self, key: str, limit: int) -> int | None:
        if sum(1 for k in self.held.values() if k == key) >= limit:
            return None
        self.next += 1
        self.held[self.next] = key
        return self.next

    async def drop_stream(self, lease: int) -> None:
        del self.held[lease]


async def test_streams_at_once_hold_across_instances_on_a_shared_store() -> None:
    leases = SharedLeases()
    one, two = limiter(Clock(), max_streams=1), limiter(Clock(), max_streams=1)
    one.leases = two.leases = leases
    first = await admitted(one)
    with pytest.raises(RateLimited, match="across the sluice instances") as refused:
        await admitted(two)  # the other instance's stream holds the key's one
    assert refused.value.retry_after == 1.0 and two.streams("ci") == 0
    first.release()
    await one.settle()  # its lease dropped
    assert leases.held == {}
    second = await admitted(two)
    assert list(leases.held.values()) == ["ci"]
    second.release()
    await two.settle()
    assert leases.held == {}


async def test_tokens_a_minute() -> None:
    clock = Clock()
    lim = limiter(clock, tpm=100)
    gate = await admitted(lim)
    lim.charge("ci", 60)
    gate.release()
    clock.now += 20
    gate = await admitted(lim)  # 60 < 100: admitted; its own tokens count at its end
    assert gate.headers["x-ratelimit-remaining-tokens"] == "40"
    lim.charge("ci", 50)
    with pytest.raises(TokensLimited) as refused:
        await admitted(lim)
    assert spec_for(refused.value).type == "tokens"
    assert refused.value.retry_after == pytest.approx(40)  # the first 60 leave at T0 + 60
    clock.now = T0 + 60.5
    (await admitted(lim)).release()


async def test_a_spent_budget_blocks_until_its_period_ends() -> None:
    clock = Clock()  # 23:59:00 UTC
    lim = limiter(clock, spent=90, token_budget=100, budget_period="day")
    (await admitted(lim)).release()  # 90 spent (read from the ledger) < 100
    lim.charge("ci", 15)
    with pytest.raises(BudgetSpent) as refused:
        await admitted(lim)
    assert spec_for(refused.value).code == "insufficient_quota"
    assert refused.value.retry_after == pytest.approx(60)  # midnight
    assert "105 of 100" in refused.value.message
    clock.now += 61  # a new day: read again from the ledger, which says 90 again here
    (await admitted(lim)).release()


async def test_a_total_budget_never_resets() -> None:
    lim = limiter(Clock(), spent=5, token_budget=5)
    with pytest.raises(BudgetSpent) as refused:
        await admitted(lim)
    assert refused.value.retry_after is None
    assert "Retry-After" not in refused.value.headers()


async def test_anthropic_headers_and_none_for_other_dialects() -> None:
    clock = Clock()
    lim = limiter(clock, rpm=10, tpm=1000)
    gate = await admitted(lim, "anthropic")
    assert gate.headers["anthropic-ratelimit-requests-limit"] == "10"
    assert gate.headers["anthropic-ratelimit-requests-remaining"] == "9"
    assert gate.headers["anthropic-ratelimit-requests-reset"] == "2026-11-30T00:00:00Z"
    assert gate.headers["anthropic-ratelimit-tokens-remaining"] == "1000"
    assert (await admitted(lim, "ollama")).headers == {}


def test_models_a_key_may_use() -> None:
    assert KeyLimits().allows(["anything"])
    assert KeyLimits(models=frozenset({"qwen"})).allows(["other", "qwen"])
    assert not KeyLimits(models=frozenset({"qwen"})).allows(["other"])
    assert not KeyLimits() and KeyLimits(models=frozenset())


def test_periods() -> None:
    assert period_start("day", T0) == "2026-11-29"
    assert period_start("month", T0) == "2026-11-01"
    assert period_start("total", T0) is None
    assert period_end("day", T0) == datetime(2026, 11, 30, tzinfo=UTC).timestamp()
    assert period_end("month", T0) == datetime(2026, 12, 1, tzinfo=UTC).timestamp()
    december = datetime(2026, 12, 31, 12, tzinfo=UTC).timestamp()
    assert period_end("month", december) == datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert period_end("total", T0) is None


def test_durations_as_openai_writes_them() -> None:
    assert duration(0) == "0s"
    assert duration(0.25) == "250ms"
    assert duration(12.5) == "12.5s"
    assert duration(60) == "1m0s"
    assert duration(361) == "6m1s"


def test_the_config_entries(tmp_path: Path) -> None:
    table = {
        "ci": {
            "key": "sk-ci-key-0001",
            "rpm": 60,
            "tpm": 200000,
            "max_streams": 4,
            "token_budget": 2000000,
            "budget_period": "day",
            "models": ["qwen-coder"],
        },
        "plain": "sk-plain-0001",
    }
    entries = config_keys(tmp_path / "s.toml", table, {})
    assert entries["ci"].limits == KeyLimits(
        rpm=60,
        tpm=200000,
        max_streams=4,
        token_budget=2000000,
        budget_period="day",
        models=frozenset({"qwen-coder"}),
    )
    assert not entries["plain"].limits


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"rpm": 0}, "rpm must be a whole number of at least 1, not an integer (0)"),
        ({"tpm": 1.5}, "tpm must be a whole number of at least 1, not a number (1.5)"),
        ({"max_streams": True}, "not a boolean (True)"),
        ({"token_budget": 5, "budget_period": "week"}, "\"total\", not a string ('week')"),
        ({"budget_period": "day"}, "a budget_period but no token_budget"),
        ({"models": "qwen"}, "a list of model names"),
        ({"models": [""]}, "a list of model names"),
    ],
)
def test_bad_limits_are_named(entry: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_limits("s.toml [keys]", "ci", entry)
    assert words in str(error.value) and "'ci'" in str(error.value)


def test_an_unknown_field_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rpm, tpm, max_streams"):
        config_keys(tmp_path / "s.toml", {"ci": {"key": "sk-ci-key-0001", "rps": 3}}, {})
