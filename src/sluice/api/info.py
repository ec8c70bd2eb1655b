"""``GET /v1/info``: the catalog of every model the server answers to (spec 002).

Per model: its name and aliases, family, the backend (slot) serving it, its
context window, modalities, capabilities, limits, status and the slot's live
metrics. What an upstream does not say about itself (whether it takes tools,
whether it thinks) is ``null``: unknown, not false.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from sluice.api.lmstudio import ModelFile, read_all_model_files, reasoning_capability
from sluice.api.sse import dumps
from sluice.catalog import ModelSpec
from sluice.serving.local import LocalModel
from sluice.serving.registry import ModelStatus
from sluice.serving.upstream import UpstreamSlot

if TYPE_CHECKING:
    from sluice.api.app import ServerState

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
    if isinstance(model, LocalModel):
        window = model.runner.n_ctx_seq
    else:  # what a load would give it
        window = spec.ctx or settings.ctx
    if file is not None and file.info.context_length:
        window = min(window, file.info.context_length)
    template = file.template if file is not None else None
    return {
        "id": spec.name,
        "aliases": list(spec.aliases),
        "family": file.info.architecture if file is not None else None,
        "backend": {"type": "local", "slot": spec.name, "origin": spec.origin},
        "context_window": window,
        "modalities": TEXT,
        "capabilities": {
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
        "status": status.state,
        "metrics": state.metrics.slot(spec.name, "local").snapshot(),
    }


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


def upstream_models(state: ServerState) -> list[tuple[str, UpstreamSlot, str]]:
    """(public id, slot, upstream name) for every upstream model a client can reach.

    A model shadowed by a local model of the same name is listed under its first
    alias, or not at all when it has none.
    """
    out: list[tuple[str, UpstreamSlot, str]] = []
    for slot in state.dispatcher.upstreams:
        models = slot.models()
        for model in models:
            public: str | None = model
            if state.registry.find(model) is not None:
                aliases = slot.aliases_of(model)
                public = aliases[0] if aliases else None
            if public is not None:
                out.append((public, slot, model))
        # An alias of a name the upstream does not list (one of its own aliases, say)
        # still answers: listed under the alias.
        listed = {m.lower() for m in models}
        for alias, target in slot.spec.aliases.items():
            if target.lower() not in listed:
                out.append((alias, slot, target))
    return out


def upstream_entry(slot: UpstreamSlot, model: str) -> dict[str, Any]:
    """The upstream's ``/v1/models`` entry for ``model``: by id, else by one of the
    ``aliases`` an entry lists (sluice's own entries do)."""
    entries = slot.pool.model_entries()
    entry = entries.get(model)
    if entry is not None:
        return entry
    key = model.lower()
    for candidate in entries.values():
        aliases = candidate.get("aliases")
        if isinstance(aliases, list) and key in (str(a).lower() for a in aliases):
            return candidate
    return {}


def _upstream(state: ServerState, public: str, slot: UpstreamSlot, model: str) -> dict[str, Any]:
    window = upstream_context(upstream_entry(slot, model))
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
    state: ServerState = request.app.state.sluice
    specs = {spec.name: spec for spec in state.registry.known()}
    listed = [(specs[s.name], s) for s in state.registry.status() if s.name in specs]
    files = await state.offload.run(
        lambda: read_all_model_files([spec for spec, _ in listed], state.settings)
    )
    models = [_local(state, spec, status, files[spec.name]) for spec, status in listed]
    models += [_upstream(state, *target) for target in upstream_models(state)]
    body = {
        "object": "info",
        "server": {"name": "sluice", "version": _version()},
        "default_model": state.registry.resolve(None).name,
        "models": models,
        "slots": state.metrics.snapshot(),
    }
    return Response(dumps(body), media_type="application/json")
