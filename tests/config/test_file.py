"""The config file is read once, when the app is made; each package gets its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config import Settings
from sluice.config.file import ConfigError, ConfigFile
from sluice.server.state import build_state

CONFIG = """
[[models]]
name = "tiny"
source = "smollm2"
aliases = ["t"]

[[upstreams]]
name = "far"
urls = ["http://127.0.0.1:9"]
models = ["remote-model"]
"""


def test_every_package_gets_its_table_from_one_read(tmp_path: Path) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text(CONFIG)
    config = ConfigFile.read(path)
    path.unlink()  # nothing after this may read the file again
    settings = Settings(config=str(path), models_dir=str(tmp_path / "models"))
    state = build_state(settings, config=config)
    try:
        assert "tiny" in {spec.name for spec in state.registry.known()}
        assert [slot.name for slot in state.dispatcher.upstreams] == ["far"]
    finally:
        state.offload.close()


def test_an_unknown_top_level_table_names_the_file_and_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text("[modles]\n")
    with pytest.raises(ConfigError) as info:
        ConfigFile.read(path)
    assert str(path) in str(info.value) and "'modles'" in str(info.value)
    assert "(known: keys, models, server, upstreams)" in str(info.value)
