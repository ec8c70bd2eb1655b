"""The per-slot figures: :class:`Metrics`, :class:`SlotMetrics`, :class:`RequestMeter`,
and their Prometheus collector (see the package's docstring for the decisions)."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SlotKind = Literal["local", "upstream"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_SAMPLES = 4096  # bounds the TTFT window's memory under a flood of short requests
# generate_latest writes the classic text format (names escaped to underscores), which
# every scraper reads as 0.0.4; newer clients label it 1.0.0, which older scrapers don't know.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKET = 1.0  # seconds per tok/s bucket; also the smallest span a rate is divided by


class Metrics:
    """The app's metrics: one per app, with its own Prometheus registry.

    Example::

        metrics = Metrics(window=10.0)
        meter = metrics.slot("llama3", "upstream").request()
        meter.first_token(); meter.tokens(1); meter.finish(prompt_tokens=12)
        metrics.snapshot()        # {"llama3": {"kind": "upstream", ...}}
        body, ctype = metrics.render()
    """

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self.window = window
        self._clock = clock
        self.clock = clock  # what the meters' times are read on
        self._slots: dict[str, SlotMetrics] = {}
        self.registry = CollectorRegistry()
        self._ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "Time from admission to the first content, reasoning or tool-call token.",
            ["slot"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._duration = Histogram(
            "sluice_request_duration_seconds",
            "Time from admission to the end of the response (any outcome).",
            ["slot"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        # Each loaded local model's fewer-steps counters (drafted, accepted, forced tokens),
        # read at scrape time; the server sets it (server/state.py).
        self.decoding: Callable[[], Mapping[str, tuple[int, int, int]]] = dict
        self.registry.register(_SlotCollector(self._slots))
        self.registry.register(_DecodingCollector(lambda: self.decoding()))
        # Each upstream slot's cache affinity: (choices by kind, conversations pinned).
        self.affinity: Callable[[], Mapping[str, tuple[Mapping[str, int], int]]] = dict
        self.registry.register(_AffinityCollector(lambda: self.affinity()))
        self._key_counters: dict[str, Any] = {}
        # Who a request is for (its API key's name), read when its meter starts, and who
        # hears of each request's end: (key, model, prompt, cached, completion, error).
        # The server sets both (the usage ledger, models/usage.py).
        self.caller: Callable[[], str] = str
        self.on_end: Callable[[str, str, int, int, int, bool], None] | None = None
        self._by_key = Counter(
            "sluice_requests_by_key",
            "Requests that passed the API key check, by the key's name.",
            ["key"],
            registry=self.registry,
        )

    def count_key(self, name: str) -> None:
        """One request authenticated with the key named ``name`` (server/auth.py)."""
        child = self._key_counters.get(name)
        if child is None:  # (labels() takes a lock and builds a key: once per key)
            child = self._key_counters[name] = self._by_key.labels(key=name)
        child.inc()

    def slot(self, name: str, kind: SlotKind) -> SlotMetrics:
        """The slot's metrics, created on first use (a later ``kind`` wins: a slot
        that moved from local to upstream in the configuration keeps its history)."""
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = SlotMetrics(
                name,
                kind,
                window=self.window,
                clock=self._clock,
                ttft=self._ttft.labels(slot=name),
                duration=self._duration.labels(slot=name),
                owner=self,
            )
        else:
            slot.kind = kind
        return slot

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per slot, the JSON figures of :meth:`SlotMetrics.snapshot`."""
        return {name: slot.snapshot() for name, slot in self._slots.items()}

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE


