"""Settings: defaults, overridden by ``SLUICE_*`` environment variables, then by flags.

Each setting is declared once, here: its default, its group and its help text. The
``sluice serve`` flags, the ``SLUICE_<NAME>`` environment variables and the settings
reference (``docs/configuration.md``, :mod:`sluice.config.reference`) are all made
from these declarations.

Example::

    settings = Settings.from_env(port=9000)
"""

from __future__ import annotations

import os
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2"
# Reasoning efforts as budgets (sluice.local.budget): LiteLLM's table from efforts to
# Anthropic's and Gemini's budgets, which clients translating between dialects use.
DEFAULT_EFFORTS = "none=0,minimal=128,low=1024,medium=2048,high=4096,xhigh=8192"  # the packaged SmolLM2-135M-Instruct

# The groups, in the order ``--help`` and the reference show them: (key, title, blurb).
GROUPS: tuple[tuple[str, str, str], ...] = (
    ("server", "server", "where the server listens, who may call it, how it logs and stops"),
    (
        "models",
        "models",
        (
            "which models exist and how many stay loaded (a request's 'model' picks one; "
            "it loads on first use)"
        ),
    ),
    ("engine", "engine", "llama.cpp: slots, context, batching, threads, the prompt cache"),
    ("streaming", "streaming", "how answers reach a client, and what a slow client costs"),
    ("limits", "limits", "request limits, each one answered with a 4xx naming the field"),
    (
        "tools",
        "server-side tools",
        "LM Studio's /api/v1/chat integrations over MCP; off unless enabled",
    ),
    (
        "store",
        "store",
        "conversations (/c1), stored responses and usage: a SQLite file or a PostgreSQL URL",
    ),
)


