"""Live per-slot metrics, measured on the streaming path (local and upstream alike).

One :class:`Metrics` per app owns a private Prometheus registry and one
:class:`SlotMetrics` per slot. Each request through a slot gets a
:class:`RequestMeter`; :func:`metered` drives one from a backend's event stream
and :class:`OpenAIChunkTap` drives one from an OpenAI upstream's passthrough
chunks. Everything here runs on the event loop (no locks on the token path).

Example::

    metrics = Metrics()
    stream = metered(await backend.open(request), metrics.slot("qwen", "local").request())
    async for event in stream:
        ...
    body, content_type = metrics.render()    # GET /metrics
    metrics.snapshot()["qwen"]["tokens_per_second"]

Decisions worth knowing:

* ``tokens_per_second`` is the output tokens of the last ``window`` seconds
  (whole one-second buckets: the current partial second plus ``ceil(window) - 1``
  full ones) divided by the time they cover: from the later of that window's
  first bucket and the start of the current burst of activity (the first token
  after at least ``window`` seconds without any) up to now, but at least one
  second. So an idle slot reads 0, a one-second burst right after start reads
  its own rate (not a tenth of it), and the first token alone does not read as
  thousands per second.
* TTFT ``p50``/``p95`` are nearest-rank percentiles over the TTFTs observed in
  the last ``window`` seconds (at most :data:`TTFT_SAMPLES` of them); ``last``
  is the newest of those. All three are ``None`` when there are none.
* ``tokens_out`` is live (per streamed token) and corrected to the exact usage
  count when a request finishes. The JSON figure follows the correction both
  ways; the Prometheus counter must never go down, so a downward correction
  holds it flat until the true total catches up.
* A client disconnect (``aclose`` before the end) is not a slot error; an
  ``ErrorEvent``, an exception from the backend or an upstream ``error`` object is.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Literal, TypeGuard

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.core.backend import ResponseStream, StreamMeta
from sluice.core.errors import SluiceError
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
)
from sluice.core.interrupt import Interrupt

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
        self.registry.register(_SlotCollector(self._slots))
        self._by_key = Counter(
            "sluice_requests_by_key",
            "Requests that passed the API key check, by the key's name.",
            ["key"],
            registry=self.registry,
        )

    def count_key(self, name: str) -> None:
        """One request authenticated with the key named ``name`` (server/auth.py)."""
        self._by_key.labels(key=name).inc()

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
    ) -> None:
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
    ) -> None:
        """End the request (once): latency, outcome, tokens in, and the exact
        ``completion_tokens`` (from usage) replacing the live count."""
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
        slot._finish(
            self._clock() - self._admitted,
            started=self._started,
            error=error,
            prompt_tokens=max(prompt_tokens or 0, 0),
        )


# -- the event-stream path ---------------------------------------------------------


class MeteredStream:
    """A ResponseStream that feeds a RequestMeter as its events pass, and can be
    cancelled from outside (``POST /v1/requests/{id}/cancel``).

    ``state`` follows the request: ``queued`` until the engine admits it (a
    ``prompt_processing`` progress event), ``prefilling`` until its first
    token, then ``generating``. :meth:`cancel` ends the consumer's iteration
    with an ``ErrorEvent`` at once, even while it waits for the next event, and
    aborts the backend.
    """

    def __init__(self, stream: ResponseStream, meter: RequestMeter) -> None:
        self.meta: StreamMeta = stream.meta
        self.meter = meter
        self.prefilling = False
        self.on_end: Callable[[], None] | None = None  # called once, when the meter finishes
        self.flight: Any = None  # its entry among the requests in flight (models/flights.py)
        self._stream = stream
        self._error = False
        # Start gives each choice's prompt size; usage (when it comes) is exact.
        self._prompt: dict[int, int] = {}
        self._completion: dict[int, int] = {}
        self._iterator: AsyncGenerator[Event, None] | None = None
        self._interrupt = Interrupt()  # cancel() ends the consumer's wait for an event

    @property
    def state(self) -> Literal["queued", "prefilling", "generating"]:
        if self.meter.started:
            return "generating"
        return "prefilling" if self.prefilling else "queued"

    @property
    def model(self) -> str:
        return self.meta.model

    @property
    def replica(self) -> str | None:
        return self.meta.replica

    @property
    def prompt_tokens(self) -> int:
        owners = self.meta.prompt_owners
        return sum(n for choice, n in self._prompt.items() if choice in owners)

    def __aiter__(self) -> AsyncIterator[Event]:
        iterator = self._iterator = self._events()
        return iterator

    async def _events(self) -> AsyncGenerator[Event, None]:
        inner = aiter(self._stream)
        try:
            while True:
                try:
                    event = await self._interrupt.wait(lambda: anext(inner))
                except StopAsyncIteration:
                    return
                except SluiceError as error:
                    if error is not self._interrupt.error:
                        raise
                    self._error = True
                    self._finish()
                    await self._stream.aclose()  # aborts the engine or the upstream request
                    yield ErrorEvent(error)
                    return
                self._observe(event)
                yield event
        except Exception:
            self._error = True
            raise
        finally:
            # Normal end, an ErrorEvent, a backend exception, or the consumer
            # stopped iterating (a disconnect: not an error unless one was seen).
            self._finish()

    def cancel(self, error: SluiceError) -> bool:
        """End the stream with ``error`` (an ``ErrorEvent``); False if it already ended."""
        return not self.meter.finished and self._interrupt.fire(error)

    def _observe(self, event: Event) -> None:
        meter = self.meter
        match event:
            case TextDelta(echo=False, token_count=count):
                meter.first_token()
                meter.tokens(count)
            case ReasoningDelta():
                meter.first_token()
                meter.tokens(1)  # carries no count: one per delta
            case ToolCallStart():
                meter.first_token()
            case ToolCallDelta():
                meter.tokens(1)
            case Start(choice=choice, prompt_tokens=prompt):
                self._prompt[choice] = prompt
            case Progress(phase="prompt_processing"):
                self.prefilling = True
            case Finish(usage=usage) if usage is not None:
                self._prompt[usage.choice] = usage.prompt_tokens
                self._completion[usage.choice] = usage.completion_tokens
            case ErrorEvent():
                self._error = True
                self._finish()

    def _finish(self) -> None:
        if self.meter.finished:
            return
        # Usage for only some choices (an abort) would undercount the others: then
        # the live count stands.
        exact = len(self._completion) >= self.meta.choices
        self.meter.finish(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=sum(self._completion.values()) if exact else None,
            error=self._error,
        )
        if self.on_end is not None:
            self.on_end()

    async def aclose(self) -> None:
        self._finish()
        if self._iterator is not None:
            try:
                await self._iterator.aclose()
            except RuntimeError:  # still running in another task; it finishes there
                pass
        await self._stream.aclose()


def metered(stream: ResponseStream, meter: RequestMeter) -> MeteredStream:
    """``stream`` with ``meter`` fed from its events; same ``meta`` and ``aclose``.

    The meter finishes exactly once: at the stream's end, at an ``ErrorEvent``
    (error), at an exception from the backend (error) or at ``aclose`` (a
    disconnect, not an error).

    Example::

        stream = metered(await backend.open(request), slot.request())
    """
    return MeteredStream(stream, meter)


# -- the passthrough path ----------------------------------------------------------


class OpenAIChunkTap:
    """Feeds a RequestMeter from an OpenAI upstream's decoded ``data:`` objects.

    The bytes go to the client unchanged; this only reads the parsed chunks.
    TTFT is keyed to the first chunk with content (not the role-only chunk);
    each content-bearing choice delta counts one token until ``usage`` gives
    the exact counts.

    Example::

        tap = OpenAIChunkTap(slot.request())
        async for data in decoder:          # each parsed `data:` JSON object
            tap.chunk(data)
        tap.finish()                        # or tap.finish(error=True)
    """

    def __init__(self, meter: RequestMeter) -> None:
        self._meter = meter
        self._error = False
        self._prompt: int | None = None
        self._completion: int | None = None
        self._named = False
        self.on_id: Callable[[str], None] | None = None  # hears the response's id once

    @property
    def meter(self) -> RequestMeter:
        return self._meter

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's tokens, once the upstream's usage has said."""
        return self._prompt

    def _name(self, response_id: object) -> None:
        self._named = True
        if isinstance(response_id, str) and response_id and self.on_id is not None:
            self.on_id(response_id)

    def chunk(self, data: Mapping[str, Any]) -> None:
        """One streamed chunk (chat ``delta`` or completions ``text``)."""
        if not self._named:
            self._name(data.get("id"))
        if data.get("error"):
            self._error = True
        choices = data.get("choices")
        if isinstance(choices, list):
            bearing = sum(1 for choice in choices if _carries_content(choice))
            if bearing:
                self._meter.tokens(bearing)
        self._usage(data.get("usage"))

    def body(self, data: Mapping[str, Any]) -> None:
        """A non-streaming answer: the first token is when it arrived."""
        if data.get("error"):
            self._error = True
            return
        self._meter.first_token()
        self._usage(data.get("usage"))
        if self._completion is not None:
            self._meter.tokens(self._completion)

    def finish(self, error: bool = False) -> None:
        """The response ended (idempotent); ``error`` for a transport/upstream failure."""
        self._meter.finish(
            prompt_tokens=self._prompt,
            completion_tokens=self._completion,
            error=error or self._error,
        )

    def ended(self, data: Mapping[str, Any]) -> bool:
        """Whether ``data`` completes the answer (a finish or an error)."""
        choices = data.get("choices")
        if not isinstance(choices, list):
            return "error" in data
        return any(isinstance(c, Mapping) and c.get("finish_reason") for c in choices)

    def _usage(self, usage: object) -> None:
        if not isinstance(usage, Mapping):
            return
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if _is_count(prompt):
            self._prompt = prompt
        if _is_count(completion):
            self._completion = completion


