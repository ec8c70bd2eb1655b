"""``GET /v1/info``: the catalog of every model the server answers to (the gateway API's).

Per model: its name and aliases, family, the backend (slot) serving it, its
context window, modalities, capabilities, limits, status and the slot's live
metrics. What an upstream does not say about itself (whether it takes tools,
whether it thinks) is ``null``: unknown, not false.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sluice.core.model import ModelSpec
from sluice.core.request import SamplerDefaults
from sluice.local.model import LocalModel
from sluice.models.entries import ModelStatus
from sluice.models.files import (
    ModelFile,
    context_window,
    read_all_model_files,
    reasoning_capability,
)
from sluice.server.auth import ADMIN, USER, is_admin, key_name
from sluice.server.sse import dumps, json_response
from sluice.server.state import ServerState, server_state
from sluice.upstream.backend import UpstreamSlot, upstream_context

TEXT = {"input": ["text"], "output": ["text"]}


def _version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "unknown"


def _local(
    state: ServerState, spec: ModelSpec, status: ModelStatus, file: ModelFile | None
) -> dict[str, Any]:
    settings = state.settings
    model = state.registry.get_loaded(spec.name)
    loaded = model.runner.n_ctx_seq if isinstance(model, LocalModel) else None
    window = context_window(spec, settings, file, loaded)
    template = file.template if file is not None else None
    return {
        "id": spec.name,
        "aliases": list(spec.aliases),
        "family": file.info.architecture if file is not None else None,
        "backend": {"type": "local", "slot": spec.name, "origin": spec.origin},
        "context_window": window,
        "modalities": {"input": list(file.inputs), "output": ["text"]} if file else TEXT,
        "capabilities": {
            "vision": file is not None and file.vision,
            "audio": file is not None and file.audio,
            "chat": template is not None,
            "completions": True,
            "streaming": True,
            # sluice takes tools for any chat model (its tool grammars); whether the
            # model was trained for them is what its template says.
            "tools": template is not None,
            "trained_for_tool_use": file.supports_tools if file is not None else False,
            "reasoning": reasoning_capability(template) is not None,
            "structured_output": True,
            "logprobs": True,
        },
        "limits": {
            "max_tokens": {"min": 1, "max": window},
            "max_stop": settings.max_stop,
            "max_tools": settings.max_tools,
            "max_messages": settings.max_messages,
            "max_body_bytes": settings.max_body_bytes,
        },
        # What a request that leaves a sampling field out gets.
        "sampling_defaults": (
            model.sampler
            if isinstance(model, LocalModel)
            else SamplerDefaults.declared(file.info.sampling if file else {}, spec.sampling)
        ).as_dict(),
        "status": status.state,
        "metrics": state.metrics.slot(spec.name, "local").snapshot(),
        # speculation and jump-forward, once the model is loaded
        "decoding": model.decoding() if isinstance(model, LocalModel) else None,
    }


def _upstream(state: ServerState, public: str, slot: UpstreamSlot, model: str) -> dict[str, Any]:
    window = upstream_context(slot.entry(model))
    return {
        "id": public,
        "aliases": [a for a in slot.aliases_of(model) if a != public],
        "upstream_model": model,
        "family": None,
        "backend": {
            "type": "upstream",
            "slot": slot.name,
            "replicas": [
                {"url": r.url, "state": r.state, "outstanding": r.outstanding}
                for r in slot.pool.status()
            ],
            "affinity": slot.pool.affinity_view(),
        },
        "context_window": window,
        "modalities": TEXT,
        "capabilities": {
            "chat": True,
            "completions": True,
            "streaming": True,
            "tools": None,
            "reasoning": None,
            "structured_output": None,
            "logprobs": None,
        },
        "limits": {
            "max_tokens": {"min": 1, "max": window},
            "timeout_seconds": slot.spec.timeout,
            "max_body_bytes": state.settings.max_body_bytes,
        },
        "status": slot.pool.state(),
        "metrics": slot.metrics.snapshot(),
    }


async def catalog(request: Request) -> Response:
    state = server_state(request)
    specs = {spec.name: spec for spec in state.dispatcher.known()}
    listed = [(specs[s.name], s) for s in state.registry.status() if s.name in specs]
    files = await state.offload.run(
        lambda: read_all_model_files([spec for spec, _ in listed], state.settings)
    )
    models = [_local(state, spec, status, files[spec.name]) for spec, status in listed]
    models += [_upstream(state, *target) for target in state.dispatcher.upstream_models()]
    body = {
        "object": "info",
        "server": {"name": "sluice", "version": _version()},
        "default_model": state.registry.resolve(None).name,
        "models": models,
        "slots": state.metrics.snapshot(),
        # who is asking: the key's name (null without keys) and whether it may manage models
        "caller": {
            "key": key_name(request) or None,
            "role": ADMIN if is_admin(request) else USER,
        },
    }
    return Response(dumps(body), media_type="application/json")


async def health(request: Request) -> Response:
    state = server_state(request)
    models: dict[str, Any] = {}
    for status in state.registry.status():
        entry: dict[str, Any] = {
            "status": status.state,
            "in_use": status.in_use,
            "loads": status.loads,
        }
        model = state.registry.get_loaded(status.name)
        if isinstance(model, LocalModel):
            entry.update(model.health())
        models[status.name] = entry
    default = state.registry.resolve(None).name
    body: dict[str, Any] = {"status": "ok", "model": default, "models": models}
    if state.dispatcher.upstreams:
        body["upstreams"] = {
            slot.name: {
                "status": slot.pool.state(),
                "replicas": {
                    r.url: {"state": r.state, "outstanding": r.outstanding, "error": r.last_error}
                    for r in slot.pool.status()
                },
            }
            for slot in state.dispatcher.upstreams
        }
    # The default model's figures at the top level, as before there were many models.
    for key in ("slots", "engine"):
        if key in models.get(default, {}):
            body[key] = models[default][key]
    return json_response(body)


async def metrics(request: Request) -> Response:
    """The per-slot counters, gauges and histograms of this app's ``Metrics``."""
    state = server_state(request)
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)
