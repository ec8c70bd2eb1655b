"""The neutral description of a model: what the catalog lists and a backend loads.

Example::

    spec = ModelSpec(name="qwen", source="/models/qwen.gguf", origin="config", ctx=8192)
    "qwen" in spec.lookup_keys()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Origin = Literal["packaged", "models_dir", "config", "path"]
REPLAY = "replay:"  # a source that is recorded answers, not weights (sluice.engine.replay)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model the server knows: from the packages, the models folder or the config file.

    ``None`` fields take the server's settings (``--ctx``, ``--parallel``, ...).
    """

    name: str  # the key clients send as ``model``
    source: str  # packaged model name, path to a .gguf file, or "replay:<answers.jsonl>"
    origin: Origin = "path"
    aliases: tuple[str, ...] = ()
    ctx: int | None = None  # tokens per sequence
    parallel: int | None = None  # slots
    threads: int | None = None
    gpu_layers: int | None = None
    chat_template: str | None = None  # path to a Jinja file overriding the GGUF's template
    mmproj: str | None = None  # its projector (images); None: an mmproj*.gguf beside it
    tool_format: str | None = None  # hermes | llama3 | mistral | generic
    ttl: float | None = None  # idle seconds before unloading; 0: never
    # default sampling (temperature, top_k, top_p, min_p) over the GGUF's declared one
    sampling: tuple[tuple[str, float], ...] = ()

    @property
    def replay(self) -> str | None:
        """The answers file of a replay model (``source = "replay:answers.jsonl"``)."""
        return self.source[len(REPLAY) :] if self.source.startswith(REPLAY) else None

    def lookup_keys(self) -> tuple[str, ...]:
        """Its name and aliases, lower-cased: what a request's ``model`` is matched against."""
        return tuple(dict.fromkeys(k.lower() for k in (self.name, *self.aliases)))
