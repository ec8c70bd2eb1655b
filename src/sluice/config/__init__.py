"""Settings: defaults, overridden by ``SLUICE_*`` environment variables, then by flags.

Example::

    settings = Settings.from_env(port=9000)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2"  # the packaged SmolLM2-135M-Instruct


@dataclass(frozen=True, slots=True)
class Settings:
    # model
    model: str = DEFAULT_MODEL  # packaged name or path to a .gguf
    chat_template: str | None = None  # path to a Jinja file overriding the GGUF's template
    strict_model_names: bool = False
    tool_format: str | None = None  # hermes | llama3 | mistral | generic; default: from template
    gpu_layers: int = 0  # layers offloaded to a GPU (a llama-cpp-python built with a GPU backend)
    # many models
    models_dir: str | None = None  # every .gguf here is a model; None: default_models_dir()
    config: str | None = None  # TOML file with [[models]] entries
    max_loaded_models: int = 4  # least recently used idle model unloads to make room
    model_ttl: float = 3600.0  # seconds an idle model stays loaded; 0: until unloaded
    memory_budget_mb: int = 0  # weights + KV cache of all loaded models; 0: 90% of RAM
    # conversations (/c1) and stored responses: a SQLite file; None: default_store_path()
    store: str | None = None
    # engine
    parallel: int = 4
    ctx: int = 4096  # tokens per sequence
    batch: int = 512
    threads: int = 0  # 0: all cores
    queue: int = 16
    default_max_tokens: int | None = None
    # RAM per loaded model for the KV state of prompts whose slot was reused (llama-server's
    # --cache-ram); 0: off. 2 GiB holds ~60 prompts of 1500 tokens of SmolLM2-135M.
    cache_ram_mb: int = 2048
    # While other sequences generate, a step prefills a long prompt for at most this many
    # times their decode time (measured), so their token gap grows to ~(1 + it)x meanwhile;
    # prompts that fit in one batch are prefilled whole. 0: the minimum (8 tokens a step).
    prefill_budget: float = 0.5
    # server-side tools over MCP (LM Studio's /api/v1/chat "integrations"); both kinds off
    # unless enabled, as in LM Studio
    mcp_config: str | None = (
        None  # an mcp.json ({"mcpServers": {label: ...}}): plugin "mcp/<label>"
    )
    allow_mcp_plugins: bool = False  # the mcp.json servers (needs API keys: they run commands)
    allow_ephemeral_mcp: bool = False  # servers given in the request (streamable HTTP)
    mcp_allowed_hosts: str | None = None  # "host,host:port,...": ephemeral servers only there
    mcp_allow_private: bool = False  # ephemeral servers on loopback/private/link-local addresses
    tool_rounds: int = 8  # model -> tools -> model rounds per request
    tool_timeout: float = 30.0  # seconds per tool call (and per MCP connect + list)
    tool_output_bytes: int = 64 * 1024  # a tool's output (UTF-8) beyond this is a failure
    # http
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_keys: str | None = None  # SLUICE_API_KEYS="name:key,...": named keys (api/keys.py)
    max_body_bytes: int = 8 * 1024 * 1024
    ping_interval: float = 10.0
    log_level: str = "info"
    # request limits: each one a clear 4xx naming the field
    max_json_depth: int = 64  # nesting of arrays/objects anywhere in a body
    max_number_digits: int = 20  # digits of an integer literal (fits a 64-bit seed)
    max_messages: int = 4096
    max_stop: int = 4  # stop strings per request (OpenAI's limit)
    max_stop_length: int = 256  # characters per stop string
    max_logit_bias: int = 1024  # logit_bias entries
    max_tools: int = 128
    max_schema_bytes: int = 128 * 1024  # JSON size of the tools' and response_format's schemas
    max_grammar_repeat: int = 4096  # sum of the repetition bounds a grammar may expand
    max_grammar_alternatives: int = 32  # grammar alternatives open at one point (token cost)
    # text completions: control-token text in the prompt becomes control tokens
    prompt_special_tokens: bool = True
    # off-loop work (templates, tokenization, grammars)
    prepare_workers: int = 2
    # streaming backpressure
    stream_buffer: int = 256  # engine steps of output buffered for a client that is not reading
    stall_timeout: float = 60.0  # seconds a client may not read before its stream is aborted
    # shutdown
    shutdown_grace: float = 5.0  # seconds running streams may finish after SIGTERM

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


def default_models_dir() -> Path:
    """Where models live when ``--models-dir`` is not given: ``$XDG_DATA_HOME/sluice/models``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sluice" / "models"


def default_store_path() -> Path:
    """The conversations' database when ``--store`` is not given:
    ``$XDG_DATA_HOME/sluice/sluice.db``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sluice" / "sluice.db"


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
