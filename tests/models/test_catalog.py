"""The model catalog: packaged models, the models folder, the config file, and discovery."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sluice.config import Settings
from sluice.core.errors import EngineFailure
from sluice.models.catalog import (
    ConfigError,
    ModelSpec,
    default_spec,
    delete_from_models_dir,
    discover,
    load_config,
    packaged_specs,
    resolve_model,
    resolve_source,
    scan_models_dir,
)


@pytest.fixture(autouse=True)
def _no_user_models(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """The default models folder (under XDG_DATA_HOME) is an empty temporary one."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg")))


def _touch(root: Path, *names: str) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not read during a scan")


def _names(specs: list[ModelSpec]) -> list[str]:
    return [s.name for s in specs]


# -- packaged -----------------------------------------------------------------------


def test_packaged_specs_resolve_to_the_packaged_files() -> None:
    specs = packaged_specs()
    assert [(s.name, s.aliases, s.origin) for s in specs] == [
        ("smollm2-135m-instruct", ("smollm2",), "packaged"),
        ("gemma-3-270m", ("gemma3-270m",), "packaged"),
    ]
    for spec, key in zip(specs, ("smollm2", "gemma3-270m")):
        path = resolve_source(spec)
        assert path == resolve_model(key).path and path.is_file()


def test_resolve_source_of_a_path(tmp_path: Path) -> None:
    _touch(tmp_path, "x.gguf")
    assert resolve_source(ModelSpec("x", str(tmp_path / "x.gguf"))) == tmp_path / "x.gguf"
    with pytest.raises(EngineFailure, match="'gone' has no file at"):
        resolve_source(ModelSpec("gone", str(tmp_path / "gone.gguf")))


# -- the models folder ------------------------------------------------------------


def test_scan_names_and_skips(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        "qwen.gguf",
        "sub/deeper/llama.gguf",
        "big-00001-of-00003.gguf",
        "big-00002-of-00003.gguf",
        "big-00003-of-00003.gguf",
        "half.gguf.part",
        ".hidden.gguf",
        ".cache/inside-hidden.gguf",
        "mmproj-qwen-f16.gguf",
        "sub/MMPROJ.gguf",
        "notes.txt",
    )
    (tmp_path / "folder.gguf").mkdir()
    specs = scan_models_dir(tmp_path)
    assert _names(specs) == ["big", "qwen", "llama"]  # sorted by path
    assert {s.origin for s in specs} == {"models_dir"}
    by_name = {s.name: s for s in specs}
    assert by_name["big"].source == str(tmp_path / "big-00001-of-00003.gguf")
    assert by_name["llama"].source == str(tmp_path / "sub/deeper/llama.gguf")


def test_scan_clashing_stems_use_relative_paths(tmp_path: Path) -> None:
    _touch(tmp_path, "a.gguf", "team/a.gguf", "Model.gguf", "old/model.gguf", "solo.gguf")
    assert sorted(_names(scan_models_dir(tmp_path))) == [
        "Model",
        "a",
        "old/model",
        "solo",
        "team/a",
    ]


def test_scan_a_missing_folder_is_empty(tmp_path: Path) -> None:
    assert scan_models_dir(tmp_path / "nowhere") == []


# -- the config file ------------------------------------------------------------------


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return path


