"""What a model file says: its GGUF metadata and the chat template in effect.

Read on a worker thread (file I/O; a packaged model may be assembled first), for
the model listings of every dialect and for ``/v1/info``.

Example::

    file = read_model_file(spec, settings)
    file.info.context_length, reasoning_capability(file.template)
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sluice.config import Settings
from sluice.core.errors import ModelLoadFailed, SluiceError
from sluice.core.model import ModelSpec
from sluice.local.templates import ChatTemplate, read_template
from sluice.models.catalog import projector_of, resolve_source
from sluice.models.gguf import (
    GgufError,
    GgufInfo,
    projector_inputs,
    read_gguf_info,
    replay_info,
)
from sluice.parsers.families import format_for
from sluice.parsers.registry import detect_reasoning

log = logging.getLogger("sluice.models")


@dataclass(frozen=True, slots=True)
class ModelFile:
    """A model's GGUF metadata, and the chat template in effect for it."""

    info: GgufInfo
    publisher: str  # general.organization, else "local"
    template: str | None  # an override file's (config or --chat-template), else the GGUF's
    supports_tools: bool
    projector: str | None = None  # its projector file: the model sees images
    inputs: tuple[str, ...] = ("text",)  # and "image", "audio": what its projector takes

    @property
    def vision(self) -> bool:
        return "image" in self.inputs

    @property
    def audio(self) -> bool:
        return "audio" in self.inputs


def read_model_file(spec: ModelSpec, settings: Settings) -> ModelFile:
    """Blocking (file I/O; a packaged model may be assembled first): run it off the loop.

    Raises :class:`ModelLoadFailed` when the file cannot be found or read.
    """
    if spec.replay is not None:
        return _replay_file(spec, settings)
    try:
        path = resolve_source(spec)
        info = read_gguf_info(path)
        publisher = info.organization or "local"
    except (SluiceError, GgufError, OSError) as exc:
        message = exc.message if isinstance(exc, SluiceError) else str(exc)
        raise ModelLoadFailed(f"Cannot read model '{spec.name}': {message}") from exc
    override = spec.chat_template or settings.chat_template
    projector = projector_of(replace(spec, source=str(path)), settings)
    inputs = ("text", *(projector_inputs(projector) if projector else ()))
    if override is None:
        return ModelFile(
            info, publisher, info.chat_template, info.supports_tools, projector, inputs
        )
    try:
        template = read_template(override)
    except (OSError, SluiceError) as exc:  # loading will say so; the listing shows the GGUF's
        log.warning("cannot read chat template %s: %s", override, exc)
        return ModelFile(
            info, publisher, info.chat_template, info.supports_tools, projector, inputs
        )
    return ModelFile(info, publisher, template, "tools" in template, projector, inputs)


def _replay_file(spec: ModelSpec, settings: Settings) -> ModelFile:
    """A replay model's listing: no weights; its answers file and its template."""
    assert spec.replay is not None
    override = spec.chat_template or settings.chat_template
    try:
        size = Path(spec.replay).stat().st_size
        template = read_template(override) if override else None
    except (OSError, SluiceError) as exc:
        message = exc.message if isinstance(exc, SluiceError) else str(exc)
        raise ModelLoadFailed(f"Cannot read model '{spec.name}': {message}") from exc
    info = replay_info(spec.replay, size, template, spec.ctx or settings.ctx)
    return ModelFile(info, "local", template, info.supports_tools)


def read_all_model_files(specs: list[ModelSpec], settings: Settings) -> dict[str, ModelFile | None]:
    """Every model's file (blocking); None for one that cannot be read, so one broken
    file does not hide the others."""
    files: dict[str, ModelFile | None] = {}
    for spec in specs:
        try:
            files[spec.name] = read_model_file(spec, settings)
        except ModelLoadFailed as exc:
            log.warning("%s", exc.message)
            files[spec.name] = None
    return files


def context_window(
    spec: ModelSpec, settings: Settings, file: ModelFile | None, loaded: int | None
) -> int:
    """A local model's context window: its loaded runner's (``loaded``), else what a load
    would give it (its ``ctx``, else ``--ctx``); never past what its file was trained for."""
    window = loaded if loaded is not None else (spec.ctx or settings.ctx)
    if file is not None and file.info.context_length:
        window = min(window, file.info.context_length)
    return window


def reasoning_capability(template: str | None) -> dict[str, Any] | None:
    """LM Studio's ``capabilities.reasoning`` for a chat template; None if it does not think.

    A template thinks if its learned format has reasoning markers (the ones the output
    parsers read: ``<think>``, ``<seed:think>``, gpt-oss's analysis channel, ...); it
    can be told not to think only if it reads a switch (``enable_thinking``, or
    ``thinking`` as Kimi K3 does; set through ``chat_template_kwargs``).
    """
    if template is None or not _thinks(template):
        return None
    switch = "enable_thinking" in template or _THINKING_SWITCH.search(template)
    options = ["off", "on"] if switch else ["on"]
    return {"allowed_options": options, "default": "on"}


_THINKING_SWITCH = re.compile(r"\bthinking is (?:un)?defined\b")


@functools.lru_cache(maxsize=64)
def _thinks(template: str) -> bool:
    """Whether the template's format has reasoning (its analysis: a few ms, once)."""
    if detect_reasoning(template) is not None:  # it writes <think>
        return True
    chat = ChatTemplate(template, bos_token="", eos_token="", model_id="listing")
    return chat.available and format_for(template, chat.render_probe).reasoning is not None
