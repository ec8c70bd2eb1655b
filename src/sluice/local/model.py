"""The local backend: one GGUF model on llama.cpp behind the request seam.

A :class:`LocalModel` owns a runner (weights + context), the engine thread
that decodes on it, and the completion service that turns a neutral request
into engine requests. Templates, tokenization and sampler/grammar set-up run
on the shared worker threads (``Offload``), never on the event loop.

Example::

    model = LocalModel.load(spec, options, settings, offload, progress=print)  # blocking
    stream = await model.open(GenerationRequest(messages=[...]))
    ...
    model.close()   # in-flight requests end with a ModelUnloaded error frame
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice.config import Settings
from sluice.core.backend import Embeddings, LoadOptions, MemoryRoom, Progress, StreamMeta
from sluice.core.errors import InsufficientMemory, InvalidRequest, ModelUnloaded, SluiceError
from sluice.core.events import Event
from sluice.core.model import ModelSpec
from sluice.core.request import LLAMA_CPP_SAMPLING, GenerationRequest, SamplerDefaults
from sluice.engine.engine import Engine
from sluice.engine.replay import ReplayRunner
from sluice.engine.runner import Embedder, ModelRunner
from sluice.engine.work import EngineConfig, EngineStats
from sluice.local.budget import ReasoningBudgets
from sluice.local.completions import CompletionService, Generation, ServiceOptions
from sluice.local.offload import Offload
from sluice.local.plan import ToolLimits
from sluice.local.stream import EventStream
from sluice.local.templates import ChatTemplate, read_template
from sluice.parsers.analysis import analyze

log = logging.getLogger("sluice.models")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """A model's effective load settings: its spec's values, else the server's."""

    ctx: int
    parallel: int
    batch: int
    threads: int
    gpu_layers: int
    flash_attn: str
    chat_template: str | None
    tool_format: str | None
    sampling: tuple[tuple[str, float], ...] = ()  # the config entry's default sampling

    @classmethod
    def of(cls, spec: ModelSpec, options: LoadOptions, settings: Settings) -> ModelSettings:
        def pick(*values: Any) -> Any:
            return next(v for v in values if v is not None)

        return cls(
            ctx=pick(options.ctx, spec.ctx, settings.ctx),
            parallel=pick(options.parallel, spec.parallel, settings.parallel),
            batch=settings.batch,
            threads=pick(spec.threads, settings.threads),
            gpu_layers=pick(spec.gpu_layers, settings.gpu_layers),
            flash_attn=settings.flash_attn,
            chat_template=spec.chat_template or settings.chat_template,
            tool_format=spec.tool_format or settings.tool_format,
            sampling=spec.sampling,
        )


def _end_of_turn(template: str | None, name: str) -> str:
    """The markup that ends an assistant turn in ``template`` (a replay model's EOG)."""
    if not template:
        return ""
    chat = ChatTemplate(template, bos_token="", eos_token="", model_id=name)
    return analyze(chat.render_probe, template).end_of_turn