def test_config_full_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = _config(
        tmp_path,
        """
        [server]
        port = 9000
        [[upstreams]]
        url = "http://elsewhere"
        [keys]
        alice = "k"

        [[models]]
        name = "qwen"
        source = "models/qwen.gguf"
        aliases = ["q", "Qwen2.5"]
        ctx = 8192
        parallel = 2
        threads = 0
        gpu_layers = -1
        chat_template = "templates/qwen.jinja"
        tool_format = "hermes"
        ttl = 600
        sampling = { temperature = 0.7, top_k = 20, min_p = 0 }

        [[models]]
        name = "tiny"
        source = "SmolLM2"

        [[models]]
        name = "home"
        source = "~/m/home.gguf"
        ttl = 0.5
        """,
    )
    qwen, tiny, home = load_config(path)
    assert qwen == ModelSpec(
        name="qwen",
        source=str(tmp_path / "models/qwen.gguf"),
        origin="config",
        aliases=("q", "Qwen2.5"),
        ctx=8192,
        parallel=2,
        threads=0,
        gpu_layers=-1,
        chat_template=str(tmp_path / "templates/qwen.jinja"),
        tool_format="hermes",
        ttl=600.0,
        sampling=(("temperature", 0.7), ("top_k", 20.0), ("min_p", 0.0)),
    )
    assert (tiny.source, tiny.ctx, tiny.aliases) == ("SmolLM2", None, ())  # a packaged name
    assert (home.source, home.ttl) == (str(tmp_path / "home/m/home.gguf"), 0.5)


def test_config_without_models(tmp_path: Path) -> None:
    assert load_config(_config(tmp_path, "[server]\nport = 1\n")) == []


@pytest.mark.parametrize(
    ("entry", "where", "key", "problem"),
    [
        ('name = "a"\nsource = "a.gguf"\ncolor = 1', "models[0] ('a')", "color", "not a known"),
        ('source = "a.gguf"', "models[0]", "name", "is required"),
        ('name = "a"', "models[0] ('a')", "source", "is required"),
        ('name = 3\nsource = "a.gguf"', "models[0]", "name", "non-empty string, not an integer"),
        ('name = " "\nsource = "a.gguf"', "models[0]", "name", "non-empty string"),
        ('name = "a"\nsource = "a.gguf"\nctx = "4096"', "models[0] ('a')", "ctx", "an integer"),
        ('name = "a"\nsource = "a.gguf"\nctx = true', "models[0] ('a')", "ctx", "a boolean"),
        ('name = "a"\nsource = "a.gguf"\nparallel = 0', "models[0] ('a')", "parallel", "at least 1"),
        ('name = "a"\nsource = "a.gguf"\nthreads = 1.5', "models[0] ('a')", "threads", "integer"),
        ('name = "a"\nsource = "a.gguf"\ngpu_layers = -2', "models[0] ('a')", "gpu_layers", "-1"),
        ('name = "a"\nsource = "a.gguf"\naliases = "b"', "models[0] ('a')", "aliases", "a list"),
        ('name = "a"\nsource = "a.gguf"\naliases = [1]', "models[0] ('a')", "aliases", "a list"),
        ('name = "a"\nsource = "a.gguf"\ntool_format = "xml"', "models[0] ('a')", "tool_format", "hermes"),
        ('name = "a"\nsource = "a.gguf"\nttl = -1', "models[0] ('a')", "ttl", "at least 0"),
        ('name = "a"\nsource = "a.gguf"\nttl = "1h"', "models[0] ('a')", "ttl", "seconds"),
        ('name = "a"\nsource = 7', "models[0] ('a')", "source", "string"),
        ('name = "a"\nsource = "a.gguf"\nchat_template = []', "models[0] ('a')", "chat_template", "string"),
        ('name = "a"\nsource = "a.gguf"\nsampling = 1', "models[0] ('a')", "sampling", "a table"),
        ('name = "a"\nsource = "a.gguf"\nsampling = {temp = 1}', "models[0] ('a')", "sampling.temp", "top_k"),
        ('name = "a"\nsource = "a.gguf"\nsampling = {top_k = 1.5}', "models[0] ('a')", "sampling.top_k", "an integer"),
        ('name = "a"\nsource = "a.gguf"\nsampling = {top_p = "1"}', "models[0] ('a')", "sampling.top_p", "a number"),
        ('name = "a"\nsource = "a.gguf"\nsampling = {min_p = 2}', "models[0] ('a')", "sampling.min_p", "[0.0, 1.0]"),
    ],
)  # fmt: skip
def test_config_entry_errors(
    tmp_path: Path, entry: str, where: str, key: str, problem: str
) -> None:
    path = _config(tmp_path, f"[[models]]\n{entry}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {where}: '{key}' "), message
    assert problem in message


