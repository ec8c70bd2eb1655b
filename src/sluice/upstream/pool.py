"""The replicas of one upstream slot: choice, failover before the first byte, health checks.

One :class:`UpstreamPool` per ``[[upstreams]]`` entry. :meth:`UpstreamPool.send`
POSTs a body to the replica that holds the conversation's prefix (cache affinity,
``affinity.py``; else the least busy one) among those not known to be down, and fails
over to the next one while nothing has been answered yet (a refused connection, a
timeout, a 5xx other than 503). After the first byte a failure is the caller's
to report (the gateway's rule: an error frame or a 502): the pool only maps it to a typed
error and has the replica checked at once.

Each replica is checked in the background (``GET /v1/models``): every
``health_interval`` seconds while healthy, with exponential backoff while down;
a down replica that answers its check gets traffic again.

The wire's exceptions (``wire.py``) become sluice's in one place, :func:`upstream_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import urlsplit

from sluice.core.errors import UpstreamFailed, UpstreamTimeout, UpstreamUnavailable
from sluice.upstream.affinity import Affinity, Candidate
from sluice.upstream.config import UpstreamSpec
from sluice.upstream.wire import (
    ConnectTimeout,
    Origin,
    ReadTimeout,
    WireClient,
    WireError,
    WireResponse,
)

log = logging.getLogger("sluice.router")

# Backoff of a down replica's checks: BACKOFF_MIN doubling per consecutive failure up to
# BACKOFF_MAX, jittered so that replicas (and gateways) that failed together do not
# check in lockstep.
BACKOFF_MIN = 0.5
BACKOFF_MAX = 30.0
_JITTER = 0.2

State = Literal["unknown", "healthy", "down"]


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """A snapshot of one replica, for ``/health``, ``/metrics`` and logs.

    Example::

        ReplicaStatus(url="http://10.0.0.5:8000", state="healthy", outstanding=2,
                      failures=0, last_error=None, next_check_in=9.5, models=("qwen",))
    """

    url: str
    state: State
    outstanding: int  # requests sent to it and not yet closed
    failures: int  # consecutive failures (0 when healthy)
    last_error: str | None
    next_check_in: float | None  # seconds until its next health check (None: none planned)
    models: tuple[str, ...]  # ids its last good /v1/models listed


@contextlib.contextmanager
def upstream_errors(spec: UpstreamSpec, replica: str, doing: str = "") -> Iterator[None]:
    """The wire's transport errors inside as :class:`UpstreamTimeout` / :class:`UpstreamFailed`.

    Example::

        with upstream_errors(spec, url, "dropped the stream: "):
            chunk = await response.read_some()
        # -> UpstreamFailed("upstream 'gpu-box': http://h:8000 dropped the stream: ...")
    """
    try:
        yield
    except WireError as exc:
        raise _mapped(exc, spec, replica, doing) from exc


def _mapped(exc: WireError, spec: UpstreamSpec, replica: str, doing: str) -> UpstreamFailed:
    # The wire's message says what the replica did: "refused the connection", ...
    message = f"upstream {spec.name!r}: {replica} {doing}{exc}"
    if isinstance(exc, ReadTimeout | ConnectTimeout):
        return UpstreamTimeout(message)
    return UpstreamFailed(message)


class _Replica:
    """The mutable state of one replica (the pool's own; :class:`ReplicaStatus` is the view)."""

    __slots__ = (
        "base",
        "entries",
        "failures",
        "last_error",
        "models",
        "next_check",
        "origin",
        "outstanding",
        "state",
        "url",
        "wake",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.origin = Origin.parse(url)
        self.base = urlsplit(url).path.rstrip("/")  # a path the server is mounted under
        self.state: State = "unknown"
        self.outstanding = 0
        self.failures = 0
        self.last_error: str | None = None
        self.next_check: float | None = None  # time.monotonic() of its next check
        self.models: tuple[str, ...] = ()
        self.entries: dict[str, dict[str, Any]] = {}
        # Set while its checker sleeps: resolving it makes the checker re-read next_check.
        self.wake: asyncio.Future[None] | None = None

    def wake_up(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


class UpstreamResponse:
    """An upstream's answer whose head arrived; the body is read as it comes.

    Always closed (``aclose`` or ``async with``): closing before the end drops
    the connection, so the upstream sees the request aborted. Errors while
    reading are :class:`UpstreamFailed` / :class:`UpstreamTimeout`.

    Example::

        async with await pool.send("/chat/completions", body) as response:
            while chunk := await response.read_some():
                forward(chunk)
    """

    __slots__ = ("_closed", "_pool", "_replica", "_response", "headers", "replica", "status")

    def __init__(self, pool: UpstreamPool, replica: _Replica, response: WireResponse) -> None:
        self.status = response.status
        self.headers = response.headers  # lower-case names
        self.replica = replica.url
        self._pool = pool
        self._replica = replica
        self._response = response
        self._closed = False

    async def read_some(self) -> bytes:
        """The body's next bytes as they arrive, undecoded (b"" at its end, when the
        response is closed)."""
        try:
            data = await self._response.read_some()
        except WireError as exc:
            if self._closed:
                return b""  # the caller closed it meanwhile (a client disconnect)
            self._pool._suspect(self._replica)
            await self.aclose()
            raise _mapped(exc, self._pool.spec, self.replica, "dropped the stream: ") from exc
        if not data:
            await self.aclose()
        return data

    def relay(
        self, sink: Callable[[bytes], None], on_end: Callable[[UpstreamFailed | None], None]
    ) -> None:
        """The body to ``sink`` as it arrives, in the connection's callback, and its end to
        ``on_end`` (None, or the error that cut it): :meth:`WireResponse.relay`, errors
        mapped as :meth:`read_some` maps them. ``pause`` and ``resume`` the socket."""

        def ended(error: WireError | None) -> None:
            if error is None or self._closed:
                on_end(None if error is None else UpstreamFailed("closed"))
                return
            self._pool._suspect(self._replica)
            on_end(_mapped(error, self._pool.spec, self.replica, "dropped the stream: "))

        self._response.relay(sink, ended)

    def pause(self) -> None:
        self._response.pause()

    def resume(self) -> None:
        self._response.resume()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, undecoded; closes the response at its end."""
        while data := await self.read_some():
            yield data

    async def aread(self) -> bytes:
        """The whole body; closes the response."""
        parts = []
        try:
            while data := await self.read_some():
                parts.append(data)
        finally:
            await self.aclose()
        return b"".join(parts)

    async def aclose(self) -> None:
        """Close at once (idempotent); before the end this aborts the upstream request."""
        self.close()

    def close(self) -> None:
        """:meth:`aclose`, which never waits: for callers that cannot await."""
        if self._closed:
            return
        self._closed = True
        self._replica.outstanding -= 1
        self._response.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class UpstreamPool:
    """The replicas of one upstream slot behind one keep-alive HTTP/1.1 client.

    Example::

        pool = UpstreamPool(spec)
        await pool.start()  # checks every replica once: discovers its models
        response = await pool.send("/chat/completions", body, {"accept": "text/event-stream"})
        ...
        await pool.close()
    """

    def __init__(self, spec: UpstreamSpec) -> None:
        self.spec = spec
        self._replicas = [_Replica(url) for url in spec.urls]
        self._rr = 0  # round-robin offset among equally busy replicas (and the unkeyed)
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if spec.api_key:
            self._headers["authorization"] = f"Bearer {spec.api_key}"
            # Anthropic's header too: a server that speaks Messages natively may read
            # only that one, and OpenAI servers ignore it.
            self._headers["x-api-key"] = spec.api_key
        self.affinity = Affinity(spec.affinity_load_factor)
        # Keep-alive HTTP/1.1: a gateway holds one connection per streaming request.
        # Upstreams are named by the config (no HTTP(S)_PROXY), redirects not followed.
        self._client = WireClient(connect_timeout=spec.connect_timeout, timeout=spec.timeout)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Check every replica now (discovers their models), then keep checking them."""
        await asyncio.gather(*(self._check(r) for r in self._replicas))
        self._ensure_checkers()

    async def close(self) -> None:
        """Stop the checks and close the client (and its connections)."""
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in self._replicas:
            r.next_check = None
        await self._client.aclose()

    def _ensure_checkers(self) -> None:
        if self._tasks or self._closed:
            return
        self._tasks = [
            asyncio.create_task(self._watch(r), name=f"sluice-upstream-{self.spec.name}-{r.url}")
            for r in self._replicas
        ]

    # -- requests ----------------------------------------------------------------------

    async def send(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        prefix: str = "/v1",
        key: str | None = None,
        exclude: Collection[str] = (),
    ) -> UpstreamResponse:
        """POST ``body`` to ``<replica><prefix><path>`` (``/v1`` but for Gemini's
        ``/v1beta``); the response once its headers arrived. ``key`` names the
        conversation (``affinity.affinity_key``): its turns go to the same replica.
        Replicas whose URL is in ``exclude`` are not asked (one that just failed).

        Fails over to the next usable replica on a connection failure, a timeout
        or a 5xx other than 503; a 429/503 (busy) tries the next one too, and if
        no replica did better the last busy answer is returned as it is.
        Raises :class:`UpstreamUnavailable` if every replica is known down,
        :class:`UpstreamFailed` / :class:`UpstreamTimeout` if each one tried failed.
        """
        self._ensure_checkers()
        merged = dict(self._headers)
        if headers:
            merged.update({k.lower(): v for k, v in headers.items()})
        busy: UpstreamResponse | None = None
        failure: UpstreamFailed | None = None
        try:
            for index in self._order(key):
                replica = self._replicas[index]
                if replica.state == "down" or replica.url in exclude:
                    continue  # (marked down by another request since the order was made)
                replica.outstanding += 1
                try:
                    with upstream_errors(self.spec, replica.url):
                        response = await self._client.request(
                            "POST", replica.origin, f"{replica.base}{prefix}{path}", body, merged
                        )
                except UpstreamFailed as exc:
                    replica.outstanding -= 1
                    self._mark_down(replica, exc)
                    failure = exc
                    continue
                except BaseException:  # cancelled: the request is not ours to count any more
                    replica.outstanding -= 1
                    raise
                status = response.status
                if status >= 500 and status != 503:
                    replica.outstanding -= 1
                    await response.aclose()
                    failure = UpstreamFailed(
                        f"upstream {self.spec.name!r}: {replica.url} answered {status}"
                    )
                    self._mark_down(replica, failure)
                    continue
                answer = UpstreamResponse(self, replica, response)
                if status in (429, 503):
                    # Busy, not down: another replica may have room; keep this answer in case
                    # none does (its Retry-After is the caller's to pass on).
                    if busy is not None:
                        await busy.aclose()
                    busy = answer
                    continue
                if busy is not None:
                    await busy.aclose()
                if key is not None and self.keyed:
                    self.affinity.remember(key, replica.url)
                return answer
        except BaseException:  # cancelled: a busy answer kept for later is nobody's now
            if busy is not None:
                await busy.aclose()
            raise
        if busy is not None:
            return busy
        if failure is not None:
            raise failure
        raise self._unavailable()

    def _order(self, key: str | None) -> list[int]:
        """The replicas not known down, in the order to try them: with a conversation's
        ``key`` (and affinity on) the one holding its prefix first, within the load
        bound (``affinity.py``); else the least busy first, ties in turn."""
        replicas = self._replicas
        n = len(replicas)
        if n == 1:
            return [] if replicas[0].state == "down" else [0]
        start = self._rr % n
        self._rr += 1
        turn = replicas[start:] + replicas[:start]
        candidates = [Candidate(r.url, r.state != "down", r.outstanding) for r in turn]
        order = self.affinity.order(key if self.keyed else None, candidates)
        return [(start + i) % n for i in order]

    @property
    def size(self) -> int:
        """How many replicas the slot has."""
        return len(self._replicas)

    @property
    def keyed(self) -> bool:
        """Whether conversations are routed by affinity (several replicas, ``affinity``)."""
        return self.spec.affinity and self.size > 1

    def _unavailable(self) -> UpstreamUnavailable:
        now = time.monotonic()
        checks = [r.next_check for r in self._replicas if r.next_check is not None]
        wait = max(1, math.ceil(min(checks) - now)) if checks else 1
        errors = "; ".join(f"{r.url} {r.last_error or 'is down'}" for r in self._replicas)
        return UpstreamUnavailable(
            f"upstream {self.spec.name!r}: every replica is down ({errors}); "
            f"next check in {wait} s",
            retry_after=wait,
        )

    # -- state -------------------------------------------------------------------------

    def _detail(self, error: BaseException) -> str:
        """An error's message without the slot's name (the replica's own record)."""
        text = getattr(error, "message", None) or str(error)
        return text.removeprefix(f"upstream {self.spec.name!r}: ")

    def _mark_down(self, r: _Replica, error: BaseException) -> None:
        r.last_error = self._detail(error)
        if r.state == "down" and r.next_check is not None:
            return  # already down: its backoff stands (many requests may fail at once)
        r.failures += 1
        was = r.state
        r.state = "down"
        delay = self._backoff(r.failures)
        r.next_check = time.monotonic() + delay
        r.wake_up()
        if was != "down":
            log.warning(
                "upstream %r: replica %s is down: %s (next check in %.1f s)",
                self.spec.name,
                r.url,
                r.last_error,
                delay,
            )

    def _suspect(self, r: _Replica) -> None:
        """A stream dropped: check the replica now rather than mark it down on one drop."""
        r.next_check = time.monotonic()
        r.wake_up()

    @staticmethod
    def _backoff(failures: int) -> float:
        base = min(BACKOFF_MAX, BACKOFF_MIN * 2.0 ** min(failures - 1, 30))
        return min(BACKOFF_MAX, base * random.uniform(1 - _JITTER, 1 + _JITTER))

    # -- health checks -----------------------------------------------------------------

    async def _watch(self, r: _Replica) -> None:
        """One replica's checker: sleeps until its next check (or a wake-up), checks."""
        while True:
            try:
                delay = (r.next_check or 0.0) - time.monotonic()
                if delay > 0:
                    # A future and a timer rather than wait_for(event.wait()): on Python
                    # 3.11, wait_for can swallow a cancel (close() would hang) when the
                    # event is set at the same moment.
                    loop = asyncio.get_running_loop()
                    r.wake = loop.create_future()
                    timer = loop.call_later(delay, r.wake_up)
                    try:
                        await r.wake
                    finally:
                        timer.cancel()
                        r.wake = None
                    continue  # next_check may have moved: look again
                await self._check(r)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the checks of this replica
                log.exception("upstream %r: health check of %s failed", self.spec.name, r.url)
                await asyncio.sleep(BACKOFF_MAX)

    async def _check(self, r: _Replica) -> None:
        """``GET /v1/models``: healthy with its models, or down with a backoff."""
        try:
            with upstream_errors(self.spec, r.url):
                response = await self._client.request(
                    "GET",
                    r.origin,
                    f"{r.base}/v1/models",
                    headers={k: v for k, v in self._headers.items() if k != "content-type"},
                    timeout=self.spec.connect_timeout,
                )
                try:
                    content = await response.aread()
                finally:
                    await response.aclose()
            entries = _model_entries(response.status, content)
        except UpstreamFailed as exc:
            self._check_failed(r, self._detail(exc))
            return
        except _BadListing as exc:
            self._check_failed(r, str(exc))
            return
        was = r.state
        r.state = "healthy"
        r.failures = 0
        r.last_error = None
        r.entries = entries
        r.models = tuple(entries)
        r.next_check = time.monotonic() + self.spec.health_interval
        if was == "down":
            log.info("upstream %r: replica %s is back", self.spec.name, r.url)
        elif was == "unknown":
            log.info(
                "upstream %r: replica %s is up (%d models)", self.spec.name, r.url, len(entries)
            )

    def _check_failed(self, r: _Replica, error: str) -> None:
        was = r.state
        r.state = "down"
        r.failures += 1
        r.last_error = error
        delay = self._backoff(r.failures)
        r.next_check = time.monotonic() + delay
        if was != "down":
            log.warning(
                "upstream %r: replica %s is down: %s (next check in %.1f s)",
                self.spec.name,
                r.url,
                error,
                delay,
            )

    # -- views -------------------------------------------------------------------------

    def models(self) -> tuple[str, ...]:
        """The configured models, else every id the replicas' last good listings had."""
        if self.spec.models:
            return self.spec.models
        return tuple(dict.fromkeys(m for r in self._replicas for m in r.models))

    def model_entries(self) -> dict[str, dict[str, Any]]:
        """The ``/v1/models`` entry per model id, from the first replica listing it."""
        out: dict[str, dict[str, Any]] = {}
        for r in self._replicas:
            for model, entry in r.entries.items():
                out.setdefault(model, entry)
        return out

    def status(self) -> list[ReplicaStatus]:
        now = time.monotonic()
        return [
            ReplicaStatus(
                url=r.url,
                state=r.state,
                outstanding=r.outstanding,
                failures=r.failures,
                last_error=r.last_error,
                next_check_in=None if r.next_check is None else max(0.0, r.next_check - now),
                models=r.models,
            )
            for r in self._replicas
        ]

    def affinity_view(self) -> dict[str, Any]:
        """The replicas' cache affinity for ``/v1/info``: on or off, its bound, how many
        conversations it pins, and its choices so far (``pinned``: the replica holding
        the conversation; ``hashed``: a new conversation's; ``moved``: elsewhere, the
        pinned one being down or full; ``unkeyed``: no conversation named, least busy)."""
        return {
            "enabled": self.keyed,
            "load_factor": self.affinity.load_factor,
            "conversations": self.affinity.conversations,
            "choices": self.affinity.stats(),
        }

    def state(self) -> Literal["unknown", "healthy", "degraded", "down"]:
        """``healthy`` (all), ``degraded`` (some down), ``down`` (all), else ``unknown``."""
        states = [r.state for r in self._replicas]
        if all(s == "down" for s in states):
            return "down"
        if "down" in states:
            return "degraded"
        if all(s == "healthy" for s in states):
            return "healthy"
        return "unknown"


class _BadListing(Exception):
    """A health check's answer is not a ``/v1/models`` list."""


def _model_entries(status: int, content: bytes) -> dict[str, dict[str, Any]]:
    """The entries of a ``/v1/models`` answer by id; :class:`_BadListing` if it is not one."""
    if status != 200:
        raise _BadListing(f"answered {status} to GET /v1/models")
    try:
        body = json.loads(content)
    except ValueError:
        raise _BadListing("answered GET /v1/models with what is not JSON") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise _BadListing("answered GET /v1/models without a 'data' list")
    return {e["id"]: e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)}
