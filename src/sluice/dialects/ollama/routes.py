"""Ollama's API: ``/api/chat``, ``/api/generate`` (NDJSON), and discovery (``/api/tags``,
``/api/show``, ``/api/version``, ``/api/ps``), for the tools that speak only Ollama
(VS Code Copilot's Ollama provider, Open WebUI, LangChain's ChatOllama, the
``ollama`` libraries).

Order of a chat or generate request:

1. Before any byte (a real status, ``{"error": "..."}``): the body is read within
   the size limit, validated and made the neutral request (``schema.py``); a
   ``:latest`` tag on the model name is dropped (sluice's names have no tags);
   images for a local model are a 400. Empty ``messages`` (or an empty ``prompt``)
   only loads the model (``done_reason: "load"``), or unloads it with
   ``keep_alive: 0`` (``"unload"``). Otherwise the slot is acquired: a local model
   loads just in time, with ``options.num_ctx`` as its context (an idle model
   loaded with another context reloads, as LM Studio's ``context_length`` does),
   and ``keep_alive`` becomes its idle TTL.
2. The events become NDJSON lines (``format.py``), or fold into one object; an
   error after the first line is an ``{"error": ...}`` line.

Example::

    curl localhost:8080/api/chat -d '{"model": "smollm2",
      "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from sluice.config import default_models_dir
from sluice.core.backend import LoadOptions, ResponseStream
from sluice.core.errors import DownloadFailed, InvalidRequest, ModelNotFound, as_sluice_error
from sluice.core.events import ErrorEvent
from sluice.core.model import ModelSpec
from sluice.core.request import SamplerDefaults
from sluice.dialects.ollama.format import (
    NDJSON,
    OllamaFormatter,
    dumps_line,
    error_line,
    error_response,
)
from sluice.dialects.ollama.schema import (
    ChatRequest,
    DeleteRequest,
    EmbedRequest,
    GenerateRequest,
    PullRequest,
    ShowRequest,
    parse,
)
from sluice.local.model import LocalModel
from sluice.models.catalog import delete_from_models_dir
from sluice.models.dispatch import SlotLease
from sluice.models.files import ModelFile, read_all_model_files, reasoning_capability
from sluice.server.auth import is_admin, require_admin
from sluice.server.body import read_request_body
from sluice.server.jsonbody import check_body_limits, check_embed_inputs, parse_json_body
from sluice.server.respond import CLIENT_GONE, errors_as, respond
from sluice.server.sse import json_response
from sluice.server.state import ServerState, read_json, server_state
from sluice.upstream.backend import slot_header

# The Ollama API version sluice answers like (/api/version): clients compare it
# against the minimum they need (VS Code Copilot's Ollama provider wants >= 0.6.4).
log = logging.getLogger("sluice.api")

OLLAMA_API_VERSION = "0.12.6"
# How often a pull's progress line may come (while bytes arrive).
PULL_PROGRESS_SECONDS = 0.5

Wire = ChatRequest | GenerateRequest


async def _read(request: Request, wire: type[Wire]) -> Wire | None:
    state = server_state(request)
    raw = await read_request_body(request, state.settings.max_body_bytes, lambda: state.draining)
    if raw is None:
        return None

    def validate() -> Wire:
        data = parse_json_body(raw, state.limits)  # one hop: parsed and validated
        options = data.get("options")
        stop = options.get("stop") if isinstance(options, dict) else None
        check_body_limits({"messages": data.get("messages"), "stop": stop}, state.limits)
        body: Wire = parse(data, wire)
        body.model = body.model.removesuffix(":latest")
        return body

    body: Wire = await state.offload.run(validate)
    return body


def _empty(body: Wire) -> bool:
    if isinstance(body, ChatRequest):
        return not body.messages
    return not body.prompt and not body.raw


async def _load_only(state: ServerState, body: Wire, started: float, *, admin: bool) -> Response:
    """Empty ``messages`` / ``prompt``: load the model (or unload it: keep_alive 0)."""
    formatter = OllamaFormatter(body.model, chat=isinstance(body, ChatRequest), started=started)
    if body.unloads():
        if state.dispatcher.upstream(body.model) is None:
            spec = state.registry.resolve(body.model)
            if state.registry.get_loaded(spec.name) is not None:
                await state.registry.unload(spec.name)
        formatter.reason = "unload"
    else:
        lease = await _acquire(state, body, admin=admin)
        lease.release()
        formatter.reason = "load"
        formatter.load_seconds = (lease.load_seconds or 0.0) if lease.loaded_now else 0.0
    out = formatter.body()
    for key in ("prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"):
        out.pop(key, None)
    return json_response(out)


async def _acquire(state: ServerState, body: Wire, *, admin: bool) -> SlotLease:
    """The slot, the model loaded just in time. ``keep_alive`` sets the model's idle TTL
    for everyone, so only an admin key's counts (a user key's is ignored, logged)."""
    options = LoadOptions(ctx=body.options.num_ctx) if body.options.num_ctx else None
    ttl = body.ttl()
    if ttl is not None and not admin:
        log.info("'%s': keep_alive from a user key ignored (the model's TTL stays)", body.model)
        ttl = None
    return await state.dispatcher.acquire(body.model, ttl=ttl, options=options)


async def _answer(request: Request, wire: type[Wire]) -> Response:
    started = time.monotonic()
    body = await _read(request, wire)
    if body is None:
        return Response(status_code=CLIENT_GONE)
    state = server_state(request)
    if _empty(body):
        if body.unloads():  # an explicit unload is model management
            require_admin(request, "Unloading a model (keep_alive 0)")
        return await _load_only(state, body, started, admin=is_admin(request))
    neutral = body.to_request()
    lease = await _acquire(state, body, admin=is_admin(request))
    try:
        stream: ResponseStream = await lease.open(neutral)
    except BaseException:
        lease.release()
        raise
    formatter = OllamaFormatter(
        body.model,
        chat=wire is ChatRequest,
        started=started,
        load_seconds=(lease.load_seconds or 0.0) if lease.loaded_now else 0.0,
    )
    headers = {"x-sluice-slot": slot_header(stream.meta.slot, stream.meta.replica)}

    async def lines() -> AsyncIterator[bytes]:
        async for event in stream:
            if isinstance(event, ErrorEvent):
                yield error_line(event.error)
                return
            for line in formatter.lines(event):
                yield line
        for line in formatter.end():
            yield line

    async def fold() -> dict[str, Any]:
        async for event in stream:
            if isinstance(event, ErrorEvent):
                raise as_sluice_error(event.error)
            formatter.lines(event)
        return formatter.body()

    return await _respond(
        request, body.stream, lines, fold, lambda: lease.close(stream), lambda: headers
    )


async def _respond(
    request: Request,
    stream: bool,
    lines: Callable[[], AsyncIterator[bytes]],
    fold: Callable[[], Awaitable[Any]],
    close: Callable[[], Awaitable[None]],
    headers: Callable[[], Mapping[str, str]] = dict,
) -> Response:
    """``respond`` in Ollama's shape: NDJSON lines (no keep-alive, which its clients
    could not parse), ``{"error"}`` bodies and lines."""
    return await respond(
        request,
        server_state(request).settings,
        stream=stream,
        frames=lines,
        fold=fold,
        close=close,
        headers=headers,
        render_error=error_response,
        ping=None,
        failure_frame=error_line,
        content_type=NDJSON,
    )


@errors_as(error_response)
async def chat(request: Request) -> Response:
    return await _answer(request, ChatRequest)


@errors_as(error_response)
async def generate(request: Request) -> Response:
    return await _answer(request, GenerateRequest)


# -- discovery -----------------------------------------------------------------------------


@errors_as(error_response)
async def version(request: Request) -> Response:
    return json_response({"version": OLLAMA_API_VERSION})


async def _files(state: ServerState) -> tuple[list[ModelSpec], dict[str, ModelFile | None]]:
    specs = state.dispatcher.known()
    files = await state.offload.run(lambda: read_all_model_files(specs, state.settings))
    return specs, files


def _details(file: ModelFile | None) -> dict[str, Any]:
    if file is None:
        return {"format": "gguf", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}  # fmt: skip
    info = file.info
    return {
        "parent_model": "",
        "format": "gguf",
        "family": info.architecture,
        "families": [info.architecture],
        "parameter_size": info.params_string,
        "quantization_level": info.quantization,
    }


def _local_entry(spec: ModelSpec, file: ModelFile | None) -> dict[str, Any]:
    path = file.info.path if file is not None else None
    size, mtime = 0, 0.0
    if path is not None:
        try:
            stat = Path(path).stat()
            size, mtime = stat.st_size, stat.st_mtime
        except OSError:
            pass
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()
    return {
        "name": spec.name,
        "model": spec.name,
        "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
        "size": size,
        "digest": digest,
        "details": _details(file),
    }


def _upstream_entry(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(0, UTC).isoformat().replace("+00:00", "Z"),
        "size": 0,
        "digest": hashlib.sha256(f"upstream:{name}".encode()).hexdigest(),
        "details": _details(None),
    }


@errors_as(error_response)
async def tags(request: Request) -> Response:
    state = server_state(request)
    specs, files = await _files(state)
    models = [_local_entry(spec, files.get(spec.name)) for spec in specs]
    models += [_upstream_entry(name) for name, _slot, _up in state.dispatcher.upstream_models()]
    return json_response({"models": models})


@errors_as(error_response)
async def ps(request: Request) -> Response:
    state = server_state(request)
    specs, files = await _files(state)
    by_name = {spec.name: spec for spec in specs}
    models = []
    for status in state.registry.status():
        model = state.registry.get_loaded(status.name)
        spec = by_name.get(status.name)
        if not isinstance(model, LocalModel) or spec is None:
            continue
        entry = _local_entry(spec, files.get(spec.name))
        ttl = status.ttl or 0.0
        last = status.last_used or time.time()
        # In use, it cannot expire before its TTL from now; TTL 0 never (Ollama shows
        # a date far ahead for a model kept loaded).
        expires = (time.time() if status.in_use else last) + ttl if ttl else last + 10 * 365 * 86400
        entry.update(
            size=status.estimate_bytes or entry["size"],
            size_vram=0,
            expires_at=datetime.fromtimestamp(expires, UTC).isoformat().replace("+00:00", "Z"),
            context_length=model.runner.n_ctx_seq,
        )
        models.append(entry)
    return json_response({"models": models})


@errors_as(error_response)
async def show(request: Request) -> Response:
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    body = parse(data, ShowRequest)
    name = body.model_name().removesuffix(":latest")
    if state.dispatcher.upstream(name) is not None:
        return json_response(
            {
                "details": _details(None),
                "model_info": {},
                "template": "",
                "parameters": "",
                "capabilities": ["completion", "tools"],
            }
        )
    spec = state.registry.named(name)  # a lookup: an unknown name is a 404, never the default
    files = await state.offload.run(lambda: read_all_model_files([spec], state.settings))
    file = files.get(spec.name)
    loaded = state.registry.get_loaded(spec.name)
    template = file.template if file is not None else None
    if template is None and isinstance(loaded, LocalModel):
        template = loaded.runner.info.chat_template
    capabilities = ["completion"]
    if template is not None:
        capabilities.append("tools")  # sluice's tool grammars work on any chat template
        if reasoning_capability(template) is not None:
            capabilities.append("thinking")
    if file is not None and file.vision:
        capabilities.append("vision")
    sampler = (
        loaded.sampler
        if isinstance(loaded, LocalModel)
        else SamplerDefaults.declared(file.info.sampling if file else {}, spec.sampling)
    )
    parameters = "\n".join(
        f"{key:<15} {value}" for key, value in sampler.as_dict().items() if key != "source"
    )
    model_info: dict[str, Any] = {}
    if file is not None:
        arch = file.info.architecture
        model_info = {
            "general.architecture": arch,
            "general.parameter_count": file.info.n_params,
            f"{arch}.context_length": file.info.context_length,
            f"{arch}.embedding_length": file.info.embedding_length,
            f"{arch}.block_count": file.info.block_count,
        }
    return json_response(
        {
            "license": "",
            "modelfile": "",
            "parameters": parameters,
            "template": template or "",
            "details": _details(file),
            "model_info": model_info,
            "capabilities": capabilities,
            "modified_at": _local_entry(spec, file)["modified_at"],
        }
    )


@errors_as(error_response)
async def delete(request: Request) -> Response:
    """``DELETE /api/delete``: a model file in the models folder (a download, or one put
    there) is unloaded if loaded, then deleted; packaged, config-file and upstream
    models are not the server's to delete (400)."""
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    name = parse(data, DeleteRequest).model_name().removesuffix(":latest")
    root = Path(state.settings.models_dir or default_models_dir()).expanduser()
    target = state.dispatcher.upstream(name)
    if target is not None:
        raise InvalidRequest(
            f"'{name}' is served by the upstream slot '{target.slot.name}': sluice deletes "
            f"only model files in its models folder ({root}).",
            param="model",
        )
    spec = state.registry.find(name)
    if spec is None:
        state.registry.known()  # a file may have arrived since the last scan
        spec = state.registry.find(name)
    if spec is None:
        raise ModelNotFound(name)
    if spec.origin != "models_dir":
        where = {"packaged": "a packaged model", "config": "an entry of the config file"}
        raise InvalidRequest(
            f"'{name}' is {where.get(spec.origin, 'a model given by its path')}: sluice "
            f"deletes only model files in its models folder ({root}).",
            param="model",
        )
    if state.registry.get_loaded(spec.name) is not None:
        await state.registry.unload(spec.name)  # requests in flight end with an error
    freed = await state.offload.run(lambda: delete_from_models_dir(spec, root))
    state.registry.known()  # forget it now, not at the next scan
    log.info("deleted '%s' (%d MiB) from %s", spec.name, freed >> 20, root)
    return Response(status_code=200)


