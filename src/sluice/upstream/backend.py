"""Upstream models: an OpenAI-compatible server's model as a sluice backend.

Two ways through, both measured by the slot's metrics on the streaming path:

* :meth:`UpstreamModel.passthrough`: an OpenAI request to an OpenAI upstream
  (byte-exact passthrough). The body goes up with only ``model`` rewritten; the answer's
  bytes come back unchanged, whole SSE events at a time, while an
  incremental decoder taps them for the metrics without re-encoding.
* :meth:`UpstreamModel.open`: the backend protocol every other dialect uses.
  The request is encoded as an OpenAI body and the upstream's SSE is decoded
  into sluice's events (``codec.py``).

Example::

    slot = UpstreamSlot(spec, UpstreamPool(spec), metrics.slot(spec.name, "upstream"))
    await slot.start()
    model = slot.model("qwen")                 # an alias or an upstream model name
    stream = await model.open(request)         # or: await model.passthrough(path, raw, ...)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

from sluice.core.backend import Embeddings, StreamMeta
from sluice.core.errors import (
    SluiceError,
    UpstreamFailed,
    UpstreamMalformed,
    UpstreamUnavailable,
    as_sluice_error,
)
from sluice.core.events import ErrorEvent, Event, Finish, TextDelta
from sluice.core.interrupt import Interrupt
from sluice.core.request import GenerationRequest
from sluice.metrics import OpenAIChunkTap, RequestMeter, SlotMetrics
from sluice.upstream.affinity import affinity_key
from sluice.upstream.codec import (
    ChunkDecoder,
    error_from_response,
    stream_meta,
    upstream_body,
)
from sluice.upstream.config import UpstreamSpec
from sluice.upstream.pool import UpstreamPool, UpstreamResponse
from sluice.upstream.resume import (
    Continuation,
    Partial,
    Resumable,
    heal,
    partial_for,
    spliced_usage,
)
from sluice.upstream.sse import SSEDecoder

log = logging.getLogger("sluice.router")

# Upstream response headers a client may need; hop-by-hop and framing headers are the
# ASGI server's to set.
_FORWARDED = frozenset({"content-type", "cache-control", "retry-after", "x-request-id"})


def slot_header(slot: str, replica: str | None) -> str:
    """The ``x-sluice-slot`` value: which slot answered, and for an upstream, which replica."""
    return slot if replica is None else f"{slot}; replica={replica}"


class UpstreamSlot:
    """One ``[[upstreams]]`` entry: its replicas, the models it serves, its metrics."""

    def __init__(self, spec: UpstreamSpec, pool: UpstreamPool, metrics: SlotMetrics) -> None:
        self.spec = spec
        self.pool = pool
        self.metrics = metrics
        self._aliases = {alias.lower(): model for alias, model in spec.aliases.items()}

    @property
    def name(self) -> str:
        return self.spec.name

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def models(self) -> tuple[str, ...]:
        """The upstream's model names: configured, else what its replicas list."""
        return self.pool.models()

    def aliases_of(self, model: str) -> list[str]:
        return [a for a, m in self.spec.aliases.items() if m.lower() == model.lower()]

    def lookup(self, name: str) -> str | None:
        """The upstream model name for ``name`` (an alias or a model name, any case)."""
        key = name.lower()
        target = self._aliases.get(key)
        if target is not None:
            return target
        for model in self.models():
            if model.lower() == key:
                return model
        return None

    def entry(self, model: str) -> dict[str, Any]:
        """The upstream's ``/v1/models`` entry for ``model``: by id, else by one of the
        ``aliases`` an entry lists (sluice's own entries do)."""
        entries = self.pool.model_entries()
        entry = entries.get(model)
        if entry is not None:
            return entry
        key = model.lower()
        for candidate in entries.values():
            aliases = candidate.get("aliases")
            if isinstance(aliases, list) and key in (str(a).lower() for a in aliases):
                return candidate
        return {}

    def model(self, upstream_model: str) -> UpstreamModel:
        return UpstreamModel(self, upstream_model)