def setting(
    default: Any,
    group: str,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    shown: str | None = None,
) -> Any:
    """Declare one setting: its default, its group (one of :data:`GROUPS`) and its help.

    ``flag``: the option's name when it is not ``--<name-with-dashes>``; ``shown``: the
    default as the help and the reference show it, when the value itself says little
    (``None`` meaning "the GGUF's", say).
    """
    meta = {"group": group, "help": help, "flag": flag, "choices": choices, "shown": shown}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Settings:
    # -- server
    host: str = setting("127.0.0.1", "server", "address to bind")
    port: int = setting(8080, "server", "port to bind")
    api_key: str | None = setting(
        None,
        "server",
        "require 'Authorization: Bearer <key>' on every route but /health and the web "
        "page's files (/, /ui/...); this key is named 'default' and is an admin key",
        shown="none",
    )
    api_keys: str | None = setting(
        None,
        "server",
        "named keys, 'name:key,...' (each request is accounted to its key's name; user keys, "
        "but one named admin); also the config file's [keys] table, where a key may have "
        'role = "admin"',
        shown="none",
    )
    allow_unauthenticated_admin: bool = setting(
        False,
        "server",
        "with no API keys on an address beyond loopback, let anyone load, unload, download "
        "and delete models (refused otherwise)",
    )
    log_level: str = setting("info", "server", "debug, info, warning or error")
    prepare_workers: int = setting(
        2, "server", "threads that render templates, tokenize and build grammars, off the "
        "event loop"
    )  # fmt: skip
    shutdown_grace: float = setting(
        5.0,
        "server",
        "seconds running requests may finish after SIGTERM before they are ended with an "
        "error frame",
    )
    # -- models
    model: str = setting(
        DEFAULT_MODEL,
        "models",
        "the default model, loaded at start: a packaged model (smollm2, "
        "smollm2-135m-instruct, gemma3-270m, gemma-3-270m), a model of the models folder "
        "or the config file, or a path to a .gguf file",
    )
    models_dir: str | None = setting(
        None,
        "models",
        "every .gguf file below this folder is a model; downloads go here",
        shown="$XDG_DATA_HOME/sluice/models",
    )
    download_allow_private: bool = setting(
        False,
        "models",
        "let /api/v1/models/download fetch from loopback, private, link-local (cloud "
        "metadata) and other non-public addresses; off: refused before a job starts, and "
        "every connection (redirects too) is checked again; through HTTP(S)_PROXY the "
        "target host is checked",
    )
    download_allowed_hosts: str | None = setting(
        None,
        "models",
        "'host,host:port,*.domain,...': download URLs, and every redirect they send, "
        "only on these (each still address-checked)",
        shown="any public host",
    )
    config: str | None = setting(
        None,
        "models",
        "TOML file with [[models]], [[upstreams]] and [keys] tables (docs/models.md, "
        "docs/upstreams.md, docs/api-keys.md)",
        shown="none",
    )
    chat_template: str | None = setting(
        None,
        "models",
        "Jinja chat template overriding the model's own: a file, or a bundled family "
        "template's name (e.g. Qwen3-Coder; see docs/formats.md)",
        shown="the GGUF's",
    )
    mmproj: str | None = setting(
        None,
        "models",
        "the default model's projector (a vision model's mmproj GGUF): it then takes "
        "images (docs/vision.md)",
        shown="an mmproj*.gguf beside the model file",
    )
    tool_format: str | None = setting(
        None,
        "models",
        "how the model writes tool calls, over what its chat template shows ('generic': "
        "tools described in a system prompt)",
        choices=("hermes", "llama3", "mistral", "generic"),
        shown="learned from the chat template",
    )
    strict_model_names: bool = setting(
        False,
        "models",
        "answer 404 for an unknown 'model' on chat and generation routes instead of serving"
        " the default one (lookups such as `/api/show` and `GET /v1/models/{id}` answer 404"
        " either way)",
    )
    max_loaded_models: int = setting(
        4, "models", "models loaded at once; the least recently used idle one unloads to make room"
    )
    model_ttl: float = setting(
        3600.0, "models", "seconds an idle model stays loaded; 0: until unloaded"
    )
    memory_budget_mb: int = setting(
        0,
        "models",
        "MiB all loaded models may use (weights + KV cache, estimated before a load, and "
        "the prompt caches, embedding contexts and grammar tokenizers they take since); a "
        "load that would not fit is refused; 0: 90% of RAM",
    )
    gpu_layers: int = setting(
        0,
        "models",
        "layers to offload to a GPU (needs llama-cpp-python built with CUDA or Metal)",
    )
    # -- engine
    parallel: int = setting(4, "engine", "sequences decoded together (slots) per model")
    ctx: int = setting(4096, "engine", "context tokens per sequence")
    batch: int = setting(512, "engine", "most tokens per decode step")
    threads: int = setting(0, "engine", "CPU threads for llama.cpp; 0: all cores")
    flash_attn: str = setting(
        "auto",
        "engine",
        "llama.cpp's fused (flash) attention: auto (llama.cpp's choice: fused wherever "
        "the device has it, the CPU included), on, or off. On the CPU, off decodes faster "
        "past a few hundred tokens of context (1.8x a step at 3,000) and makes drafts "
        "cheaper to verify, but slower with several short sequences (0.7x, 4 x 60 "
        "tokens), and keeps n_head x ctx x batch x 8 bytes of attention scores",
        choices=("auto", "on", "off"),
    )
    queue: int = setting(16, "engine", "requests that may wait for a slot; more get a 503")
    default_max_tokens: int | None = setting(
        None,
        "engine",
        "tokens generated when a request sets no limit",
        shown="until the end of the context",
    )
    cache_ram_mb: int = setting(
        2048,
        "engine",
        "MiB of RAM per loaded model for the KV state of recent prompts, restored when a "
        "prompt comes back after its slot was reused (within --memory-budget-mb too); 0: off",
        flag="--cache-ram",
    )
    prefill_budget: float = setting(
        0.5,
        "engine",
        "while other sequences generate, a long prompt's prefill gets this many times the "
        "time they use (measured), in chunks of about 0.5 s, so they keep about 1 / (1 + "
        "this) of their speed; a prompt that fits in one batch is prefilled whole",
    )
    max_draft: int = setting(
        16,
        "engine",
        "prompt-lookup speculation: the most tokens drafted from earlier text (the prompt "
        "and the answer) and verified in one decode, lossless; each sequence drafts only "
        "as long as its acceptance rate pays for the rows; 0: off (a request's "
        "speculative.max_draft may lower it)",
    )
    jump_forward: bool = setting(
        True,
        "engine",
        "decode the tokens a grammar forces (JSON keys and punctuation, tool-call markup) "
        "in one step without sampling them (a request's speculative.jump_forward may turn "
        "it off)",
    )
    reasoning_budget: int = setting(
        -1,
        "engine",
        "tokens a reasoning block may take before sluice closes it (forcing the family's "
        "end marker, learned from its chat template) and the answer follows; 0: no "
        "reasoning; -1: no limit (a request's budget or effort overrides it)",
    )
    reasoning_budget_message: str = setting(
        "",
        "engine",
        "text written into the reasoning just before sluice closes it on the budget "
        "(llama-server's --reasoning-budget-message)",
    )
    reasoning_efforts: str = setting(
        DEFAULT_EFFORTS,
        "engine",
        "reasoning efforts (OpenAI's reasoning_effort, Ollama's think levels, LM Studio's "
        "reasoning, Gemini's thinkingLevel) as budgets: effort=tokens, comma-separated",
    )
    call_reasoning_budget: int = setting(
        256,
        "engine",
        "the reasoning budget of a forced call (tool_choice required or a named function) "
        "that sets none, and at most a quarter of its max_tokens, so the calls come within them; "
        "-1: only --reasoning-budget",
    )
    prompt_special_tokens: bool = setting(
        True,
        "engine",
        "in /v1/completions prompts, text such as <|im_end|> becomes the control token "
        "(chat messages are always plain text)",
    )
    # -- streaming
    ping_interval: float = setting(
        10.0, "streaming", "seconds of silence after which a stream sends a ': ping' comment"
    )
    stream_buffer: int = setting(
        256,
        "streaming",
        "engine steps of output held for a client that is not reading; then its generation pauses",
    )
    stall_timeout: float = setting(
        60.0,
        "streaming",
        "seconds a streaming client may stop reading before its request is aborted",
    )
    # -- limits
    max_body_bytes: int = setting(8 * 1024 * 1024, "limits", "request body size in bytes")
    max_json_depth: int = setting(64, "limits", "nesting of arrays and objects in a body")
    max_number_digits: int = setting(
        20, "limits", "digits of an integer in a body (20 fits a 64-bit seed)"
    )
    max_messages: int = setting(4096, "limits", "messages per chat request")
    max_stop: int = setting(4, "limits", "stop strings per request (OpenAI's limit)")
    max_stop_length: int = setting(256, "limits", "characters per stop string")
    max_logit_bias: int = setting(1024, "limits", "logit_bias entries")
    max_embedding_inputs: int = setting(
        2048, "limits", "inputs in one embeddings request (OpenAI's limit)"
    )
    embedding_ctx: int = setting(
        4096,
        "limits",
        "tokens one embedding input may have on a local model (its pooled context's size, "
        "at most the model's context); longer inputs are a 400, or cut where the dialect "
        "truncates",
    )
    max_tools: int = setting(128, "limits", "tools per request")
    max_schema_bytes: int = setting(
        128 * 1024, "limits", "JSON size of a request's tool and response schemas"
    )
    # -- tools
    mcp_config: str | None = setting(
        None,
        "tools",
        'an mcp.json ({"mcpServers": {label: {command, args, env} | {url, headers}}}): '
        "the servers requests name as plugin 'mcp/<label>'",
        shown="none",
    )
    allow_mcp_plugins: bool = setting(
        False,
        "tools",
        "let requests use the --mcp-config servers (they run commands on this machine: API "
        "keys are required, as in LM Studio)",
    )
    allow_ephemeral_mcp: bool = setting(
        False,
        "tools",
        "let requests name MCP servers by URL (public addresses only unless --mcp-allow-private)",
    )
    mcp_allowed_hosts: str | None = setting(
        None,
        "tools",
        "'host,host:port,...': ephemeral MCP servers only on these",
        shown="any public host",
    )
    mcp_allow_private: bool = setting(
        False,
        "tools",
        "let ephemeral MCP servers be on loopback, private or link-local addresses",
    )
    tool_rounds: int = setting(8, "tools", "model -> tools -> model rounds per request")
    tool_timeout: float = setting(
        30.0, "tools", "seconds per tool call, and per MCP server connect and listing"
    )
    tool_output_bytes: int = setting(
        64 * 1024, "tools", "bytes (UTF-8) of a tool's output beyond which the call fails"
    )
    # -- store
    store: str | None = setting(
        None,
        "store",
        "where the conversations (/c1), stored responses, usage and limits' counters are "
        "kept: a SQLite file, or a postgresql://user:password@host/db URL that several "
        "sluice instances share (docs/store.md)",
        shown="$XDG_DATA_HOME/sluice/sluice.db",
    )
    resume_grace: float = setting(
        300.0,
        "store",
        "seconds a stored Responses stream's events stay resumable after it ends; a "
        "foreground stream whose client left keeps generating this long for a resume",
    )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults < ``SLUICE_<FIELD>`` environment variables < keyword overrides."""
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(env_var(f))
            if raw is not None and raw != "":
                values[f.name] = _parse(f, raw)
        settings = cls(**values)
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(settings, **given)


def env_var(f: Field[Any]) -> str:
    """The environment variable that sets ``f``: ``SLUICE_<NAME>``."""
    return f"SLUICE_{f.name.upper()}"


def flag_name(f: Field[Any]) -> str:
    """The ``sluice serve`` option that sets ``f``."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def shown_default(f: Field[Any]) -> str:
    """``f``'s default as the help and the reference show it."""
    shown = f.metadata.get("shown")
    if shown is not None:
        return str(shown)
    default = f.default
    assert default is not MISSING
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def kind(f: Field[Any]) -> str:
    """``bool``, ``int``, ``float`` or ``str``: what the setting's value is."""
    name = str(f.type)
    for k in ("bool", "int", "float"):
        if name.startswith(k):
            return k
    return "str"


def default_models_dir() -> Path:
    """Where models live when ``--models-dir`` is not given: ``$XDG_DATA_HOME/sluice/models``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sluice" / "models"


def default_store_path() -> Path:
    """The conversations' database when ``--store`` is not given:
    ``$XDG_DATA_HOME/sluice/sluice.db``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sluice" / "sluice.db"


def _parse(f: Field[Any], raw: str) -> Any:
    """``raw`` (an environment variable's text) as ``f``'s kind of value."""
    k = kind(f)
    try:
        if k == "bool":
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if k == "int":
            return int(raw)
        if k == "float":
            return float(raw)
    except ValueError as exc:
        raise ValueError(f"{env_var(f)}={raw!r} is not a valid {f.type}") from exc
    choices = f.metadata["choices"]
    if choices and raw not in choices:
        raise ValueError(f"{env_var(f)}={raw!r} is not one of {', '.join(choices)}")
    return raw