# What Ollama's management routes do that sluice does not, and what to do instead.
NOT_SERVED = {
    "create": "sluice does not build models from a Modelfile: put the GGUF file in the "
    "models folder, or give it a [[models]] entry in the config file (its chat_template, "
    "sampling defaults, aliases and context).",
    "copy": "sluice does not copy models: give a model another name with 'aliases' in its "
    "[[models]] entry in the config file.",
    "push": "sluice does not push models to a registry.",
}


@errors_as(error_response)
async def not_served(request: Request) -> Response:
    """``POST /api/create``, ``/api/copy``, ``/api/push``: a 400 that says what to do
    instead."""
    raise InvalidRequest(NOT_SERVED[request.url.path.removeprefix("/api/")])


# -- embeddings -----------------------------------------------------------------------------


async def _embed(request: Request, legacy: bool) -> Response:
    started = time.monotonic()
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    body: EmbedRequest = parse(data, EmbedRequest)
    name = body.model.removesuffix(":latest")
    inputs = check_embed_inputs([body.prompt] if legacy else body.input_list(), state.limits)
    lease = await state.dispatcher.acquire(name, ttl=body.ttl())
    try:
        result = await lease.embed(inputs, truncate=body.truncate, dimensions=body.dimensions)
    finally:
        lease.release()
    if legacy:
        return json_response({"embedding": result.vectors[0]})
    load = (lease.load_seconds or 0.0) if lease.loaded_now else 0.0
    return json_response(
        {
            "model": body.model,
            "embeddings": result.vectors,
            "total_duration": int((time.monotonic() - started) * 1e9),
            "load_duration": int(load * 1e9),
            "prompt_eval_count": result.prompt_tokens,
        }
    )