class SlotMetrics:
    """The live figures of one slot; get it from :meth:`Metrics.slot`.

    Example::

        slot = metrics.slot("qwen", "local")
        meter = slot.request()          # in_flight 1, queued 1
        meter.first_token()             # queued 0, TTFT observed
        slot.snapshot()["in_flight"]    # 1
    """

    def __init__(
        self,
        name: str,
        kind: SlotKind,
        *,
        window: float,
        clock: Callable[[], float],
        ttft: Histogram,
        duration: Histogram,
        owner: Metrics | None = None,
    ) -> None:
        self.owner = owner  # the Metrics it belongs to: who hears of the requests' ends
        self.name = name
        self.kind: SlotKind = kind
        self.in_flight = 0
        self.queued = 0
        self.requests = 0  # finished, any outcome
        self.errors = 0
        self.tokens_in = 0
        self.tokens_out = 0
        self._window = window
        self._nbuckets = max(1, math.ceil(window / _BUCKET))
        self._clock = clock
        self._ttft_hist = ttft
        self._duration_hist = duration
        # [bucket index, tokens]: lists so the newest bucket is bumped in place
        self._buckets: deque[list[int]] = deque()
        self._burst_start = 0.0
        self._last_token: float | None = None
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=TTFT_SAMPLES)
        self._out_exported = 0  # the Prometheus counter's high-water mark

    def request(self) -> RequestMeter:
        """Admit one request: in_flight and queued go up until it starts / ends."""
        return RequestMeter(self, self._clock)

    def snapshot(self) -> dict[str, Any]:
        """The JSON figures (``tokens_per_second``, ``ttft_ms`` and the counts)."""
        now = self._clock()
        cutoff = now - self._window
        recent = [ttft for at, ttft in self._ttfts if at > cutoff]
        ttft_ms: dict[str, float | None] = {"last": None, "p50": None, "p95": None}
        if recent:
            ranked = sorted(recent)
            ttft_ms = {
                "last": _ms(recent[-1]),
                "p50": _ms(_nearest_rank(ranked, 50)),
                "p95": _ms(_nearest_rank(ranked, 95)),
            }
        return {
            "kind": self.kind,
            "tokens_per_second": round(self.tokens_per_second(now), 3),
            "ttft_ms": ttft_ms,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "requests": self.requests,
            "errors": self.errors,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
        }

    def tokens_per_second(self, now: float | None = None) -> float:
        """Output tokens per second over the recent window (see the module doc)."""
        if now is None:
            now = self._clock()
        current = math.floor(now / _BUCKET)
        first = current - self._nbuckets + 1
        total = sum(count for index, count in self._buckets if first <= index <= current)
        if total <= 0:
            return 0.0
        since = max(first * _BUCKET, self._burst_start)
        return total / max(now - since, _BUCKET)

    def exported_tokens_out(self) -> int:
        """``tokens_out`` for the Prometheus counter, which never goes down."""
        self._out_exported = max(self._out_exported, self.tokens_out)
        return self._out_exported

    # -- called by RequestMeter -------------------------------------------------

    def _observe_ttft(self, now: float, ttft: float) -> None:
        self.queued -= 1
        self._ttfts.append((now, ttft))
        self._ttft_hist.observe(ttft)

    def _add_tokens(self, n: int) -> None:
        # Runs for every streamed token: one clock read and an in-place bump.
        now = self._clock()
        self.tokens_out += n
        index = math.floor(now / _BUCKET)
        buckets = self._buckets
        if buckets and buckets[-1][0] == index:
            buckets[-1][1] += n
        else:
            buckets.append([index, n])
            while buckets[0][0] <= index - self._nbuckets:
                buckets.popleft()
        if self._last_token is None or now - self._last_token >= self._window:
            self._burst_start = now
        self._last_token = now

    def _remove_tokens(self, n: int) -> None:
        # An over-count (e.g. a token split into several deltas) most likely sits in
        # the newest buckets; take it back from there, never below zero.
        self.tokens_out -= n
        for bucket in reversed(self._buckets):
            taken = min(n, bucket[1])
            bucket[1] -= taken
            n -= taken
            if n == 0:
                break

    def _finish(self, duration: float, *, started: bool, error: bool, prompt_tokens: int) -> None:
        self.in_flight -= 1
        if not started:
            self.queued -= 1
        self.requests += 1
        if error:
            self.errors += 1
        self.tokens_in += prompt_tokens
        self._duration_hist.observe(duration)


class RequestMeter:
    """One request's path through a slot; get it from :meth:`SlotMetrics.request`.

    ``first_token`` and ``finish`` are idempotent, and nothing counts after
    ``finish``, so every exit path may call ``finish`` without care.

    Example::

        meter = slot.request()
        meter.first_token()
        meter.tokens(1)
        meter.finish(prompt_tokens=12, completion_tokens=1)
    """

    def __init__(self, slot: SlotMetrics, clock: Callable[[], float]) -> None:
        self._slot = slot
        self._clock = clock
        self._admitted = clock()
        self._started = False
        self._finished = False
        self._first_at = 0.0
        self._counted = 0  # output tokens counted live, before the usage correction
        owner = slot.owner
        self._key = "" if owner is None else owner.caller()
        self.model = slot.name  # the model's name in usage (an upstream slot's may differ)
        slot.in_flight += 1
        slot.queued += 1

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def started(self) -> bool:
        """The first token has come."""
        return self._started

    @property
    def admitted(self) -> float:
        """When the request reached the slot (the metrics' clock)."""
        return self._admitted

    @property
    def counted(self) -> int:
        """Output tokens so far, as counted live."""
        return self._counted

    def tokens_per_second(self, now: float) -> float | None:
        """Output tokens per second since the first token; None before a second token."""
        span = now - self._first_at
        if not self._started or self._counted < 2 or span <= 0:
            return None
        return (self._counted - 1) / span

    def first_token(self) -> None:
        """The first content/reasoning/tool token: TTFT observed, no longer queued."""
        if self._started or self._finished:
            return
        self._started = True
        now = self._first_at = self._clock()
        self._slot._observe_ttft(now, now - self._admitted)

    def tokens(self, n: int) -> None:
        """``n`` output tokens now (a token implies the first token has come)."""
        if n <= 0 or self._finished:
            return
        if not self._started:
            self.first_token()
        self._counted += n
        self._slot._add_tokens(n)

    def finish(
        self,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        error: bool = False,
        cached_tokens: int | None = None,
    ) -> None:
        """End the request (once): latency, outcome, tokens in, and the exact
        ``completion_tokens`` (from usage) replacing the live count. The owner's
        ``on_end`` hears of it (the usage ledger)."""
        if self._finished:
            return
        self._finished = True
        slot = self._slot
        if completion_tokens is not None:
            difference = completion_tokens - self._counted
            if difference > 0:
                slot._add_tokens(difference)
            elif difference < 0:
                slot._remove_tokens(-difference)
        prompt = max(prompt_tokens or 0, 0)
        slot._finish(
            self._clock() - self._admitted,
            started=self._started,
            error=error,
            prompt_tokens=prompt,
        )
        owner = slot.owner
        if owner is not None and owner.on_end is not None:
            completion = self._counted if completion_tokens is None else completion_tokens
            cached = min(max(cached_tokens or 0, 0), prompt)
            owner.on_end(self._key, self.model, prompt, cached, max(completion, 0), error)


