"""OpenAI's ``POST /v1/embeddings``: texts or token ids in, L2-normalized vectors out.

A local model embeds on its pooled context (``engine/llama_embed.py``); an upstream
model's request passes through to its slot's ``/v1/embeddings`` byte for byte, as
chat does. ``encoding_format: "base64"`` (what the ``openai`` SDK asks for by
default) is the little-endian float32 array, base64-encoded.

Example::

    curl localhost:8080/v1/embeddings -d '{"model": "smollm2", "input": ["a", "b"]}'
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.backend import Embeddings
from sluice.server.jsonbody import BodyLimits, check_embed_inputs, validate_body
from sluice.server.respond import CLIENT_GONE, errors_as, forward
from sluice.server.sse import error_frame, error_response, json_response
from sluice.server.state import read_json, server_state


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def inputs(self, limits: BodyLimits) -> list[str] | list[list[int]]:
        """The inputs as a list: texts, or token-id lists; a 400 naming what is wrong."""
        value = self.input
        items: list[Any] = [value] if isinstance(value, str) else list(value)
        if items and all(isinstance(x, int) for x in items):
            items = [items]  # one input as token ids
        return check_embed_inputs(items, limits)


def encode_vector(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def embeddings_body(model: str, result: Embeddings, fmt: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, fmt)}
            for i, v in enumerate(result.vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


@errors_as(error_response)
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    name = data.get("model")
    target = state.dispatcher.upstream(name) if isinstance(name, str) else None
    body = validate_body(data, EmbeddingsRequest, passthrough=target is not None)
    inputs = body.inputs(state.limits)  # an upstream's requests within the same limits
    if target is not None:  # the upstream's answer, its bytes unchanged
        data["model"] = target.model
        raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        await state.dispatcher.admit(target)
        answer = await target.backend().passthrough("/embeddings", raw, None)
        return await forward(
            request, state.settings, answer, failure_frame=error_frame, render_error=error_response
        )
    lease = await state.dispatcher.acquire(body.model)
    try:
        result = await lease.embed(inputs, truncate=False, dimensions=body.dimensions)
    finally:
        lease.release()
    return json_response(embeddings_body(body.model or lease.slot, result, body.encoding_format))