@errors_as(error_response)
async def embed(request: Request) -> Response:
    return await _embed(request, legacy=False)


@errors_as(error_response)
async def embeddings_legacy(request: Request) -> Response:
    return await _embed(request, legacy=True)


# -- pull ------------------------------------------------------------------------------------


@errors_as(error_response)
async def pull(request: Request) -> Response:
    """``POST /api/pull`` of a GGUF file's URL, over the server's downloads: NDJSON
    progress (``total`` / ``completed`` bytes) then ``success``. Ollama's registry
    names are not URLs: a 400 that says what to send instead."""
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    body: PullRequest = parse(data, PullRequest)
    url = body.model_name()
    if urlsplit(url).scheme.lower() not in ("http", "https"):
        raise InvalidRequest(
            f"'{url}' is not a URL: sluice pulls a model from the URL of a GGUF file "
            "(e.g. https://huggingface.co/<repo>/resolve/main/<file>.gguf); Ollama's "
            "registry names are not supported.",
            param="model",
        )
    try:
        job = await state.downloads.start(url)
    except InvalidRequest as exc:  # the manager names the field "url"; here it is "model"
        if exc.param == "url":
            exc.param = "model"
        raise

    def outcome() -> dict[str, Any]:
        if job.status in ("completed", "already_downloaded"):
            return {"status": "success"}
        return {"error": job.error.message if job.error else f"the download is {job.status}"}

    async def lines() -> AsyncIterator[bytes]:
        yield dumps_line({"status": "pulling manifest"})
        last: tuple[int, int | None] | None = None
        while True:
            done = job.finished
            progress = job.progress()  # (done, total), a projector's included
            if progress != last and progress[1] is not None:
                last = progress
                yield dumps_line(
                    {
                        "status": f"pulling {job.model}",
                        "digest": f"sha256:{job.sha256 or job.id}",
                        "total": progress[1],
                        "completed": progress[0],
                    }
                )
            if done:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.wait(), PULL_PROGRESS_SECONDS)
        yield dumps_line(outcome())

    async def fold() -> dict[str, Any]:
        await job.wait()
        answer = outcome()
        if "error" in answer:
            raise DownloadFailed(answer["error"])
        return answer

    async def nothing() -> None:  # the download goes on when the client leaves
        return None

    return await _respond(request, body.stream, lines, fold, nothing)