def test_config_error_names_the_failing_entry(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[[models]]\nname = "ok"\nsource = "a.gguf"\n'
        '[[models]]\nname = "bad"\nsource = "b.gguf"\nctx = -5\n',
    )
    with pytest.raises(ConfigError, match=re.escape("models[1] ('bad'): 'ctx' must be at least 1")):
        load_config(path)


def test_config_duplicate_names(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[[models]]\nname = "qwen"\nsource = "a.gguf"\n'
        '[[models]]\nname = "other"\nsource = "b.gguf"\n'
        '[[models]]\nname = "QWEN"\nsource = "c.gguf"\n',
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: models[2] ('QWEN'): 'name' repeats models[0] ('qwen')"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[routes]\na = 1\n", "unknown top-level key 'routes'"),
        ("debug = true\n", "unknown top-level key 'debug'"),
        ("[models]\nname = 'a'\n", "'models' must be an array of tables"),
        ("[[models]\n", "not valid TOML"),
    ],
)
def test_config_file_errors(tmp_path: Path, text: str, problem: str) -> None:
    path = _config(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {problem}")):
        load_config(path)


def test_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


# -- discovery ----------------------------------------------------------------------


def test_discover_packaged_only() -> None:
    specs = discover(Settings())
    assert _names(specs) == ["smollm2-135m-instruct", "gemma-3-270m"]
    assert default_spec(Settings(), specs).name == "smollm2-135m-instruct"


def test_discover_precedence(tmp_path: Path) -> None:
    models = tmp_path / "models"
    _touch(models, "gemma-3-270m.gguf", "qwen.gguf", "phi.gguf")
    config = _config(
        tmp_path,
        '[[models]]\nname = "QWEN"\nsource = "elsewhere/qwen.gguf"\nctx = 1024\n'
        '[[models]]\nname = "SmolLM2-135M-Instruct"\nsource = "smollm2"\nctx = 2048\n',
    )
    specs = discover(Settings(models_dir=str(models), config=str(config)))
    by_name = {s.name.lower(): s for s in specs}
    assert sorted(by_name) == ["gemma-3-270m", "phi", "qwen", "smollm2-135m-instruct"]
    assert by_name["gemma-3-270m"].origin == "models_dir"  # models folder > packaged
    assert by_name["qwen"].origin == "config"  # config > models folder (case-insensitive)
    assert by_name["qwen"].source == str(tmp_path / "elsewhere/qwen.gguf")
    assert (by_name["smollm2-135m-instruct"].origin, by_name["smollm2-135m-instruct"].ctx) == (
        "config",
        2048,
    )
    assert by_name["phi"].origin == "models_dir"


def test_a_model_file_takes_a_packaged_alias(tmp_path: Path) -> None:
    _touch(tmp_path, "smollm2.gguf")
    settings = Settings(models_dir=str(tmp_path))
    specs = discover(settings)
    packaged = next(s for s in specs if s.name == "smollm2-135m-instruct")
    assert packaged.aliases == ()
    assert default_spec(settings, specs).source == str(tmp_path / "smollm2.gguf")


def test_alias_colliding_with_a_name(tmp_path: Path) -> None:
    _touch(tmp_path / "models", "phi.gguf")
    config = _config(tmp_path, '[[models]]\nname = "qwen"\nsource = "q.gguf"\naliases = ["PHI"]\n')
    with pytest.raises(ConfigError) as info:
        discover(Settings(models_dir=str(tmp_path / "models"), config=str(config)))
    assert str(info.value) == (
        "'phi' names two models: model 'phi' (models_dir, name) and model 'qwen' (config, alias)"
    )


def test_alias_colliding_with_an_alias(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        '[[models]]\nname = "a"\nsource = "a.gguf"\naliases = ["fast"]\n'
        '[[models]]\nname = "b"\nsource = "b.gguf"\naliases = ["Fast"]\n',
    )
    with pytest.raises(ConfigError, match="'fast' names two models: model 'a' .* model 'b'"):
        discover(Settings(config=str(config)))


def test_alias_colliding_with_a_packaged_name(tmp_path: Path) -> None:
    config = _config(
        tmp_path, '[[models]]\nname = "a"\nsource = "a.gguf"\naliases = ["gemma-3-270m"]\n'
    )
    with pytest.raises(ConfigError, match="model 'gemma-3-270m' \\(packaged, name\\)"):
        discover(Settings(config=str(config)))


def test_model_path_not_otherwise_listed(tmp_path: Path) -> None:
    _touch(tmp_path, "own/custom.gguf", "models/listed.gguf", "other/listed.gguf")
    own = str(tmp_path / "own/custom.gguf")
    settings = Settings(model=own, models_dir=str(tmp_path / "models"))
    specs = discover(settings)
    assert specs[-1] == ModelSpec("custom", own, "path")
    assert default_spec(settings, specs) == specs[-1]
    # A file the models folder lists already: no second entry.
    listed = Settings(model=str(tmp_path / "models/listed.gguf"), models_dir=settings.models_dir)
    specs = discover(listed)
    assert [s.origin for s in specs].count("path") == 0
    assert default_spec(listed, specs).origin == "models_dir"
    # Same stem, another file: named by its full path, so neither hides the other.
    clash = Settings(model=str(tmp_path / "other/listed.gguf"), models_dir=settings.models_dir)
    specs = discover(clash)
    assert specs[-1].name == str(tmp_path / "other/listed.gguf")
    assert default_spec(clash, specs) == specs[-1]


def test_default_spec_by_alias_and_renamed_packaged(tmp_path: Path) -> None:
    specs = discover(Settings())
    assert default_spec(Settings(model="GEMMA3-270M"), specs).name == "gemma-3-270m"
    config = _config(tmp_path, '[[models]]\nname = "smollm2-135m-instruct"\nsource = "smollm2"\n')
    settings = Settings(config=str(config))  # the config drops the alias "smollm2"
    specs = discover(settings)
    assert default_spec(settings, specs).origin == "config"


def test_default_spec_unknown(tmp_path: Path) -> None:
    specs = discover(Settings())
    with pytest.raises(EngineFailure, match="No model 'nope'"):
        default_spec(Settings(model="nope"), specs)
    with pytest.raises(EngineFailure, match="No model"):
        default_spec(Settings(model=str(tmp_path / "missing.gguf")), specs)


def test_delete_takes_every_shard_and_the_folders_left_empty(tmp_path: Path) -> None:
    folder = tmp_path / "org" / "big"
    folder.mkdir(parents=True)
    for i in (1, 2, 3):
        (folder / f"big-{i:05d}-of-00003.gguf").write_bytes(b"x" * 10)
    (tmp_path / "org" / "keep.gguf").write_bytes(b"k")
    other = tmp_path / "org" / "big-00002-of-00003.gguf"  # another folder: not a sibling
    other.write_bytes(b"o")
    (spec,) = [s for s in scan_models_dir(tmp_path) if s.name == "big"]
    assert delete_from_models_dir(spec, tmp_path) == 30
    assert not folder.exists() and (tmp_path / "org" / "keep.gguf").exists() and other.exists()
    assert [s.name for s in scan_models_dir(tmp_path)] == ["keep"]
    with pytest.raises(ValueError, match="not a file in the models folder"):
        delete_from_models_dir(ModelSpec("x", str(tmp_path / "org" / "keep.gguf")), tmp_path)
    outside = ModelSpec("y", "/elsewhere/y.gguf", "models_dir")
    with pytest.raises(ValueError, match="not a file in the models folder"):
        delete_from_models_dir(outside, tmp_path)
