"""LM Studio's REST API v1, model management: list, load, unload, download.

Tools written for LM Studio manage sluice's models unchanged: the bodies and
answers have LM Studio's shapes, and so do the errors (``{"error": {"type",
"message", "code", "param"?}}`` with the status of sluice's one error table),
never the OpenAI shape the app's global handlers write.

* ``GET /api/v1/models``: every known model with its GGUF metadata (read on a
  worker thread) and its loaded instance, if any.
* ``POST /api/v1/models/load`` ``{"model", "context_length"?, "parallel"?, ...}``:
  one instance per model, whose id is the model's key.
* ``POST /api/v1/models/unload`` ``{"instance_id"}``.
* ``POST /api/v1/models/download`` ``{"model": "<URL of a .gguf>", "sha256"?,
  "filename"?}`` and ``GET /api/v1/models/download/status/{job_id}``: the file
  lands in the models folder and is a model (named by its stem) from then on. A
  host on a loopback, private or link-local address (unless
  ``--download-allow-private``) or off ``--download-allowed-hosts`` is a 400
  naming ``model``.

Example::

    curl -d '{"model": "gemma-3-270m", "context_length": 1024}' \\
        localhost:8080/api/v1/models/load
    # -> {"type": "llm", "instance_id": "gemma-3-270m", "load_time_seconds": 0.41,
    #     "status": "loaded"}
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sluice.config import Settings
from sluice.core.backend import LoadOptions
from sluice.core.errors import (
    DownloadNotAllowed,
    InvalidRequest,
    ModelNotFound,
    ShuttingDown,
    SluiceError,
    as_sluice_error,
    lmstudio_error_body,
    spec_for,
)
from sluice.core.frames import Frame
from sluice.core.model import ModelSpec
from sluice.dialects.lmstudio.schema import (
    DownloadModelRequest,
    LoadModelRequest,
    UnloadModelRequest,
    parse,
)
from sluice.models.entries import LoadResult, ModelStatus
from sluice.models.files import (
    ModelFile,
    read_all_model_files,
    read_model_file,
    reasoning_capability,
)
from sluice.server.body import read_body
from sluice.server.jsonbody import parse_json_body
from sluice.server.respond import errors_as
from sluice.server.sse import encode, json_response
from sluice.server.state import ServerState, server_state

log = logging.getLogger("sluice.api")

M = TypeVar("M", LoadModelRequest, UnloadModelRequest, DownloadModelRequest)

_GGUF_URL_HINT = (
    "sluice downloads a model from the URL of a GGUF file, e.g. "
    "https://huggingface.co/<org>/<repo>/resolve/main/<file>.gguf"
)


class InstanceNotLoaded(ModelNotFound):
    """No loaded instance has this id (the model itself may exist, unloaded)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(instance_id)
        self.message = f"No model instance '{instance_id}' is loaded."
        self.param = "instance_id"
        self.args = (self.message,)


# -- plumbing ---------------------------------------------------------------------------


def _lms_error_response(exc: SluiceError) -> Response:
    """LM Studio's error body with the status (and headers) of sluice's error table."""
    # ASCII: a message may quote the client's input, lone surrogates included.
    body = json.dumps(lmstudio_error_body(exc), ensure_ascii=True, separators=(",", ":"))
    return Response(body, spec_for(exc).status, exc.headers(), media_type="application/json")


_lmstudio = errors_as(_lms_error_response)
NO_CACHE = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def _read(request: Request, model: type[M]) -> M:
    """The body as ``model``: 413 past the size limit, 400 naming what is wrong."""
    state = server_state(request)
    raw = await read_body(request, state.settings.max_body_bytes)
    # Off the loop: a body of megabytes of JSON takes a while to parse.
    return await state.offload.run(lambda: parse(parse_json_body(raw, state.limits), model))


def _check_open(state: ServerState) -> None:
    if state.draining:
        raise ShuttingDown("The server is shutting down; no model is loaded or downloaded now.")


def _find(state: ServerState, name: str) -> ModelSpec:
    """The model ``name`` names (key or alias, any case); explicit: no default fallback."""
    key = name.lower()
    for spec in state.registry.known():  # re-scanned: a finished download is found
        if key in spec.lookup_keys():
            return spec
    raise ModelNotFound(name)


# -- the listing ------------------------------------------------------------------------


