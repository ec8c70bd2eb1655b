"""Wire schemas of LM Studio's model-management requests (REST API v1), validated with pydantic.

Unknown fields are accepted and reported (``unknown_fields``) so the route can
log them: LM Studio adds load options from release to release, and a tool
written for a newer one must still load models here. :func:`parse` turns a
validation error into an :class:`~sluice.errors.InvalidRequest` naming the field.

Example::

    body = parse({"model": "gemma-3-270m", "context_length": 1024}, LoadModelRequest)
    body.context_length   # 1024
    parse({"instance_id": 7}, UnloadModelRequest)
    # -> InvalidRequest("Invalid 'instance_id': Input should be a valid string")
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluice.errors import InvalidRequest

log = logging.getLogger("sluice.api")

# Below this a context holds hardly a system prompt; llama.cpp itself pads tiny ones up.
MIN_CONTEXT_LENGTH = 64


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class LoadModelRequest(_Wire):
    """``POST /api/v1/models/load``."""

    model: str = Field(min_length=1)
    context_length: int | None = Field(default=None, ge=MIN_CONTEXT_LENGTH)
    # LM Studio's "max concurrent predictions"; sluice's --parallel for this model.
    parallel: int | None = Field(default=None, ge=1)
    # Options llama.cpp has but sluice sets per server, not per model: validated, then
    # reported as not applied (LM Studio ignores them too where its engine lacks them).
    eval_batch_size: int | None = Field(default=None, ge=1)
    flash_attention: bool | None = None
    num_experts: int | None = Field(default=None, ge=0)
    offload_kv_cache_to_gpu: bool | None = None
    echo_load_config: bool = False
    # Seconds idle before it unloads; omitted: never (an explicit load stays, as in LM Studio).
    ttl: float | None = Field(default=None, gt=0)


class UnloadModelRequest(_Wire):
    """``POST /api/v1/models/unload``."""

    instance_id: str = Field(min_length=1)


class DownloadModelRequest(_Wire):
    """``POST /api/v1/models/download``: sluice takes the URL of one ``.gguf`` file."""

    model: str = Field(min_length=1)
    sha256: str | None = None  # checked by the download manager (64 hex digits)
    filename: str | None = None  # the name in the models folder; default: the URL's
    quantization: str | None = None  # LM Studio picks a file of a repo by it; a URL names one


M = TypeVar("M", bound=_Wire)


def parse(data: dict[str, Any], model: type[M]) -> M:
    """``data`` as ``model``; :class:`InvalidRequest` naming the first bad field."""
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        # These bodies are flat: the location is the field, plus an index for a list.
        field = ".".join(str(step) for step in first["loc"])
        raise InvalidRequest(f"Invalid '{field}': {first['msg']}", param=field or None) from exc
    unknown = parsed.unknown_fields()
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown))
    return parsed