def shorten(vectors: npt.NDArray[np.float32], dimensions: int | None) -> npt.NDArray[np.float32]:
    """Each row's first ``dimensions`` values, normalized again (Matryoshka-style)."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    head = vectors[:, :dimensions].astype(np.float64)
    norms = np.linalg.norm(head, axis=1, keepdims=True)
    return (head / np.where(norms > 0, norms, 1.0)).astype(np.float32)


class LocalStream:
    """A :class:`~sluice.core.backend.ResponseStream` over the local engine."""

    def __init__(self, meta: StreamMeta, events: AsyncIterator[Event], stream: EventStream) -> None:
        self.meta = meta
        self._events = events
        self._stream = stream

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events

    async def aclose(self) -> None:
        self._stream.close()
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()


def service_options(
    settings: Settings, tool_format: str | None, sampler: SamplerDefaults = LLAMA_CPP_SAMPLING
) -> ServiceOptions:
    return ServiceOptions(
        sampler=sampler,
        budgets=ReasoningBudgets.from_settings(settings),
        default_max_tokens=settings.default_max_tokens,
        tool_format=tool_format,
        prompt_special_tokens=settings.prompt_special_tokens,
        tool_limits=ToolLimits(
            max_tools=settings.max_tools,
            max_schema_bytes=settings.max_schema_bytes,
        ),
    )


class LocalModel:
    """One loaded model: runner, engine thread, completion service."""

    def __init__(
        self,
        name: str,
        runner: ModelRunner,
        settings: Settings,
        offload: Offload,
        *,
        model_settings: ModelSettings | None = None,
        load_seconds: float | None = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.offload = offload
        self.model_settings = model_settings
        self.load_seconds = load_seconds
        self.engine = Engine(
            runner,
            EngineConfig(
                n_parallel=model_settings.parallel if model_settings else settings.parallel,
                max_queue=settings.queue,
                stream_buffer=settings.stream_buffer,
                cache_ram_bytes=max(0, settings.cache_ram_mb) << 20,
                prefill_budget=settings.prefill_budget,
                max_draft=max(0, settings.max_draft),
                jump_forward=settings.jump_forward,
            ),
        )
        info = runner.info
        template = ChatTemplate(
            info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token, model_id=name
        )
        tool_format = model_settings.tool_format if model_settings else settings.tool_format
        # A field a request leaves out: the config entry's, else the GGUF's, else llama.cpp's.
        self.sampler = SamplerDefaults.declared(
            info.sampling, model_settings.sampling if model_settings else ()
        )
        self.service = CompletionService(
            name, self.engine, template, service_options(settings, tool_format, self.sampler)
        )
        # Work on worker threads that uses the runner (templates, tokenization,
        # sampler set-up): close() waits for it before freeing the model.
        self._lock = threading.Condition()
        self._embed_lock = threading.Lock()
        self._embedder: Embedder | None = None  # the pooled context, on first use
        self._embedding_ctx = settings.embedding_ctx  # its tokens, within the model's
        self._embedder_making = 0  # its bytes while it is being made (counted as held)
        self._grammar_making = 0  # the grammar tokenizer's, likewise
        self._grammar_lock = threading.Lock()
        self._room: MemoryRoom | None = None  # the shared memory budget, once bound
        self._using = 0
        self._closed = False
        self.engine.start()

    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        options: LoadOptions,
        settings: Settings,
        offload: Offload,
        progress: Progress | None = None,
    ) -> LocalModel:
        """Load ``spec`` with llama.cpp (blocking; run it off the event loop).

        ``spec.source`` is the .gguf file (``catalog.resolved(spec)``)."""
        from sluice.engine.llama_runner import LlamaRunner, LlamaRunnerConfig

        ms = ModelSettings.of(spec, options, settings)
        template = read_template(ms.chat_template) if ms.chat_template else None
        started = time.perf_counter()
        if spec.replay is not None:
            replay = ReplayRunner.from_file(
                spec.replay,
                template,
                model_id=spec.name,
                n_ctx=ms.ctx,
                n_parallel=ms.parallel,
                n_batch=ms.batch,
                end_of_turn=(_end_of_turn(template, spec.name),),
            )
            seconds = time.perf_counter() - started
            return cls(
                spec.name, replay, settings, offload, model_settings=ms, load_seconds=seconds
            )
        runner = LlamaRunner.load(
            LlamaRunnerConfig(
                model_path=spec.source,
                model_id=spec.name,
                n_parallel=ms.parallel,
                n_ctx=ms.ctx,
                n_batch=ms.batch,
                n_threads=ms.threads,
                n_gpu_layers=ms.gpu_layers,
                flash_attn=ms.flash_attn,
                chat_template=template,
                mmproj_path=spec.mmproj,
            ),
            progress,
        )
        seconds = time.perf_counter() - started
        return cls(spec.name, runner, settings, offload, model_settings=ms, load_seconds=seconds)

    # -- the backend protocol -------------------------------------------------

    async def open(self, request: GenerationRequest) -> LocalStream:
        loop = asyncio.get_running_loop()
        service = self.service
        arrival = self.engine.expect()  # a burst of requests prefills together

        def prepare() -> tuple[Generation, EventStream]:
            try:
                with self._in_use():
                    gen = service.prepare(request)
                    if any(r.sampling.grammar for r in gen.requests):
                        with self._grammar_room():
                            return gen, service.open(gen, loop)
                    return gen, service.open(gen, loop)
            finally:
                arrival.done()

        try:
            gen, stream = await self.offload.run(prepare, on_abandon=lambda r: r[1].close())
        finally:
            arrival.done()  # never prepared (cancelled in the queue)
        return LocalStream(gen.meta, service.events(gen, stream), stream)

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The tokens of ``request``'s templated prompt (tools included), as
        :meth:`open` would prefill them; a prompt over the context is counted too."""
        service = self.service

        def count() -> int:
            with self._in_use():
                return len(service.chat_prompt(request)[1])  # (images' rows included)

        return int(await self.offload.run(count))

    async def embed(
        self, inputs: list[str] | list[list[int]], *, truncate: bool, dimensions: int | None
    ) -> Embeddings:
        """Embed on the model's pooled context (made on first use, beside the
        generation context): tokenized and decoded on a thread of the default
        executor, concurrent requests decoded together (``EmbedBatcher``)."""

        def run() -> Embeddings:
            with self._in_use():
                embedder = self._embedder_now()
                batch = [self._embed_tokens(x) for x in inputs]
                window = embedder.n_ctx
                if truncate:
                    batch = [tokens[:window] for tokens in batch]
                for i, tokens in enumerate(batch):
                    if len(tokens) > window:
                        raise InvalidRequest(
                            f"input {i} is {len(tokens)} tokens; this model embeds at most "
                            f"{window} at once",
                            param="input",
                        )
                vectors = embedder.embed(batch)
            rows = np.asarray(vectors, dtype=np.float32).reshape(len(batch), -1)
            return Embeddings(shorten(rows, dimensions), sum(len(t) for t in batch))

        # Not on the prepare workers: a long batch would hold one while chat requests
        # wait to be prepared, and concurrent requests must reach the batcher together.
        return await asyncio.to_thread(run)

    def _embed_tokens(self, value: str | list[int]) -> list[int]:
        if isinstance(value, str):
            return self.runner.tokenize(value, add_special=True, parse_special=False)
        bad = next((t for t in value if not 0 <= t < self.runner.n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of range", param="input")
        return list(value)

    def _embedder_now(self) -> Embedder:
        with self._embed_lock:
            if self._embedder is None:
                n_ctx = min(self.runner.n_ctx_seq, max(1, self._embedding_ctx))
                self._make_room(self.runner.embedder_bytes(n_ctx))
                try:
                    self._embedder = self.runner.new_embedder(n_ctx)
                finally:
                    self._embedder_making = 0
                log.info(
                    "'%s' embeds: %s pooling, %d tokens an input",
                    self.name,
                    self._embedder.pooling,
                    self._embedder.n_ctx,
                )
            return self._embedder

    def _make_room(self, need: int) -> None:
        """Hold ``need`` more bytes for the embedding context being made, dropping saved
        prompt states (any model's) if that makes them fit. Raises InsufficientMemory."""

        def hold(nbytes: int) -> None:
            self._embedder_making = nbytes

        self._reserve(need, hold, "Embedding", "its pooled context")

    @contextlib.contextmanager
    def _grammar_room(self) -> Iterator[None]:
        """Room in the budget for the grammar tokenizer, made on the model's first
        request with a grammar (inside this block): held while it is made, then counted
        in :meth:`extra_bytes` as made. Raises InsufficientMemory."""
        with self._grammar_lock:  # one request makes it; the others find it made
            need, made = self.runner.grammar_bytes()
            if made:
                yield
                return

            def hold(nbytes: int) -> None:
                self._grammar_making = nbytes

            self._reserve(need, hold, "Constrained output", "its grammar tokenizer")
            try:
                yield
            finally:
                self._grammar_making = 0

    def _reserve(self, need: int, hold: Callable[[int], None], what: str, part: str) -> None:
        room = self._room
        if room is None:
            hold(need)
            return
        free = room.reserve(need, hold)
        if need > free:
            raise InsufficientMemory(
                f"{what} with '{self.name}' needs {need / 2**20:.0f} MiB for {part}, "
                f"and the memory budget (--memory-budget-mb) has "
                f"{max(0, free) / 2**20:.0f} MiB left with the loaded models in it. "
                "Unload a model, or retry when one is unloaded.",
                retry_after=5,
            )

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise ModelUnloaded(f"The model '{self.name}' was unloaded.")
            self._using += 1
        try:
            yield
        finally:
            with self._lock:
                self._using -= 1
                self._lock.notify_all()

    # -- lifecycle --------------------------------------------------------------

    def close(self, error: SluiceError | None = None) -> None:
        """Unload (blocking): in-flight requests end with an error frame, memory is freed.

        In-flight requests are ended rather than finished first: whoever unloads
        wants the memory back now, and a generation may run for minutes.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._using:
                self._lock.wait()
        reason = error or ModelUnloaded(
            f"The model '{self.name}' was unloaded while this request was using it."
        )
        self.engine.stop(error=reason)
        if self._embedder is not None:
            self._embedder.close()
        self.runner.close()

    def begin_shutdown(self) -> None:
        """Server shutdown: refuse new work; running streams end with ShuttingDown."""
        self.engine.begin_shutdown()

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def sees_images(self) -> bool:
        """It has a projector (``engine.llama_media``)."""
        return getattr(self.runner, "projector", None) is not None

    def health(self) -> dict[str, Any]:
        """Slots and engine counters for ``/health``."""
        stats = self.engine.stats
        return {
            "slots": {
                "total": stats.slots,
                "active": stats.active,
                "queued": stats.queued,
                "prefilling": stats.prefilling,
                "generating": stats.generating,
                "idle": stats.idle,
                "paused": stats.paused,  # waiting for their client to read (backpressure)
            },
            "engine": {
                "steps": stats.steps,
                "tokens_generated": stats.tokens_generated,
                "prompt_tokens_processed": stats.prompt_tokens_processed,
                "cached_tokens_reused": stats.cached_tokens,
            },
            "decoding": self.decoding(),
            "prompt_cache": {  # KV states of earlier prompts in RAM (--cache-ram)
                "entries": stats.prompt_cache_entries,
                "bytes": stats.prompt_cache_bytes,
                "restores": stats.prompt_cache_hits,
            },
            "embedding": self._embedding_health(),
            "grammar": self._grammar_health(),
        }

    def decoding(self) -> dict[str, Any]:
        """Fewer decode steps: the settings and what they did (``/health``, ``/v1/info``)."""
        stats = self.engine.stats
        config = self.engine.config
        drafted = stats.drafted_tokens
        return {
            "max_draft": config.max_draft if self.runner.can_rewind else 0,
            "jump_forward": config.jump_forward,
            "drafted_tokens": drafted,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance": round(stats.accepted_tokens / drafted, 4) if drafted else None,
            "forced_tokens": stats.forced_tokens,
            "reasoning_closed": stats.reasoning_closed,  # blocks closed on their budget
        }

    def _grammar_health(self) -> dict[str, Any] | None:
        """The grammar tokenizer, once a request asked for constrained output."""
        nbytes, made = self.runner.grammar_bytes()
        return {"bytes": nbytes} if made else None

    def _embedding_health(self) -> dict[str, Any] | None:
        """The pooled context, once the model was asked to embed (None before)."""
        embedder = self._embedder
        if embedder is None:
            return None
        return {"pooling": embedder.pooling, "n_ctx": embedder.n_ctx, "bytes": embedder.bytes}

    def extra_bytes(self) -> int:
        """The prompt cache's states, and the embedding context and the grammar
        tokenizer when there are (or are being made)."""
        embedder = self._embedder
        made = embedder.bytes if embedder else self._embedder_making
        grammar, grammar_made = self.runner.grammar_bytes()
        grammar = grammar if grammar_made else self._grammar_making
        return self.engine.prompt_cache.size_bytes + made + grammar

    def reclaim(self, nbytes: int) -> int:
        """Drop up to ``nbytes`` of the prompt cache's least recently used states."""
        return self.engine.prompt_cache.reclaim(nbytes)

    def reclaimable_bytes(self) -> int:
        """What :meth:`reclaim` could give back: the prompt cache's saved states."""
        return self.engine.prompt_cache.size_bytes

    def bind_memory(self, room: MemoryRoom) -> None:
        """The prompt cache keeps within the budget's room from now on, and the
        embedding context is made only if it fits."""
        self._room = room
        self.engine.prompt_cache.room = room.free

    def load_config(self) -> dict[str, Any]:
        """What this instance was loaded with (LM Studio's ``loaded_instances[].config``)."""
        ms = self.model_settings
        return {
            "context_length": self.runner.n_ctx_seq,
            "eval_batch_size": ms.batch if ms else None,
            "parallel": self.engine.stats.slots,
            "num_threads": ms.threads if ms else None,
            "gpu_layers": ms.gpu_layers if ms else 0,
        }

    def card(self) -> dict[str, Any]:
        """The OpenAI ``/v1/models`` entry's ``meta`` for a loaded model."""
        info = self.runner.info
        return {
            "n_ctx": self.runner.n_ctx_seq,
            "n_ctx_train": info.n_ctx_train,
            "n_params": info.n_params,
            "size": info.size_bytes,
            "description": info.description,
            "chat_template": info.chat_template is not None,
        }