def model_entry(spec: ModelSpec, status: ModelStatus, file: ModelFile | None) -> dict[str, Any]:
    """One ``GET /api/v1/models`` entry, in LM Studio's field order."""
    info = file.info if file is not None else None
    capabilities: dict[str, Any] = {
        "vision": file.vision if file is not None else False,
        "trained_for_tool_use": file.supports_tools if file is not None else False,
    }
    reasoning = reasoning_capability(file.template if file is not None else None)
    if reasoning is not None:
        capabilities["reasoning"] = reasoning
    return {
        "type": "llm",
        "publisher": file.publisher if file is not None else "local",
        "key": spec.name,
        "display_name": (info.name if info is not None else None) or spec.name,
        "architecture": info.architecture if info is not None else None,
        "quantization": (
            {"name": info.quantization, "bits_per_weight": info.bits_per_weight}
            if info is not None
            else None
        ),
        "size_bytes": info.file_size if info is not None else 0,
        "params_string": info.params_string if info is not None else None,
        "loaded_instances": _instances(spec, status),
        "max_context_length": info.context_length if info is not None else None,
        "format": "gguf",
        "capabilities": capabilities,
        "description": None,
    }


def _instances(spec: ModelSpec, status: ModelStatus) -> list[dict[str, Any]]:
    # One instance per model here, its id the model's key: what load returns and
    # unload and chat take.
    if status.state != "loaded" or status.load_config is None:
        return []
    return [{"id": spec.name, "config": _config(status.load_config)}]


def _config(config: dict[str, Any]) -> dict[str, Any]:
    """A load config without the settings that do not apply (LM Studio leaves them out)."""
    return {key: value for key, value in config.items() if value is not None}


@_lmstudio
async def list_models(request: Request) -> Response:
    state = server_state(request)
    specs = {spec.name: spec for spec in state.dispatcher.known()}
    # A loaded model whose file vanished has no spec to read: not listed (as on disk).
    listed = [(specs[s.name], s) for s in state.registry.status() if s.name in specs]
    files = await state.offload.run(
        lambda: read_all_model_files([spec for spec, _ in listed], state.settings)
    )
    return json_response({"models": [model_entry(spec, s, files[spec.name]) for spec, s in listed]})


# -- load and unload --------------------------------------------------------------------


def _check_context(spec: ModelSpec, context_length: int, trained: int | None) -> None:
    if trained is not None and context_length > trained:
        raise InvalidRequest(
            f"Invalid 'context_length': {context_length} is more than the {trained} tokens "
            f"model '{spec.name}' was trained for.",
            param="context_length",
        )


def _unapplied(body: LoadModelRequest, settings: Settings) -> list[str]:
    """The load options sluice sets per server, not per model, that ask for a change."""
    out = []
    if body.eval_batch_size is not None and body.eval_batch_size != settings.batch:
        out.append(f"eval_batch_size={body.eval_batch_size} (--batch {settings.batch} applies)")
    for name in ("flash_attention", "num_experts", "offload_kv_cache_to_gpu"):
        if getattr(body, name) is not None:
            out.append(f"{name}={json.dumps(getattr(body, name))}")
    return out


def _options(body: LoadModelRequest) -> LoadOptions | None:
    # None: whatever instance is loaded will do (a load without settings never reloads).
    if body.context_length is None and body.parallel is None:
        return None
    return LoadOptions(ctx=body.context_length, parallel=body.parallel)


@_lmstudio
async def load_model(request: Request) -> Response:
    state = server_state(request)
    body = await _read(request, LoadModelRequest)
    _check_open(state)
    spec = _find(state, body.model)
    if body.context_length is not None:
        file = await state.offload.run(lambda: read_model_file(spec, state.settings))
        _check_context(spec, body.context_length, file.info.context_length)
    unapplied = _unapplied(body, state.settings)
    if unapplied:
        # Accepted, as LM Studio accepts them for engines that lack them: a tool that
        # always sends its defaults still loads. The echoed config shows what applied.
        log.warning("load '%s': not set per model, ignored: %s", spec.name, ", ".join(unapplied))
    options = _options(body)

    def answer(result: LoadResult) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "llm",
            "instance_id": spec.name,
            "load_time_seconds": round(result.seconds, 3),
            "status": "loaded",
        }
        if body.echo_load_config:
            model = state.registry.get_loaded(spec.name)
            out["load_config"] = _config(model.load_config()) if model is not None else {}
        return out

    if "text/event-stream" in request.headers.get("accept", ""):
        return _load_stream(state, spec.name, options, body.ttl or 0, answer)
    result = await state.registry.load(spec.name, options, ttl=body.ttl or 0)
    return json_response(answer(result))