class AnthropicEventTap(OpenAIChunkTap):
    """The same, for an upstream that speaks Anthropic's Messages API natively.

    Each content delta counts one token until ``message_delta``'s cumulative usage
    gives the exact count; ``input_tokens`` plus the cache reads is the prompt.
    """

    def chunk(self, data: Mapping[str, Any]) -> None:
        kind = data.get("type")
        if kind == "content_block_delta":
            self._meter.tokens(1)
        elif kind == "message_start":
            message = data.get("message")
            if isinstance(message, Mapping):
                self._name(message.get("id"))
                self._anthropic_usage(message.get("usage"))
        elif kind == "message_delta":
            self._anthropic_usage(data.get("usage"))
        elif kind == "error":
            self._error = True

    def body(self, data: Mapping[str, Any]) -> None:
        if data.get("type") == "error":
            self._error = True
            return
        self._meter.first_token()
        self._anthropic_usage(data.get("usage"))
        if self._completion is not None:
            self._meter.tokens(self._completion)

    def ended(self, data: Mapping[str, Any]) -> bool:
        return data.get("type") in ("message_stop", "error")

    def _anthropic_usage(self, usage: object) -> None:
        if not isinstance(usage, Mapping):
            return
        fresh = usage.get("input_tokens")
        if _is_count(fresh):
            prompt: int = fresh
            for key in ("cache_read_input_tokens", "cache_creation_input_tokens"):
                cached = usage.get(key)
                if _is_count(cached):
                    prompt += cached
            self._prompt = prompt
        output = usage.get("output_tokens")
        if _is_count(output):
            self._completion = output


