"""The engine: one thread that owns the model runner, its KV cache and the slots.

Everyone else talks to it through commands on a thread-safe queue (add,
abort, stop); events go back to each request's sink, delivered once per step.

Backpressure: a request whose consumer has not taken ``stream_buffer`` steps
of output is paused (its sequences keep their slot, KV cache and sampled next
token, but are left out of the batch) until the consumer catches up; when
every active sequence is paused the thread sleeps until a command or a
consumer wakes it.

Example::

    engine = Engine(runner, EngineConfig(n_parallel=4, max_queue=16))
    engine.start()
    handle = engine.submit([EngineRequest(prompt_tokens=toks, max_tokens=16)], sink)
    ...
    engine.abort(handle)   # client went away: freed within one step
    engine.stop()
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import replace

from sluice.core.errors import (
    ContextOverflow,
    EngineFailure,
    InvalidRequest,
    ServerBusy,
    ShuttingDown,
    SluiceError,
)
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    FinishReason,
    Progress,
    TextDelta,
    TokenLogprob,
    Usage,
)
from sluice.engine.prompt_cache import (
    RESTORE_RATIO,
    CacheEntry,
    PromptCache,
    common_prefix,
)
from sluice.engine.reasoning import ReasoningTrack
from sluice.engine.runner import BatchEntry, DecodeError, ModelRunner
from sluice.engine.scheduler import Planned, PrefillPacer, SlotView, deferred, plan_batch
from sluice.engine.speculate import DraftPolicy, PromptLookup
from sluice.engine.text import Ready, SequenceText
from sluice.engine.types import EngineRequest, EventSink, SlotState
from sluice.engine.work import (
    WAKE,
    Abort,
    Add,
    EngineConfig,
    EngineStats,
    Slot,
    Stop,
    Wake,
    Work,
)

log = logging.getLogger("sluice.engine")


# When every active sequence is paused, the engine waits for a command or a
# consumer's wake-up; this bounds the wait in case a sink never wakes it.
_PAUSED_POLL = 0.1

# An idle engine handed work waits at most this long for the requests still being
# prepared (Engine.expect), so that a burst prefills in one step (see _gather).
_GATHER_SECONDS = 0.025

# A sequence whose client has more undelivered steps than this drafts nothing.
_DRAFT_BACKLOG = 2


class Arrival:
    """A request on its way to :meth:`Engine.submit` (template, tokens, sampler).

    Example::

        arrival = engine.expect()          # on the event loop, as the request comes in
        try:
            engine.submit(requests, sink)  # on a worker thread, once it is prepared
        finally:
            arrival.done()                 # idempotent: call it on every way out
    """

    __slots__ = ("_engine", "_open")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._open = True

    def done(self) -> None:
        """Submitted, failed or abandoned: the engine no longer waits for it."""
        engine = self._engine
        with engine._capacity_lock:
            if not self._open:
                return
            self._open = False
            engine._arriving -= 1
            last = engine._arriving == 0
        if last:  # ends a gather at once (otherwise a no-op command)
            engine._commands.put(WAKE)


class EngineHandle:
    """What :meth:`Engine.submit` returns: pass it to :meth:`Engine.abort`."""

    __slots__ = ("keys",)

    def __init__(self, keys: tuple[int, ...]) -> None:
        self.keys = keys


class Engine:
    """Continuous batching over a :class:`ModelRunner`: one decode per step."""

    def __init__(self, runner: ModelRunner, config: EngineConfig) -> None:
        self.runner = runner
        self.config = config
        n_slots = min(config.n_parallel, runner.n_seq_max)
        self._slots = [Slot(seq) for seq in range(n_slots)]
        self._commands: queue.SimpleQueue[Add | Abort | Stop | Wake] = queue.SimpleQueue()
        self._waiting: deque[Work] = deque()
        self._keys = itertools.count(1)
        self._admissions = itertools.count()
        self._capacity_lock = threading.Lock()
        self._in_flight = 0
        self._arriving = 0  # Arrivals not yet done (under _capacity_lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_error: SluiceError = ShuttingDown("The server is shutting down.")
        self._finished = False
        self._counters = {
            "steps": 0,
            "generated": 0,
            "prompt": 0,
            "cached": 0,
            "drafted": 0,
            "accepted": 0,
            "forced": 0,
            "closed": 0,
        }
        self._drafts = DraftPolicy()
        self._buffer = max(1, config.stream_buffer)
        self._resume_at = self._buffer // 2
        self._paused = 0  # works in slots with paused set
        self._cache = PromptCache(config.cache_ram_bytes, config.cache_min_tokens)
        self._pacer = PrefillPacer(
            config.prefill_budget,
            runner.n_batch,
            runner.min_prefill_chunk,
            config.prefill_chunk_seconds,
        )
        # The last step prefilled short prompts without the generating sequences:
        # this one must take them (see plan_batch's decode_may_wait).
        self._decode_sat_out = False
        self.stats = self._snapshot()

    # -- public API, any thread ---------------------------------------------

    @property
    def capacity(self) -> int:
        return len(self._slots) + self.config.max_queue

    @property
    def prompt_cache(self) -> PromptCache:
        """The RAM prompt cache: its ``size_bytes``, ``room`` and ``reclaim`` are safe
        from any thread; the rest is the engine thread's."""
        return self._cache

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self, error: SluiceError | None = None) -> None:
        """Refuse new work; in-flight requests end with ``error`` (default: ShuttingDown)."""
        if not self._stopping:
            if error is not None:
                self._stop_error = error
            self._stopping = True
            self._commands.put(Stop())

    def stop(self, timeout: float = 10.0, error: SluiceError | None = None) -> None:
        """:meth:`begin_shutdown`, then wait for the engine thread to end."""
        self.begin_shutdown(error)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def check_prompt(self, n_prompt: int, param: str = "messages") -> None:
        """Raise :class:`ContextOverflow` unless a prompt leaves room for a token."""
        if n_prompt >= self.runner.n_ctx_seq:
            raise ContextOverflow(n_prompt, self.runner.n_ctx_seq, param)
        if n_prompt == 0:
            raise InvalidRequest("The prompt is empty.", param=param)

    def submit(self, requests: list[EngineRequest], sink: EventSink) -> EngineHandle:
        """Queue sequences (all or none). Raises before anything is queued.

        Validation happens here, in the caller's thread, so that every error
        knowable before the first byte is raised before the response starts.
        """
        if self._stopping:
            raise self._stop_error
        for req in requests:
            self.check_prompt(len(req.prompt_tokens))
        if len(requests) > self.capacity:
            raise InvalidRequest(
                f"This request needs {len(requests)} sequences; the server holds at most "
                f"{self.capacity} ({len(self._slots)} slots + {self.config.max_queue} queued).",
                param="n",
            )
        with self._capacity_lock:
            if self._in_flight + len(requests) > self.capacity:
                raise ServerBusy(
                    f"All {len(self._slots)} slots and {self.config.max_queue} queue places "
                    "are taken; retry shortly.",
                )
            self._in_flight += len(requests)
        works: list[Work] = []
        try:
            now = time.monotonic()
            for req in requests:
                sampler = self.runner.new_sampler(req.sampling, req.text_tokens())
                work = Work(
                    req,
                    sink,
                    sampler,
                    next(self._keys),
                    SequenceText(req.stop, req.logprobs is not None),
                    now,
                )
                self._fewer_steps(work)
                if req.reasoning is not None:
                    work.reasoning = ReasoningTrack(req.reasoning)
                works.append(work)
        except Exception:
            for work in works:
                self.runner.free_sampler(work.sampler)
            self._release_capacity(len(requests))
            raise
        self._commands.put(Add(works))
        if self._finished:  # lost a race with shutdown: nobody will run these
            self._fail_leftovers(self._stop_error)
        return EngineHandle(tuple(w.key for w in works))

    def _fewer_steps(self, work: Work) -> None:
        """What ``work`` may use of speculation and jump-forward (caller's thread: the
        prompt's n-gram index is built here, not on the engine thread)."""
        sampling = work.req.sampling
        limit = self.config.max_draft if sampling.max_draft is None else sampling.max_draft
        work.max_draft = max(0, min(limit, self.config.max_draft)) if self.runner.can_rewind else 0
        if work.max_draft:
            work.lookup = PromptLookup(work.req.text_tokens())
        jump = self.config.jump_forward if sampling.jump_forward is None else sampling.jump_forward
        # A forced token has no logits of its own: with logprobs asked, each is sampled.
        work.jump = bool(jump and sampling.grammar and work.req.logprobs is None)

    def expect(self) -> Arrival:
        """Announce a request that will be submitted shortly (see :class:`Arrival`).

        Requests that come in together reach :meth:`submit` milliseconds apart
        (each is templated and tokenized first), and a step started on the
        first alone would hold the others for a whole prefill: an idle engine
        waits, briefly, for the announced ones.
        """
        with self._capacity_lock:
            self._arriving += 1
        return Arrival(self)

    def abort(self, handle: EngineHandle) -> None:
        """Drop these sequences wherever they are; their slots free in one step."""
        self._commands.put(Abort(handle.keys))

    # -- engine thread --------------------------------------------------------

    def _wake(self) -> None:
        """Any thread: a paused request's consumer caught up; plan again now."""
        self._commands.put(WAKE)

    def _run(self) -> None:
        try:
            ran = True
            while True:
                active = any(s.state is not SlotState.IDLE for s in self._slots)
                busy = active or bool(self._waiting)
                wait = not (busy and ran)
                if wait and self._save_idle():
                    wait = False  # one slot saved: look for commands before the next
                if wait:  # what /health shows while the engine waits
                    self.stats = self._snapshot()
                # 1. Commands: block only when there is nothing to compute. When every
                #    active sequence is paused, a consumer that catches up wakes us.
                if not self._drain(block=wait, timeout=_PAUSED_POLL if busy else None):
                    break
                if not active and self._waiting and not self._gather():
                    break
                # 2. Admit queued work into idle slots (prefix-cache aware), then publish
                #    the snapshot: one taken between a step that freed a slot and this
                #    admission would show the slot idle beside a queued request.
                self._admit()
                self.stats = self._snapshot()
                # 3. Keep the active sequences on the lowest sequence ids (see _compact).
                self._compact()
                # 4. One decode over every active sequence that is not paused, then sample.
                ran = self._step()
        except Exception as exc:  # pragma: no cover - last-resort guard
            log.exception("engine thread crashed")
            self._fail_all(EngineFailure(f"The engine stopped: {exc}"))
        else:
            self._fail_all(self._stop_error)
        finally:
            self._finished = True
            self._fail_leftovers(self._stop_error)
            self.stats = self._snapshot()

    def _drain(self, *, block: bool, timeout: float | None = None) -> bool:
        """Apply pending commands; False once told to stop."""
        if not block and self._commands.empty():  # every step: no exception to raise
            return True
        try:
            cmd = self._commands.get(block=block, timeout=timeout)
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Stop):
                return False
            if isinstance(cmd, Add):
                self._waiting.extend(cmd.works)
            elif isinstance(cmd, Abort):
                self._abort_keys(set(cmd.keys))
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _gather(self) -> bool:
        """An idle engine given work: wait for the requests still being prepared.

        At most ``_GATHER_SECONDS``, and only while some are announced and slots
        are left for them, so that a burst prefills in one step: on 2 cores, 4
        chat prompts of ~45 tokens took ~350 ms in one step, against ~400 ms
        to the last first token for the first alone and then the other three.
        A request that comes alone never waits (nothing else is announced).
        False once told to stop.
        """
        deadline = time.monotonic() + _GATHER_SECONDS
        while self._arriving > 0 and len(self._waiting) < len(self._slots):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not self._drain(block=True, timeout=left):
                return False
        return True

    def _abort_keys(self, keys: set[int]) -> None:
        for work in [w for w in self._waiting if w.key in keys]:
            self._waiting.remove(work)
            self._retire(work)
        for slot in self._slots:
            if slot.work is not None and slot.work.key in keys:
                self._free_slot(slot)

    def _admit(self) -> None:
        """Move waiting work into idle slots, reusing the longest cached prefix.

        The prefix comes from the idle slot that shares most with the prompt,
        or from the RAM prompt cache when an entry there shares enough more to
        be worth restoring (see prompt_cache.RESTORE_RATIO).
        """
        while self._waiting:
            idle = [s for s in self._slots if s.state is SlotState.IDLE]
            if not idle:
                break
            work = self._waiting.popleft()
            prompt = work.req.prompt_tokens
            # Reuse a cached prefix, but always leave at least one prompt token to
            # decode: its logits give the first sampled token. Echo with logprobs
            # needs every prompt token's logits: nothing is reused.
            limit = 0 if (work.req.echo and work.req.logprobs is not None) else len(prompt) - 1
            # 1. The idle slot with the longest common prefix (ties: the least to lose).
            slot = max(idle, key=lambda s: (common_prefix(s.cache, prompt), -len(s.cache)))
            want = work.req.media_floor(min(common_prefix(slot.cache, prompt), limit))
            # 2. A RAM entry that beats it by enough goes into the idle slot whose
            #    cache is the least to lose (whole, when the runner cannot cut a
            #    restored state short).
            hit = None
            if limit and self._cache.enabled:
                hit = self._cache.best(prompt[:limit], whole=not self.runner.trim_after_restore)
            restore = None
            if hit is not None:
                entry, n = hit  # n <= limit
                n = work.req.media_floor(n)  # (an image's rows are kept whole or not at all)
                gain = n - want
                if gain >= self._cache.min_tokens and gain * RESTORE_RATIO >= len(entry.tokens):
                    restore = entry
                    self._cache.used(entry)  # most recent now: the save below cannot evict it
                    # Into the lowest idle sequence when the runner wants them dense:
                    # _compact would otherwise save that slot anyway and then copy the
                    # whole restored state over it (measured: ~+15 ms for 2000 tokens).
                    slot = idle[0] if self.runner.dense_sequences else min(idle, key=_cached_len)
                    want = n
            # 3. What the slot held beyond the kept prefix is about to go: save it first.
            if restore is not None or want < len(slot.cache):
                self._save(slot)
            # 4. Restore the entry's state, then trim it (or the slot's own cache) to
            #    the common prefix.
            if restore is not None:
                want = work.req.media_floor(min(want, self._restore(slot, restore)))
            kept = self.runner.keep_prefix(slot.seq, want)
            slot.cache = prompt[:kept]
            work.prompt_done = work.cached = kept
            work.admitted_order = next(self._admissions)
            work.t_admit = time.monotonic()
            slot.work = work
            slot.state = SlotState.PREFILLING
            slot.unsaved = False
            self._counters["cached"] += kept
            # Prompt processing begins (LM Studio's prompt_processing.start).
            _deliver(
                work.sink, [Progress(work.req.choice, "prompt_processing", kept, len(prompt), kept)]
            )

    def _save_idle(self) -> bool:
        """While there is nothing to compute: one finished slot's KV into the prompt cache.

        A request admitted into that slot would otherwise save it first, in front of its
        own prefill (measured: 1.5-3 ms a slot beside the requests being prepared, so
        6-11 ms before a burst of 4 could start). One slot per call, so that a command
        that arrives meanwhile waits for one save at most. True if it saved one.
        """
        for slot in self._slots:
            if slot.unsaved and slot.state is SlotState.IDLE:
                slot.unsaved = False
                if self._save(slot):
                    return True
        return False

    def _save(self, slot: Slot) -> bool:
        """Keep an idle slot's KV state in the prompt cache before it is overwritten.

        False when the cache does not want it (too short, or held already).
        """
        if not self._cache.wants(slot.cache):
            return False
        started = time.perf_counter()
        state = self.runner.save_seq(slot.seq)
        if state:
            self._cache.put(slot.cache, state)
            log.debug(
                "prompt cache: saved %d tokens (%.1f MiB) in %.1f ms; %d entries, %.0f MiB",
                len(slot.cache),
                len(state) / 2**20,
                (time.perf_counter() - started) * 1000,
                len(self._cache),
                self._cache.size_bytes / 2**20,
            )
        return True

    def _restore(self, slot: Slot, entry: CacheEntry) -> int:
        """Load a prompt cache entry into a slot's sequence; how many tokens it now holds."""
        started = time.perf_counter()
        loaded = self.runner.load_seq(slot.seq, entry.state)
        if loaded != len(entry.tokens):
            log.warning(
                "prompt cache: restoring %d tokens into sequence %d failed (got %d); dropped",
                len(entry.tokens),
                slot.seq,
                loaded,
            )
            self._cache.discard(entry)
            self.runner.keep_prefix(slot.seq, 0)
            return 0
        log.debug(
            "prompt cache: restored %d tokens into sequence %d in %.1f ms",
            loaded,
            slot.seq,
            (time.perf_counter() - started) * 1000,
        )
        return loaded

    def _compact(self) -> None:
        """Move the highest active sequence into the lowest idle slot, until dense.

        llama.cpp splits a batch over per-sequence KV streams into one ubatch
        per run of consecutive sequence ids, so decoding seqs {0, 2, 5, 7}
        costs four graph runs where {0, 1, 2, 3} costs one (measured: -35%
        throughput at 4 streams). A move is a KV copy inside the next decode,
        far cheaper than the steps it saves.
        """
        if not self.runner.dense_sequences:
            return
        while True:
            idle = [s for s in self._slots if s.state is SlotState.IDLE]
            busy = [s for s in self._slots if s.state is not SlotState.IDLE]
            if not idle or not busy or idle[0].seq > busy[-1].seq:
                return
            dst, src = idle[0], busy[-1]
            self._save(dst)  # the move overwrites what the idle slot held
            self.runner.move_sequence(src.seq, dst.seq)
            dst.state, dst.cache, dst.work = src.state, src.cache, src.work
            src.state, src.cache, src.work = SlotState.IDLE, [], None
            dst.unsaved = src.unsaved = False

    def _step(self) -> bool:
        """One decode over the planned sequences; False if there was nothing to run."""
        views: list[SlotView] = []
        for s in self._slots:
            work = s.work
            if work is None:
                views.append(SlotView(s.seq, s.state))
                continue
            views.append(
                SlotView(
                    s.seq,
                    s.state,
                    len(work.req.prompt_tokens) - work.prompt_done,
                    work.admitted_order,
                    self._held(work),
                    len(work.req.prompt_tokens) - work.cached,
                    1 + len(work.forced),
                )
            )
        n_batch = self.runner.n_batch
        pacer = self._pacer
        plan = plan_batch(
            views,
            n_batch,
            pacer.budget(),
            n_batch,
            pacer.chunk(),
            pacer.max_chunk(),
            decode_may_wait=not self._decode_sat_out,
            tile=self.runner.min_prefill_chunk,
        )
        self._fit_images(plan)
        waited = deferred(views, plan, n_batch)
        self._decode_sat_out = any(p.short for p in plan) and not any(not p.prefill for p in plan)
        # Entries in sequence-id order: llama.cpp puts only increasing, consecutive
        # ids into one ubatch (see _compact).
        plan.sort(key=lambda p: p.seq)
        if not plan:
            return False
        self._plan_drafts(plan, n_batch)
        started = time.perf_counter()
        entries, rows = self._build_batch(plan)
        try:
            self.runner.decode(entries)
        except DecodeError as exc:
            log.error("decode failed: %s", exc)
            for p in plan:
                self._fail_slot(self._slots[p.seq], EngineFailure(f"Decoding failed: {exc}"))
            return True
        self._counters["steps"] += 1
        # One delivery per sink per step (the n choices of a response share one), so
        # a sink's backlog counts steps.
        outbox: dict[int, tuple[EventSink, list[Event]]] = {}
        for p, entry, row in zip(plan, entries, rows):
            self._after_decode(self._slots[p.seq], p, entry, row, outbox)
        for sink, events in outbox.values():
            _deliver(sink, events)
        # The whole step (decode, sampling, delivery) is what generating sequences wait.
        n_decoded = n_long = n_short = extra = 0
        for p, entry in zip(plan, entries):
            if not p.prefill:
                n_decoded += 1
                extra += len(entry.tokens) - 1
            elif p.short:
                n_short += p.n_tokens
            else:
                n_long += p.n_tokens
        seconds = time.perf_counter() - started
        pacer.observe(seconds, n_decoded, n_long, n_short, waited, extra=extra > 0)
        return True

    def _fit_images(self, plan: list[Planned]) -> None:
        """Prompt chunks cut at images: a chunk that reaches an image stops before it, and
        one that starts at an image is that image whole (its rows are decoded together,
        as embeddings, in a llama_decode of their own: ``LlamaRunner.decode``)."""
        for i, p in enumerate(plan):
            if not p.prefill:
                continue
            work = self._slots[p.seq].work
            assert work is not None
            if not work.req.media:
                continue
            start, n = work.prompt_done, p.n_tokens
            for span in work.req.media:
                if span.end <= start:
                    continue
                if span.start <= start:
                    n = span.end - start
                elif span.start < start + n:
                    n = span.start - start
                break
            if n != p.n_tokens:
                plan[i] = replace(p, n_tokens=n)

    def _plan_drafts(self, plan: list[Planned], n_batch: int) -> None:
        """Each generating sequence's draft for this step (see speculate.py): none in a
        step that prefills (its rows are the prompt's), within the batch, the context
        and the tokens the request has left, as long as the policy finds it pays."""
        decoding = [p for p in plan if not p.prefill]
        if len(decoding) < len(plan):
            return
        room = n_batch - sum(p.n_tokens for p in plan)
        share = 1.0
        if len(decoding) > 1:
            one, many = self._pacer.measured(1), self._pacer.measured(len(decoding))
            share = one / many if one and many else len(decoding) ** -0.5
        for p in decoding:
            work = self._slots[p.seq].work
            assert work is not None
            lookup = work.lookup
            # A client already behind gains nothing from a faster stream (and its
            # backpressure bound counts steps: drafts would put more tokens in each).
            if lookup is None or room <= 0 or work.sink.backlog() > _DRAFT_BACKLOG:
                continue
            cache = len(self._slots[p.seq].cache)
            limit = min(work.max_draft, room, self.runner.n_ctx_seq - cache - p.n_tokens - 1)
            if work.req.max_tokens is not None:  # the draft and the token after it
                limit = min(limit, work.req.max_tokens - work.generated - 1)
            left = work.reasoning.room() if work.reasoning is not None else None
            if left is not None:  # a draft never runs past a reasoning budget
                limit = min(limit, left - 1)
            draft = lookup.draft(limit)
            if not draft:
                continue
            k = self._drafts.length(work.acceptance.rate, len(draft), len(decoding), share)
            if k == 0:
                work.shadow = draft[0]  # checked against the token this step samples
                continue
            work.draft = draft[:k]
            room -= k

    def _held(self, work: Work) -> bool:
        """Backpressure: whether ``work`` sits out this step because its client is behind.

        Paused past ``stream_buffer`` undelivered steps, resumed at half of it,
        so a slow reader gets output in bursts rather than one wake-up per step.
        """
        backlog = work.sink.backlog()
        if work.paused:
            if backlog > self._resume_at:
                return True
            work.paused = False
            self._paused -= 1
            return False
        if backlog <= self._buffer:
            return False
        work.paused = True
        self._paused += 1
        work.sink.pause(self._resume_at, self._wake)
        return True

    def _build_batch(self, plan: list[Planned]) -> tuple[list[BatchEntry], list[int]]:
        entries: list[BatchEntry] = []
        rows: list[int] = []
        offset = 0
        for p in plan:
            slot = self._slots[p.seq]
            work = slot.work
            assert work is not None
            if p.prefill:
                start = work.prompt_done
                tokens = work.req.prompt_tokens[start : start + p.n_tokens]
                last = start + p.n_tokens == len(work.req.prompt_tokens)
                logits_all = work.req.echo and work.req.logprobs is not None
                image = None
                if work.req.media:
                    image = next((s for s in work.req.media if s.start == start), None)
                entries.append(BatchEntry(slot.seq, tokens, start, last, logits_all, media=image))
            else:
                assert work.next_token is not None
                tokens = [work.next_token, *work.forced, *work.draft]
                entries.append(
                    BatchEntry(
                        slot.seq, tokens, len(slot.cache), True, n_logits=1 + len(work.draft)
                    )
                )
            offset += len(tokens)
            rows.append(offset - 1)
        return entries, rows

    def _after_decode(
        self,
        slot: Slot,
        p: Planned,
        entry: BatchEntry,
        row: int,
        outbox: dict[int, tuple[EventSink, list[Event]]],
    ) -> None:
        work = slot.work
        assert work is not None
        events = outbox.setdefault(id(work.sink), (work.sink, []))[1]
        if not p.prefill:  # a draft's tokens join the cache as the sampler keeps them
            draft, work.draft, work.forced = work.draft, [], []
            slot.cache.extend(entry.tokens[: len(entry.tokens) - len(draft)])
            self._verify(slot, work, draft, row, entry.pos0 + len(entry.tokens), events)
            return
        slot.cache.extend(entry.tokens)
        if entry.logits_all:
            events.append(self._echo_logprobs(work, entry, row - len(entry.tokens) + 1))
        work.prompt_done += p.n_tokens
        self._counters["prompt"] += p.n_tokens
        total = len(work.req.prompt_tokens)
        events.append(
            Progress(work.req.choice, "prompt_processing", work.prompt_done, total, work.cached)
        )
        if work.prompt_done < total:
            return
        slot.state = SlotState.GENERATING
        work.t_first = time.monotonic()
        self._verify(slot, work, [], row, len(slot.cache), events)

    def _verify(
        self,
        slot: Slot,
        work: Work,
        draft: list[int],
        last_row: int,
        decoded: int,
        events: list[Event],
    ) -> None:
        """Sample the rows of a decoded sequence: the row of its last token, preceded by
        one row per drafted token. Each drafted token the sampler chooses in turn is
        kept (its KV is valid); the first it does not choose ends the draft, and the
        sampled token is the next one. The rows past what was kept leave the KV cache
        at once (``decoded``: the cache's length in llama.cpp after the decode), so no
        rejected token survives into a saved state. Then jump-forward: the tokens the
        grammar forces after the new token are output now and decoded with it."""
        first = last_row - len(draft)
        kept = 0
        for i in range(len(draft) + 1):
            token = self.runner.sample(work.sampler, first + i)
            if self._take(slot, work, token, first + i, 0, events):
                break
            if i < len(draft) and token == draft[i]:
                slot.cache.append(token)
                kept += 1
                continue
            if work.shadow is not None:
                work.acceptance.shadow(token == work.shadow)
                work.shadow = None
            work.next_token = token
            reasoning = work.reasoning
            if (
                reasoning is not None
                and reasoning.spent
                and self._close_reasoning(slot, work, reasoning, events)
            ):
                break
            if work.jump:
                self._jump(slot, work, events)
            break
        if draft:
            work.acceptance.observe(len(draft), kept)
            self._counters["drafted"] += len(draft)
            self._counters["accepted"] += kept
        if decoded > len(slot.cache):
            self._rewind(slot, work)

    def _rewind(self, slot: Slot, work: Work) -> None:
        """Drop a rejected draft's rows from the sequence's KV cache."""
        n = len(slot.cache)
        if self.runner.keep_prefix(slot.seq, n) == n:
            return
        # (can_rewind promised otherwise.) The cache is gone: the sequence cannot go on.
        slot.cache = []
        self.runner.keep_prefix(slot.seq, 0)
        if slot.work is work:
            self._fail_slot(slot, EngineFailure("The KV cache could not drop a rejected draft."))

    def _jump(self, slot: Slot, work: Work, events: list[Event]) -> None:
        """Jump-forward after ``work.next_token``: the tokens its grammar forces are
        output now (text, stop strings and limits as for sampled ones) and decoded
        with it in the next step, which then samples after the last of them."""
        req = work.req
        limit = self.runner.n_ctx_seq - len(slot.cache) - 2
        limit = min(limit, max(1, self.runner.n_batch // (2 * len(self._slots))))
        if req.max_tokens is not None:
            limit = min(limit, req.max_tokens - work.generated)
        forced = self.runner.force(work.sampler, limit - len(work.forced))
        self._force(slot, work, forced, events)

    def _force(self, slot: Slot, work: Work, tokens: list[int], events: list[Event]) -> bool:
        """Output ``tokens`` after ``work.next_token`` without sampling them (the sampler
        took them already); decoded with it in the next step. True if they ended it."""
        for token in tokens:
            self._counters["forced"] += 1
            work.forced.append(token)
            if self._take(slot, work, token, None, len(work.forced), events):
                return True
        return False

    def _close_reasoning(
        self, slot: Slot, work: Work, reasoning: ReasoningTrack, events: list[Event]
    ) -> bool:
        """The reasoning budget is spent: the family's closer comes next, forced (within
        what the request and the context have left). True if that ended the sequence."""
        closer = list(reasoning.limit.closer)
        reasoning.close()
        room = self.runner.n_ctx_seq - len(slot.cache) - 2
        if work.req.max_tokens is not None:
            room = min(room, work.req.max_tokens - work.generated)
        if not closer or len(closer) > room:
            return False
        if not self.runner.force_tokens(work.sampler, closer):
            log.warning("a reasoning budget's closer was refused by the sampler: not forced")
            return False
        self._counters["closed"] += 1
        reasoning.tokens += len(closer)
        return self._force(slot, work, closer, events)

    def _take(
        self,
        slot: Slot,
        work: Work,
        token: int,
        row: int | None,
        pending: int,
        events: list[Event],
    ) -> bool:
        """One output token (sampled from ``row``, or forced): its text, its stop
        strings and limits. True if it ended the sequence (the slot is then free).
        ``pending``: tokens before it not decoded yet (forced ones after next_token)."""
        runner = self.runner
        req = work.req
        work.generated += 1
        self._counters["generated"] += 1
        if work.lookup is not None:
            work.lookup.extend((token,))
        reasoning = work.reasoning
        if reasoning is not None and reasoning.active:
            reasoning.feed(runner.token_bytes(token, True))
        reason: FinishReason | None = None
        stop_hit: str | None = None
        if runner.is_eog(token) and not req.sampling.ignore_eos:
            reason = "stop"
        else:
            lp = None
            if req.logprobs is not None and row is not None:
                lp = runner.logprobs(row, token, req.logprobs)
            piece = runner.token_bytes(token, req.render_special)
            ready, stop_hit = work.text.feed_token(piece, lp)
            self._emit_text(work, ready, events)
            if stop_hit is not None:
                reason = "stop"
            elif (req.max_tokens is not None and work.generated >= req.max_tokens) or (
                len(slot.cache) + pending + 1 >= runner.n_ctx_seq  # no room to decode it
            ):
                reason = "length"
        if reason is None:
            return False
        if stop_hit is None:
            self._emit_text(work, work.text.flush(), events)
        events.append(Finish(req.choice, reason, self._usage(work), stop_hit))
        self._free_slot(slot)
        return True

    def _emit_text(self, work: Work, ready: Ready | None, events: list[Event]) -> None:
        if ready is None:
            return
        lps = tuple(ready.logprobs) if ready.logprobs is not None else None
        events.append(TextDelta(work.req.choice, ready.text, ready.tokens, lps))

    def _echo_logprobs(self, work: Work, entry: BatchEntry, first_row: int) -> TextDelta:
        """Prompt tokens with their logprobs (text completions with echo + logprobs).

        Row i of a chunk predicts the prompt token after it, so a chunk at
        ``pos0`` reports the tokens ``pos0+1 .. pos0+len`` (and token 0, which
        has no logprob, in the first chunk).
        """
        runner = self.runner
        prompt = work.req.prompt_tokens
        lps: list[TokenLogprob] = []
        if entry.pos0 == 0:
            piece = runner.token_bytes(prompt[0])
            lps.append(
                TokenLogprob(piece.decode("utf-8", "replace"), prompt[0], None, tuple(piece))
            )
        for i in range(len(entry.tokens)):
            pos = entry.pos0 + i + 1
            if pos >= len(prompt):
                break
            lps.append(runner.logprobs(first_row + i, prompt[pos], work.req.logprobs or 0))
        text = work.echo_utf8.feed(b"".join(runner.token_bytes(lp.token_id) for lp in lps))
        return TextDelta(work.req.choice, text, 0, tuple(lps), echo=True)

    def _usage(self, work: Work) -> Usage:
        now = time.monotonic()
        return Usage(
            work.req.choice,
            prompt_tokens=len(work.req.prompt_tokens),
            completion_tokens=work.generated,
            cached_tokens=work.cached,
            reasoning_tokens=work.reasoning.tokens if work.reasoning is not None else 0,
            prompt_ms=(work.t_first - work.t_admit) * 1000 if work.t_first else 0.0,
            generation_ms=(now - work.t_first) * 1000 if work.t_first else 0.0,
        )

    def _free_slot(self, slot: Slot) -> None:
        work = slot.work
        slot.work = None
        slot.state = SlotState.IDLE
        slot.unsaved = bool(slot.cache)
        if work is not None:
            if work.paused:  # (kept exact: a snapshot may come before the next step)
                work.paused = False
                self._paused -= 1
            self._retire(work)

    def _retire(self, work: Work) -> None:
        self.runner.free_sampler(work.sampler)
        self._release_capacity(1)

    def _release_capacity(self, n: int) -> None:
        with self._capacity_lock:
            self._in_flight -= n

    def _fail_slot(self, slot: Slot, error: Exception) -> None:
        work = slot.work
        if work is None:
            return
        # The KV cache of a failed sequence is unknown: forget it.
        self.runner.keep_prefix(slot.seq, 0)
        slot.cache = []
        _deliver(work.sink, [ErrorEvent(error)])
        self._free_slot(slot)

    def _fail_all(self, error: Exception) -> None:
        for slot in self._slots:
            self._fail_slot(slot, error)
        while self._waiting:
            work = self._waiting.popleft()
            _deliver(work.sink, [ErrorEvent(error)])
            self._retire(work)

    def _fail_leftovers(self, error: Exception) -> None:
        """Fail work still in the command queue once the engine thread is gone."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Add):
                for work in cmd.works:
                    _deliver(work.sink, [ErrorEvent(error)])
                    self._retire(work)

    def _snapshot(self) -> EngineStats:
        states = [s.state for s in self._slots]
        prefilling = states.count(SlotState.PREFILLING)
        generating = states.count(SlotState.GENERATING)
        return EngineStats(
            slots=len(self._slots),
            active=prefilling + generating,
            idle=states.count(SlotState.IDLE),
            queued=len(self._waiting),
            prefilling=prefilling,
            generating=generating,
            steps=self._counters["steps"],
            tokens_generated=self._counters["generated"],
            prompt_tokens_processed=self._counters["prompt"],
            cached_tokens=self._counters["cached"],
            paused=self._paused,
            prompt_cache_entries=len(self._cache),
            prompt_cache_bytes=self._cache.size_bytes,
            prompt_cache_hits=self._cache.hits,
            drafted_tokens=self._counters["drafted"],
            accepted_tokens=self._counters["accepted"],
            forced_tokens=self._counters["forced"],
            reasoning_closed=self._counters["closed"],
        )


def _cached_len(slot: Slot) -> int:
    return len(slot.cache)


def _deliver(sink: EventSink, events: list[Event]) -> None:
    if events:
        sink.put_many(events)
