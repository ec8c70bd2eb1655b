"""The ``[[upstreams]]`` of the config file: OpenAI-compatible servers sluice fronts.

Example (a file)::

    [[upstreams]]
    name = "gpu-box"                      # the slot's name (metrics, headers)
    urls = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]   # replicas (or url = "...")
    api_key_env = "GPU_BOX_KEY"           # or api_key = "..."
    models = ["Qwen/Qwen2.5-7B-Instruct"] # omitted: whatever its /v1/models lists
    aliases = { qwen = "Qwen/Qwen2.5-7B-Instruct" }
    timeout = 300                         # seconds without a byte before it counts as failed
    native_apis = ["anthropic"]           # dialects it speaks itself: their requests pass through
    affinity = true                       # a conversation's turns to the replica holding its prefix
    affinity_load_factor = 1.1            # ... while it has at most 1.1x the mean requests + 1
    failover = true                       # a stream dropped mid-answer: another replica continues
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sluice.config.file import ConfigError, ConfigFile, describe_value
from sluice.upstream.affinity import DEFAULT_LOAD_FACTOR

DEFAULT_TIMEOUT = 300.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_HEALTH_INTERVAL = 10.0
# Dialects besides OpenAI's that an upstream may speak itself (``native_apis``): a request
# in one of them then goes up unchanged (only ``model`` rewritten) and its bytes come back.
NATIVE_APIS = frozenset({"anthropic", "responses", "gemini"})

_KEYS = frozenset(
    {
        "name",
        "url",
        "urls",
        "api_key",
        "api_key_env",
        "models",
        "aliases",
        "timeout",
        "connect_timeout",
        "health_interval",
        "native_apis",
        "affinity",
        "affinity_load_factor",
        "failover",
    }
)


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One upstream slot: a server (or its replicas) and the models it serves."""

    name: str
    urls: tuple[str, ...]  # base URLs without the /v1 suffix, e.g. http://10.0.0.5:8000
    api_key: str | None = None
    models: tuple[str, ...] = ()  # empty: discovered from the replicas' /v1/models
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> upstream model name
    timeout: float = DEFAULT_TIMEOUT  # to the first byte, and between bytes after it
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    health_interval: float = DEFAULT_HEALTH_INTERVAL  # seconds between checks of a healthy replica
    native_apis: frozenset[str] = frozenset()  # of NATIVE_APIS: passed through, not translated
    affinity: bool = True  # a conversation's turns go to the replica that holds its prefix
    affinity_load_factor: float = DEFAULT_LOAD_FACTOR  # ... within this bound (affinity.py)
    failover: bool = True  # a stream dropped mid-answer is continued by another replica

    def __hash__(self) -> int:
        return hash((self.name, self.urls))


def base_url(url: str) -> str:
    """``http://h:8000/v1/`` -> ``http://h:8000``: requests append ``/v1/...`` themselves."""
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    return url


def upstreams_of(config: ConfigFile, env: Mapping[str, str] | None = None) -> list[UpstreamSpec]:
    """The ``[[upstreams]]`` of the config file; anything wrong is a :class:`ConfigError`
    naming the file, the entry and the key."""
    file = config.path
    entries = config.table("upstreams") or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{file}: 'upstreams' must be an array of tables ([[upstreams]])")
    specs = [_entry(file, i, e, os.environ if env is None else env) for i, e in enumerate(entries)]
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        first = seen.setdefault(spec.name.lower(), i)
        if first != i:
            raise ConfigError(
                f"{file}: upstreams[{i}] ({spec.name!r}): 'name' repeats upstreams[{first}]"
            )
    return specs


class _Table:
    def __init__(self, file: Path, index: int, table: dict[str, Any]) -> None:
        self.table = table
        name = table.get("name")
        named = isinstance(name, str) and name.strip()
        self.where = f"{file}: upstreams[{index}]" + (f" ({name!r})" if named else "")

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}: '{key}' {problem}")

    def text(self, key: str) -> str | None:
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty string, not {describe_value(value)}")
        return value.strip()

    def texts(self, key: str) -> tuple[str, ...]:
        value = self.table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise self.error(
                key, f"must be a list of non-empty strings, not {describe_value(value)}"
            )
        return tuple(v.strip() for v in value)

    def seconds(self, key: str, default: float) -> float:
        value = self.table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.error(
                key, f"must be a positive number of seconds, not {describe_value(value)}"
            )
        return float(value)


def _entry(file: Path, index: int, table: dict[str, Any], env: Mapping[str, str]) -> UpstreamSpec:
    t = _Table(file, index, table)
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise t.error(unknown[0], f"is not a known key (known: {', '.join(sorted(_KEYS))})")
    name = t.text("name")
    if name is None:
        raise t.error("name", "is required")
    if "url" in table and "urls" in table:
        raise t.error("urls", "and 'url' are both given: use one")
    single = t.text("url")
    urls = (single,) if single is not None else t.texts("urls")
    if not urls:
        raise t.error("urls", "is required: the server's base URL (or its replicas' URLs)")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise t.error("urls", f"must be http(s) URLs, not {url!r}")
    if "api_key" in table and "api_key_env" in table:
        raise t.error("api_key_env", "and 'api_key' are both given: use one")
    api_key = t.text("api_key")
    key_env = t.text("api_key_env")
    if key_env is not None:
        api_key = env.get(key_env)
        if not api_key:
            raise t.error("api_key_env", f"names {key_env}, which is not set in the environment")
    models = t.texts("models")
    aliases = table.get("aliases", {})
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip()
        for k, v in aliases.items()
    ):
        raise t.error(
            "aliases", f'must be a table of alias = "upstream model", not {describe_value(aliases)}'
        )
    if models:
        listed = {m.lower() for m in models}
        for alias, target in aliases.items():
            if target.lower() not in listed:
                raise t.error("aliases", f"maps {alias!r} to {target!r}, which is not in 'models'")
    native = t.texts("native_apis")
    for api in native:
        if api not in NATIVE_APIS:
            raise t.error("native_apis", f"names {api!r}; known: {', '.join(sorted(NATIVE_APIS))}")
    affinity = table.get("affinity", True)
    if not isinstance(affinity, bool):
        raise t.error("affinity", f"must be true or false, not {describe_value(affinity)}")
    factor = table.get("affinity_load_factor", DEFAULT_LOAD_FACTOR)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise t.error(
            "affinity_load_factor", f"must be a number of at least 1, not {describe_value(factor)}"
        )
    failover = table.get("failover", True)
    if not isinstance(failover, bool):
        raise t.error("failover", f"must be true or false, not {describe_value(failover)}")
    return UpstreamSpec(
        name=name,
        failover=failover,
        native_apis=frozenset(native),
        affinity=affinity,
        affinity_load_factor=float(factor),
        urls=tuple(dict.fromkeys(base_url(u) for u in urls)),
        api_key=api_key,
        models=models,
        aliases={k.strip(): v.strip() for k, v in aliases.items()},
        timeout=t.seconds("timeout", DEFAULT_TIMEOUT),
        connect_timeout=t.seconds("connect_timeout", DEFAULT_CONNECT_TIMEOUT),
        health_interval=t.seconds("health_interval", DEFAULT_HEALTH_INTERVAL),
    )