class ResponsesEventTap(OpenAIChunkTap):
    """The same, for an upstream that serves OpenAI's Responses API natively: each text or
    arguments delta counts one token until the terminal event's usage says."""

    _TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")

    def chunk(self, data: Mapping[str, Any]) -> None:
        kind = data.get("type")
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self._meter.tokens(1)
        elif kind == "response.created" and not self._named:
            response = data.get("response")
            self._name(response.get("id") if isinstance(response, Mapping) else None)
        elif kind in ("response.failed", "error"):
            self._error = True
        if kind in self._TERMINAL:
            self._response_usage(data.get("response"))

    def body(self, data: Mapping[str, Any]) -> None:
        if data.get("error"):
            self._error = True
            return
        self._meter.first_token()
        self._response_usage(data)
        if self._completion is not None:
            self._meter.tokens(self._completion)

    def ended(self, data: Mapping[str, Any]) -> bool:
        return data.get("type") in self._TERMINAL

    def _response_usage(self, response: object) -> None:
        usage = response.get("usage") if isinstance(response, Mapping) else None
        if not isinstance(usage, Mapping):
            return
        if _is_count(usage.get("input_tokens")):
            self._prompt = usage["input_tokens"]
        if _is_count(usage.get("output_tokens")):
            self._completion = usage["output_tokens"]


def _carries_content(choice: object) -> bool:
    if not isinstance(choice, Mapping):
        return False
    text = choice.get("text")  # /v1/completions
    if isinstance(text, str) and text:
        return True
    delta = choice.get("delta")
    if not isinstance(delta, Mapping):
        return False
    for key in ("content", "reasoning_content", "reasoning"):
        value = delta.get(key)
        if isinstance(value, str) and value:
            return True
    tool_calls = delta.get("tool_calls")
    return isinstance(tool_calls, list) and bool(tool_calls)


def _is_count(value: object) -> TypeGuard[int]:
    # bool is an int subclass; a JSON true is not a count
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


def _nearest_rank(ranked: list[float], percent: int) -> float:
    return ranked[max(math.ceil(percent / 100 * len(ranked)) - 1, 0)]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