# -- Prometheus ---------------------------------------------------------------------


class _SlotCollector(Collector):
    """The counters and gauges, read from the slots at scrape time (the token path
    only bumps plain ints; tok/s is computed here)."""

    def __init__(self, slots: Mapping[str, SlotMetrics]) -> None:
        self._slots = slots

    def collect(self) -> Iterable[Metric]:
        slots = list(self._slots.values())
        info = GaugeMetricFamily(
            "sluice_slot_info", "The slot and its kind.", labels=["slot", "kind"]
        )
        requests = CounterMetricFamily(
            "sluice_requests", "Finished requests by outcome.", labels=["slot", "outcome"]
        )
        tokens = CounterMetricFamily(
            "sluice_tokens", "Prompt (in) and generated (out) tokens.", labels=["slot", "direction"]
        )
        in_flight = GaugeMetricFamily(
            "sluice_in_flight", "Requests admitted, not ended.", labels=["slot"]
        )
        queued = GaugeMetricFamily(
            "sluice_queued", "Requests admitted, no first token yet.", labels=["slot"]
        )
        rate = GaugeMetricFamily(
            "sluice_tokens_per_second", "Output tokens/s over the recent window.", labels=["slot"]
        )
        for slot in slots:
            name = slot.name
            info.add_metric([name, slot.kind], 1)
            requests.add_metric([name, "ok"], slot.requests - slot.errors)
            requests.add_metric([name, "error"], slot.errors)
            tokens.add_metric([name, "in"], slot.tokens_in)
            tokens.add_metric([name, "out"], slot.exported_tokens_out())
            in_flight.add_metric([name], slot.in_flight)
            queued.add_metric([name], slot.queued)
            rate.add_metric([name], slot.tokens_per_second())
        return [info, requests, tokens, in_flight, queued, rate]


class _DecodingCollector(Collector):
    """Speculation and jump-forward, per loaded local model (their engines' counters)."""

    def __init__(self, read: Callable[[], Mapping[str, tuple[int, int, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        drafted = CounterMetricFamily(
            "sluice_draft_tokens",
            "Prompt-lookup draft tokens decoded for verification, by outcome (accepted: the "
            "sampler chose them).",
            labels=["slot", "outcome"],
        )
        forced = CounterMetricFamily(
            "sluice_forced_tokens",
            "Tokens a grammar forced, decoded without sampling (jump-forward).",
            labels=["slot"],
        )
        for name, (n_drafted, n_accepted, n_forced) in self._read().items():
            drafted.add_metric([name, "accepted"], n_accepted)
            drafted.add_metric([name, "rejected"], n_drafted - n_accepted)
            forced.add_metric([name], n_forced)
        return [drafted, forced]


class _AffinityCollector(Collector):
    """Which replica each upstream slot's requests went to, and why (``affinity.py``)."""

    def __init__(self, read: Callable[[], Mapping[str, tuple[Mapping[str, int], int]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        choices = CounterMetricFamily(
            "sluice_upstream_affinity_choices",
            "Replica choices by kind: pinned (the replica holding the conversation's "
            "prefix), hashed (a new conversation's), moved (the pinned one down or full), "
            "unkeyed (no conversation named: the least busy).",
            labels=["slot", "choice"],
        )
        pinned = GaugeMetricFamily(
            "sluice_upstream_affinity_conversations",
            "Conversations pinned to a replica.",
            labels=["slot"],
        )
        for name, (counts, conversations) in self._read().items():
            for kind, n in counts.items():
                choices.add_metric([name, kind], n)
            pinned.add_metric([name], conversations)
        return [choices, pinned]


def _nearest_rank(ranked: list[float], percent: int) -> float:
    return ranked[max(math.ceil(percent / 100 * len(ranked)) - 1, 0)]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