def _load_stream(
    state: ServerState,
    name: str,
    options: LoadOptions | None,
    ttl: float,
    answer: Callable[[LoadResult], dict[str, Any]],
) -> Response:
    """A load asked for with ``Accept: text/event-stream`` (sluice's extension, for
    ``sluice models load``): ``model_load.progress`` events as the load goes (the
    fraction, at most one per hundredth), then ``model_load.end`` with the usual
    answer, or an ``error`` event. A client that leaves does not stop the load."""
    queue: asyncio.Queue[float] = asyncio.Queue()
    task = asyncio.ensure_future(state.registry.load(name, options, queue.put_nowait, ttl=ttl))

    def frame(kind: str, **fields: Any) -> bytes:
        return encode(Frame({"type": kind, **fields}, event=kind, ascii=True))

    async def frames() -> AsyncIterator[bytes]:
        yield frame("model_load.start", model_instance_id=name)
        last = 0.0
        while not task.done():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            fraction = getter.result()
            if fraction < 1.0 and fraction - last >= 0.01:
                last = fraction
                yield frame("model_load.progress", model_instance_id=name, progress=fraction)
        try:
            result = task.result()
        except Exception as exc:  # noqa: BLE001 - told to the client in LM Studio's shape
            error = lmstudio_error_body(as_sluice_error(exc))["error"]
            yield frame("error", error=error)
            return
        yield frame("model_load.progress", model_instance_id=name, progress=1.0)
        yield frame("model_load.end", **answer(result))

    return StreamingResponse(frames(), media_type="text/event-stream", headers=NO_CACHE)


@_lmstudio
async def unload_model(request: Request) -> Response:
    state = server_state(request)
    body = await _read(request, UnloadModelRequest)
    try:
        spec = _find(state, body.instance_id)
    except ModelNotFound:
        raise InstanceNotLoaded(body.instance_id) from None
    status = next((s for s in state.registry.status() if s.name == spec.name), None)
    if status is None or status.state == "not_loaded":
        raise InstanceNotLoaded(body.instance_id)
    try:
        await state.registry.unload(spec.name)
    except ModelNotFound:  # unloaded (TTL, another request) since the look above
        raise InstanceNotLoaded(body.instance_id) from None
    return json_response({"instance_id": spec.name})


# -- downloads --------------------------------------------------------------------------


def _download_url(model: str) -> str:
    if urlsplit(model).scheme.lower() not in ("http", "https"):
        raise InvalidRequest(
            f"Invalid 'model': '{model}' is not a URL. {_GGUF_URL_HINT}; LM Studio catalog "
            "ids and repository names are not supported.",
            param="model",
        )
    return model


@_lmstudio
async def download_model(request: Request) -> Response:
    state = server_state(request)
    body = await _read(request, DownloadModelRequest)
    _check_open(state)
    url = _download_url(body.model)
    if body.quantization is not None:
        log.info("download: 'quantization' ignored; the URL names one file")
    try:
        job = await state.downloads.start(url, sha256=body.sha256, filename=body.filename)
    except DownloadNotAllowed as exc:  # the URL is fine; its host is not
        raise DownloadNotAllowed(f"Invalid 'model': {exc.message}", param="model") from exc
    except InvalidRequest as exc:
        if exc.param != "url":
            raise
        # The manager names its argument "url"; here it is the body's "model".
        raise InvalidRequest(
            f"Invalid 'model': {exc.message} {_GGUF_URL_HINT}.", param="model"
        ) from exc
    if job.status == "already_downloaded":
        # LM Studio's answer has no job then; "model" (the key) is sluice's addition.
        return json_response({"status": "already_downloaded", "model": job.model})
    return json_response(job.status_dict())


@_lmstudio
async def download_status(request: Request) -> Response:
    job = server_state(request).downloads.get(request.path_params["job_id"])
    return json_response(job.status_dict())


ROUTES: list[Route] = [
    Route("/api/v1/models", list_models, methods=["GET"]),
    Route("/api/v1/models/load", load_model, methods=["POST"]),
    Route("/api/v1/models/unload", unload_model, methods=["POST"]),
    Route("/api/v1/models/download", download_model, methods=["POST"]),
    Route("/api/v1/models/download/status/{job_id}", download_status, methods=["GET"]),
]
