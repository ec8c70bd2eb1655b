"""Settings: defaults, overridden by ``SLUICE_*`` environment variables, then by flags.

Example::

    settings = Settings.from_env(port=9000)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from sluice.catalog import DEFAULT_MODEL


@dataclass(frozen=True, slots=True)
class Settings:
    # model
    model: str = DEFAULT_MODEL  # packaged name or path to a .gguf
    chat_template: str | None = None  # path to a Jinja file overriding the GGUF's template
    strict_model_names: bool = False
    tool_format: str | None = None  # hermes | llama3 | mistral | generic; default: from template
    # engine
    parallel: int = 4
    ctx: int = 4096  # tokens per sequence
    batch: int = 512
    threads: int = 0  # 0: all cores
    queue: int = 16
    default_max_tokens: int | None = None
    # http
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    ping_interval: float = 10.0
    log_level: str = "info"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults < ``SLUICE_<FIELD>`` environment variables < keyword overrides."""
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"SLUICE_{f.name.upper()}")
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, f.type, raw)
        settings = cls(**values)
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(settings, **given)


def _parse(name: str, type_name: Any, raw: str) -> Any:
    kind = str(type_name)
    try:
        if kind.startswith("bool"):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError as exc:
        raise ValueError(f"SLUICE_{name.upper()}={raw!r} is not a valid {kind}") from exc
    return raw