class UpstreamModel:
    """One model of an upstream slot: a backend, and the OpenAI passthrough."""

    def __init__(self, slot: UpstreamSlot, name: str) -> None:
        self.slot = slot
        self.name = name  # the upstream's own name for it

    async def open(self, request: GenerationRequest) -> UpstreamStream:
        path, body = upstream_body(request, self.name)
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        pool = self.slot.pool
        key = affinity_key(body) if pool.keyed else None
        response = await pool.send(path, raw, {"accept": "text/event-stream"}, key=key)
        try:
            if response.status != 200:
                content = await response.aread()
                raise error_from_response(response.status, content, response.headers)
        except BaseException:
            await response.aclose()
            raise
        meta = stream_meta(request, self.name, slot=self.slot.name, replica=response.replica)
        resume = None
        if self.slot.spec.failover and pool.size > 1:
            resume = Resume(pool, path, body, {"accept": "text/event-stream"}, key)
        return UpstreamStream(meta, response, ChunkDecoder(chat=request.is_chat), resume)

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens of ``request`` as the upstream counts them.

        OpenAI's API has no token count, so the request runs for one token and the
        upstream's usage says how long its templated prompt was (the prefill is the
        upstream's prompt cache's to keep for the request that follows).
        """
        stream = await self.open(dataclasses.replace(request, max_tokens=1, n=1))
        try:
            async for event in stream:
                if isinstance(event, ErrorEvent):
                    raise as_sluice_error(event.error)
                if isinstance(event, Finish) and event.usage is not None:
                    return event.usage.prompt_tokens
        finally:
            await stream.aclose()
        raise UpstreamMalformed(
            f"The upstream '{self.slot.name}' reported no usage, so its tokens cannot be counted."
        )

    async def embed(
        self, inputs: list[str] | list[list[int]], *, truncate: bool, dimensions: int | None
    ) -> Embeddings:
        """The upstream's ``/v1/embeddings`` for ``inputs`` (floats asked for; how an
        input over its window is handled is the upstream's, ``truncate`` aside)."""
        body: dict[str, Any] = {"model": self.name, "input": inputs, "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = dimensions
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        response = await self.slot.pool.send("/embeddings", raw, {"accept": "application/json"})
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        if response.status != 200:
            raise error_from_response(response.status, content, response.headers)
        try:
            answer = json.loads(content)
            data = sorted(answer["data"], key=lambda d: d["index"])
            vectors = np.asarray(
                [[float(x) for x in d["embedding"]] for d in data], dtype=np.float32
            )
            tokens = int((answer.get("usage") or {}).get("prompt_tokens") or 0)
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamMalformed(
                f"The upstream '{self.slot.name}' answered embeddings sluice cannot read: {exc}"
            ) from None
        if len(vectors) != len(inputs):
            raise UpstreamMalformed(
                f"The upstream '{self.slot.name}' answered {len(vectors)} embeddings "
                f"for {len(inputs)} inputs."
            )
        return Embeddings(vectors, tokens)

    async def passthrough(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        tap: type[OpenAIChunkTap] = OpenAIChunkTap,
        on_start: Callable[[Passthrough], None] | None = None,
        prefix: str = "/v1",
        key: str | None = None,
        key_ids: bool = False,
        resume: Mapping[str, Any] | None = None,
        resumable: Callable[[], Resumable] | None = None,
    ) -> Passthrough:
        """Send a body in the upstream's own dialect (``model`` already the upstream's
        name) and hand back the answer to forward unchanged. Errors before the first
        byte are raised. ``tap`` reads the dialect's events for the slot's metrics
        (:class:`~sluice.metrics.AnthropicEventTap` for Anthropic's Messages);
        ``on_start`` hears of the answer before it is sent (to list it in flight while
        the upstream has not answered yet, which may be the whole generation).
        ``key`` names the conversation for the replicas' cache affinity; with
        ``key_ids`` the answer's id names it too (``"r:<id>"``: a Responses
        ``previous_response_id`` then finds the replica that stored it). ``resume``:
        the body of an OpenAI chat or completions stream or of an Anthropic Messages
        stream (``path``), whose answer is then continued by another replica if this
        one drops it (``failover``, ``resume.py``); or of another dialect, whose
        partial ``resumable`` makes (``resume.ChatContinued``)."""
        pool = self.slot.pool
        meter = self.slot.metrics.request()
        meter.model = self.name  # usage is by the upstream's name for the model
        answer = Passthrough(tap(meter), self.slot.name, self.name)
        if resume is not None and self.slot.spec.failover and pool.size > 1:
            answer.resume = Resume(pool, path, resume, headers, key, resumable)
        if key is not None and key_ids and pool.keyed:
            answer.on_id = lambda response_id: pool.affinity.alias("r:" + response_id, key)
        if on_start is not None:
            on_start(answer)
        try:
            answer._response = await answer._interrupt.wait(
                lambda: pool.send(path, body, headers, prefix=prefix, key=key)
            )
        except BaseException as exc:
            answer._finish(error=isinstance(exc, SluiceError))
            raise
        return answer


class UpstreamStream:
    """The upstream's SSE as sluice events (the backend protocol's ``ResponseStream``).

    With ``resume``, an answer the upstream drops is continued by another replica
    (``resume.py``): its chunks go on through the same decoder, so the dialect's
    formatter sees one answer.
    """

    def __init__(
        self,
        meta: StreamMeta,
        response: UpstreamResponse,
        decoder: ChunkDecoder,
        resume: Resume | None = None,
    ) -> None:
        self.meta = meta
        self._response = response
        self._decoder = decoder
        self._resume = resume
        self._sent = 0  # a continuation's: tokens streamed before it (its usage is moved)
        self._skip = ""  # a continuation's: whitespace sent before it, not to repeat

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        partial = None if self._resume is None else Partial(chat=self._resume.chat)
        tried = {self._response.replica}
        while True:
            failure: UpstreamFailed | None = None
            decoded = self._decoded(partial is not None)
            try:
                async for event in decoded:
                    if isinstance(event, _Dropped):
                        failure = event.error
                        break
                    if partial is not None:
                        partial.add_event(event)
                    yield event
            finally:
                await decoded.aclose()
            if failure is None:
                return
            assert partial is not None and self._resume is not None
            found = await _continuing(self._resume, partial, failure, tried)
            if found is None:
                yield ErrorEvent(failure)
                return
            self._response, ask = found
            self._skip = ask.skip
            self._sent = partial.tokens

    async def _decoded(self, resumable: bool) -> AsyncGenerator[Event | _Dropped, None]:
        """One upstream stream's events; with ``resumable``, a drop before the answer
        finished is a :class:`_Dropped` rather than the error event."""
        sse = SSEDecoder()
        decoder = self._decoder
        try:
            async for chunk in self._response.aiter_raw():
                for message in sse.feed(chunk):
                    if message.data == "[DONE]":
                        if resumable and not decoder.finished:
                            yield _Dropped(UpstreamFailed("The upstream ended the answer early."))
                            return
                        for event in decoder.end():
                            yield event
                        return
                    if not message.data:
                        continue  # a comment (": ping") or an empty event
                    data = _json_value(message.data)
                    if not isinstance(data, dict):
                        yield ErrorEvent(_malformed(message.data))
                        return
                    usage = data.get("usage")
                    if self._sent and isinstance(usage, dict):
                        data["usage"] = spliced_usage(usage, self._sent)
                    for event in decoder.feed(data):
                        if self._skip and isinstance(event, TextDelta):
                            text, self._skip = heal(event.text, self._skip)
                            if not text:
                                continue
                            event = dataclasses.replace(event, text=text)
                        yield event
                        if isinstance(event, ErrorEvent):
                            return
        except SluiceError as exc:
            if (
                resumable
                and isinstance(exc, UpstreamFailed)
                and not isinstance(exc, UpstreamMalformed)
                and not decoder.finished
            ):
                yield _Dropped(exc)
                return
            yield ErrorEvent(exc)
            return
        if sse.pending() or (resumable and not decoder.finished):
            error = UpstreamFailed("The upstream cut the stream in the middle of an event.")
            yield _Dropped(error) if resumable else ErrorEvent(error)
            return
        for event in decoder.end():  # a clean end without [DONE] (some servers' schema)
            yield event

    async def aclose(self) -> None:
        await self._response.aclose()


async def _continuing(
    resume: Resume, partial: Resumable, failure: UpstreamFailed, tried: set[str]
) -> tuple[UpstreamResponse, Continuation] | None:
    """Another replica's stream continuing ``partial`` (one not in ``tried``, then added
    to it), and what asked for it (``resume.Continuation``); None when the answer cannot
    be continued or no replica answers 200."""
    while len(tried) < resume.pool.size:
        ask = partial.continuation(resume.body)
        if ask is None:
            return None
        raw = orjson.dumps(ask.body)
        path, headers = ask.path or resume.path, ask.headers or resume.headers
        try:
            response = await resume.pool.send(
                path, raw, headers, prefix=ask.prefix, key=resume.key, exclude=tried
            )
        except (UpstreamFailed, UpstreamUnavailable):
            return None  # no replica left to ask
        tried.add(response.replica)
        if response.status == 200:
            log.warning(
                "upstream %r: a stream failed after %d tokens (%s); %s continues it",
                resume.pool.spec.name,
                partial.tokens,
                failure.message,
                response.replica,
            )
            return response, ask
        await response.aclose()
    return None


@dataclass(frozen=True, slots=True)
class _Dropped:
    """An upstream stream that broke off before its answer finished (not an event)."""

    error: UpstreamFailed


def _malformed(data: str) -> UpstreamMalformed:
    shown = data if len(data) <= 80 else data[:77] + "..."
    return UpstreamMalformed(f"The upstream sent an event that is not an OpenAI chunk: {shown!r}")


@dataclass(frozen=True, slots=True)
class Resume:
    """What a passthrough needs to have its answer continued by another replica: the
    request as it went up (an OpenAI chat or completions streaming body, or an
    Anthropic Messages one: ``path`` says; or another dialect's, whose partial
    ``resumable`` makes) and where."""

    pool: UpstreamPool
    path: str
    body: Mapping[str, Any]
    headers: Mapping[str, str] | None
    key: str | None
    resumable: Callable[[], Resumable] | None = None

    @property
    def chat(self) -> bool:
        return self.path == "/chat/completions"

    def partial(self) -> Resumable:
        """A new partial for the answer (fed every event the client gets)."""
        return self.resumable() if self.resumable is not None else partial_for(self.path)


@dataclass(slots=True)
class Passthrough:
    """An upstream's answer being forwarded unchanged, tapped for the slot's metrics.

    ``status``/``headers`` go out as they came (plus the slot header); then
    :meth:`stream` (a 200 SSE answer) or :meth:`read` (anything else). A
    failure after the first byte is raised from :meth:`stream` once every
    whole event before it has been yielded: the caller ends the stream with
    its dialect's error frame.

    It is a request in flight too (``models/flights.py``): named by the id the
    upstream gives it (read by the tap), ``queued`` until its first token, and
    :meth:`cancel` ends it with an error at once.
    """

    tap: OpenAIChunkTap
    slot: str
    model: str
    _response: UpstreamResponse | None = None  # once the upstream has answered
    on_end: Callable[[], None] | None = None  # called once, when the answer ends
    on_id: Callable[[str], None] | None = None  # hears the answer's id (the tap's)
    flight: Any = None  # its entry among the requests in flight
    resume: Resume | None = None  # set: a dropped stream is continued elsewhere
    _done: bool = field(default=False, init=False)
    _interrupt: Interrupt = field(default_factory=Interrupt, init=False)
    _relay: Relay | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tap.on_id = self._named

    @property
    def meter(self) -> RequestMeter:
        return self.tap.meter

    @property
    def response(self) -> UpstreamResponse:
        assert self._response is not None, "not sent yet"
        return self._response

    @property
    def replica(self) -> str | None:
        return None if self._response is None else self._response.replica

    @property
    def state(self) -> Literal["queued", "generating"]:
        return "generating" if self.tap.meter.started else "queued"

    @property
    def prompt_tokens(self) -> int:
        return self.tap.prompt_tokens or 0

    def cancel(self, error: SluiceError) -> bool:
        """End the answer with ``error`` (raised from :meth:`stream` or :meth:`read`, or
        the end of its :meth:`relay`)."""
        if self._done or not self._interrupt.fire(error):
            return False
        if self._relay is not None:
            self._relay.settle(error)
        return True

    @property
    def relayable(self) -> bool:
        r"""Its events can be :meth:`relay`\ ed: an SSE stream."""
        return self.streaming

    def relay(self, write: Callable[[bytes], None]) -> Relay:
        """Its whole SSE events, byte for byte, handed to ``write`` by the upstream
        connection's own callback as they arrive (what :meth:`stream` yields, without a
        task switch per event: a gateway's per-event cost). See :class:`Relay`."""
        assert self.relayable and self._relay is None
        if self._interrupt.error is not None:
            raise self._interrupt.error
        relay = self._relay = Relay(self, write)
        self.response.relay(relay.feed, relay.end)
        return relay

    def _named(self, response_id: str) -> None:
        if self.flight is not None:
            self.flight.registry.rename(self.flight, response_id)
        if self.on_id is not None:
            self.on_id(response_id)

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def streaming(self) -> bool:
        content_type = self.response.headers.get("content-type", "")
        return self.response.status == 200 and content_type.startswith("text/event-stream")

    def headers(self) -> dict[str, str]:
        out = {k: v for k, v in self.response.headers.items() if k.lower() in _FORWARDED}
        out["x-sluice-slot"] = slot_header(self.slot, self.response.replica)
        return out

    async def read(self) -> bytes:
        """The whole (non-streaming) body, unchanged."""
        try:
            body = await self._interrupt.wait(self.response.aread)
        except SluiceError:
            self._finish(error=True)
            raise
        if self.response.status == 200:
            data = _json_value(body)
            if isinstance(data, dict):
                self.tap.body(data)
            elif isinstance(data, list):  # Gemini's stream as one JSON array: its records
                for record in data:
                    if isinstance(record, dict):
                        self.tap.chunk(record)
        self._finish(error=self.response.status >= 500)
        return body

    async def _read(self) -> bytes:
        """The body's next bytes as they arrive (b"" at its end); a cancelled request
        ends the wait with its error. On the per-event path: no coroutine of the
        interrupt's own, it is told who waits (``Interrupt.waiting``)."""
        interrupt = self._interrupt
        if interrupt.error is not None:
            raise interrupt.error
        task = interrupt.waiting = asyncio.current_task()
        try:
            return await self.response.read_some()
        except asyncio.CancelledError:
            if interrupt.claims(task):
                raise interrupt.error from None  # type: ignore[misc]
            raise
        finally:
            interrupt.waiting = None

    async def stream(self) -> AsyncIterator[bytes]:
        """Whole SSE events, byte for byte, as they arrive. With :attr:`resume` set, an
        answer the upstream drops is continued by another replica (``resume.py``)."""
        sse = SSEDecoder()
        tap = self.tap
        finished = False  # [DONE] or a finish_reason seen: a clean end is then complete
        partial = None if self.resume is None else self.resume.partial()
        try:
            try:
                while chunk := await self._read():
                    out: list[bytes] = []
                    for message in sse.feed(chunk):
                        data = message.data
                        if data == "[DONE]":
                            finished = True
                        elif data:
                            parsed = _json_object(data)
                            if parsed is None:
                                if out:
                                    yield b"".join(out)
                                raise _malformed(data)
                            finished = tap.event(parsed) or finished
                            if partial is not None:
                                partial.add_chunk(parsed)
                        out.append(message.raw)
                    if out:
                        yield out[0] if len(out) == 1 else b"".join(out)
                if sse.pending() or not finished:
                    raise UpstreamFailed("The upstream ended the stream before finishing it.")
            except UpstreamFailed as exc:
                if partial is None or finished or isinstance(exc, UpstreamMalformed):
                    raise
                async for piece in self._continued(exc, partial):
                    yield piece
        except SluiceError:
            self._finish(error=True)
            raise
        self._finish(error=False)

    async def _continued(self, failure: UpstreamFailed, partial: Resumable) -> AsyncIterator[bytes]:
        """The rest of a dropped answer from other replicas, spliced on as one stream by
        the dialect's splice (``resume.py``: an OpenAI chunk renamed to the first
        answer's id, an Anthropic event renumbered to its blocks; usage the whole
        answer's), tapped and re-encoded. Raises ``failure`` when no replica can
        continue it."""
        resume = self.resume
        assert resume is not None
        tried = {self.response.replica}
        while True:
            ask = functools.partial(_continuing, resume, partial, failure, tried)
            found = await self._interrupt.wait(ask)
            if found is None:
                break
            self._response, asked = found
            splice = partial.splice(asked)
            sse = SSEDecoder()
            finished = False
            try:
                while chunk := await self._read():
                    out: list[bytes] = []
                    for message in sse.feed(chunk):
                        data = message.data
                        if data == "[DONE]":
                            finished = True
                            last, trailer = splice.done()
                            for event in last:
                                self.tap.event(event)
                                out.append(splice.encode(event))
                            out.append(trailer)
                            continue
                        if not data:
                            continue
                        parsed = _json_object(data)
                        if parsed is None:
                            raise _malformed(data)
                        for event in splice.events(parsed):
                            finished = self.tap.event(event) or finished
                            out.append(splice.encode(event))
                    if out:
                        yield b"".join(out)
                if not sse.pending() and finished:
                    return
                failure = UpstreamFailed("The upstream ended the stream before finishing it.")
            except UpstreamFailed as exc:
                if finished or isinstance(exc, UpstreamMalformed):
                    raise
                failure = exc
        raise failure

    async def stream_array(self) -> AsyncIterator[bytes]:
        """A JSON array sent as a stream (Gemini's ``streamGenerateContent`` without
        ``alt=sse``): its bytes as they arrive, each top-level record tapped once whole."""
        split = ArraySplitter()
        try:
            while chunk := await self._read():
                for record in split.feed(chunk):
                    data = _json_value(record)
                    if isinstance(data, dict):
                        self.tap.chunk(data)
                yield chunk
            if not split.closed:
                raise UpstreamFailed("The upstream ended the stream before finishing it.")
        except SluiceError:
            self._finish(error=True)
            raise
        self._finish(error=False)

    def _finish(self, *, error: bool) -> None:
        if not self._done:
            self._done = True
            self.tap.finish(error=error)
            if self.on_end is not None:
                self.on_end()

    async def aclose(self) -> None:
        """Close the upstream request (at once, if the client went away first)."""
        self.close()

    def close(self) -> None:
        """:meth:`aclose` without a wait: a stream's end runs it inline, not as a task."""
        self._finish(error=False)
        if self._response is not None:
            self._response.close()


class Relay:
    """A passthrough's events on their way from the upstream's socket to the client's:
    each chunk is decoded where the connection receives it, tapped for the metrics, and
    its whole events written at once (``write``: the client's transport); a partial event
    waits for its end, so an error frame never lands inside one.

    ``done`` resolves once: None at the stream's clean end, or the error that ends it
    (the upstream dropped it, sent a malformed event, ended early; a cancel), the
    events before it written. :meth:`pause` and :meth:`resume` stop and restart the
    upstream's socket (a client that reads slowly).
    """

    __slots__ = ("_answer", "_finished", "_partial", "_sse", "_write", "done", "resumable")

    def __init__(self, answer: Passthrough, write: Callable[[bytes], None]) -> None:
        self._answer = answer
        self._write = write
        self._sse = SSEDecoder()
        self._finished = False  # the answer's end seen ([DONE], a finish, message_stop)
        # With failover: what was sent, for another replica to continue from.
        resume = answer.resume
        self._partial = None if resume is None else resume.partial()
        self.done: asyncio.Future[SluiceError | None] = asyncio.get_running_loop().create_future()
        # The stream dropped before its end, and another replica may continue it
        # (:meth:`continued`): ``done`` then holds the failure.
        self.resumable = False

    def feed(self, data: bytes) -> None:
        if self.done.done():
            return
        sse = self._sse
        # The common chunk, whole one-line `data:` events with LF endings, is split here
        # without the decoder's messages (a gateway's every event passes this way).
        if sse.between_events() and data.endswith(b"\n\n") and b"\r" not in data:
            events = data.split(b"\n\n")
            events.pop()
            if all(e.startswith(b"data: ") and b"\n" not in e for e in events):
                for i, event in enumerate(events):
                    if not self._data(event[6:]):
                        self._end_malformed(b"".join(e + b"\n\n" for e in events[:i]), event[6:])
                        return
                self._write(data)
                return
        try:
            messages = sse.feed(data)
        except UpstreamMalformed as exc:
            self.settle(exc)
            return
        out: list[bytes] = []
        for message in messages:
            text = message.data.encode()
            if not self._data(text):
                self._end_malformed(b"".join(out), text)
                return
            out.append(message.raw)
        if out:
            self._write(out[0] if len(out) == 1 else b"".join(out))

    def _data(self, text: bytes) -> bool:
        """One event's data, tapped; False when it is not an OpenAI chunk."""
        if text == b"[DONE]":
            self._finished = True
        elif text:
            parsed = _json_object(text)
            if parsed is None:
                return False
            self._finished = self._answer.tap.event(parsed) or self._finished
            if self._partial is not None:
                self._partial.add_chunk(parsed)
        return True

    def _end_malformed(self, before: bytes, text: bytes) -> None:
        """The events ahead of a malformed one written, and the relay ended with it."""
        if before:
            self._write(before)
        self.settle(_malformed(text.decode("utf-8", "replace")))

    def end(self, error: UpstreamFailed | None) -> None:
        if error is None and (self._sse.pending() or not self._finished):
            error = UpstreamFailed("The upstream ended the stream before finishing it.")
        if error is not None and self._partial is not None and not self._finished:
            if not self.done.done():
                self.resumable = True  # the metering ends with the continuation
                self.done.set_result(error)
            return
        self.settle(error)

    def settle(self, error: SluiceError | None) -> None:
        if not self.done.done():
            self.done.set_result(error)
            self._answer._finish(error=error is not None)

    async def continued(self) -> AsyncIterator[bytes]:
        """The rest of a :attr:`resumable` stream from other replicas, one piece at a
        time (``Passthrough._continued``); raises the failure when none can continue."""
        failure = self.done.result()
        assert self.resumable and isinstance(failure, UpstreamFailed)
        assert self._partial is not None
        answer = self._answer
        answer.response.close()  # the dropped one: its replica's count goes down
        try:
            async for piece in answer._continued(failure, self._partial):
                yield piece
        except SluiceError:
            answer._finish(error=True)
            raise
        answer._finish(error=False)

    def pause(self) -> None:
        self._answer.response.pause()

    def resume(self) -> None:
        self._answer.response.resume()


class ArraySplitter:
    """The top-level objects of a JSON array fed in pieces, each as its bytes once whole;
    ``closed`` once the array's closing bracket came.

    >>> s = ArraySplitter()
    >>> s.feed(b'[{"a": "}"}, {"b"'), s.feed(b': [1]}]'), s.closed
    ([b'{"a": "}"}'], [b'{"b": [1]}'], True)
    """

    def __init__(self) -> None:
        self.depth = 0
        self.closed = False
        self._string = False
        self._escape = False
        self._record = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        for b in data:
            if self.depth > 1:
                self._record.append(b)
            if self._string:
                if self._escape:
                    self._escape = False
                elif b == 0x5C:  # backslash
                    self._escape = True
                elif b == 0x22:  # quote
                    self._string = False
            elif b == 0x22:
                self._string = True
            elif b in (0x7B, 0x5B):  # { [
                self.depth += 1
                if self.depth == 2:
                    self._record = bytearray((b,))
            elif b in (0x7D, 0x5D):  # } ]
                self.depth -= 1
                if self.depth == 1:
                    out.append(bytes(self._record))
                elif self.depth == 0:
                    self.closed = True
        return out


def _json_value(data: str | bytes) -> Any:
    try:
        return orjson.loads(data)  # a third of the stdlib's time on an event
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)  # what orjson refuses: NaN, integers past 64 bits
    except ValueError:
        return None


def _json_object(data: str | bytes) -> dict[str, Any] | None:
    parsed = _json_value(data)
    return parsed if isinstance(parsed, dict) else None


def upstream_context(entry: dict[str, Any]) -> int | None:
    """An upstream ``/v1/models`` entry's context window, where its server says it:
    vLLM's ``max_model_len``, llama-server's and sluice's ``meta``, LM Studio's
    ``max_context_length``."""
    meta = entry.get("meta")
    if not isinstance(meta, dict):
        meta = {}
    for value in (
        entry.get("max_model_len"),
        entry.get("context_length"),
        entry.get("max_context_length"),
        meta.get("n_ctx"),
        meta.get("n_ctx_train"),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
