"""The ``[[upstreams]]`` table: what each entry may say, and errors that name the entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config.file import ConfigError, ConfigFile
from sluice.upstream.config import upstreams_of


def read(tmp_path: Path, entry: str) -> ConfigFile:
    path = tmp_path / "sluice.toml"
    path.write_text(f'[[upstreams]]\nname = "gpu"\nurl = "http://127.0.0.1:8000/v1"\n{entry}\n')
    return ConfigFile.read(str(path))


def test_native_apis_name_the_dialects_that_pass_through(tmp_path: Path) -> None:
    (spec,) = upstreams_of(read(tmp_path, 'native_apis = ["anthropic"]'))
    assert spec.native_apis == frozenset({"anthropic"})
    assert spec.urls == ("http://127.0.0.1:8000",)
    (plain,) = upstreams_of(read(tmp_path, ""))
    assert plain.native_apis == frozenset()  # by default every dialect is translated


def test_affinity_is_on_by_default(tmp_path: Path) -> None:
    (plain,) = upstreams_of(read(tmp_path, ""))
    assert (plain.affinity, plain.affinity_load_factor) == (True, 1.1)
    (spec,) = upstreams_of(read(tmp_path, "affinity = false\naffinity_load_factor = 2"))
    assert (spec.affinity, spec.affinity_load_factor) == (False, 2.0)


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ('native_apis = ["klingon"]', "'native_apis' names 'klingon'; known: anthropic"),
        ('native_apis = "anthropic"', "'native_apis' must be a list of non-empty strings"),
        ("natives = []", "'natives' is not a known key"),
        ('affinity = "yes"', "'affinity' must be true or false"),
        ("affinity_load_factor = 0.9", "'affinity_load_factor' must be a number of at least 1"),
        ("affinity_load_factor = true", "'affinity_load_factor' must be a number of at least 1"),
    ],
)
def test_a_wrong_entry_is_named(tmp_path: Path, entry: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        upstreams_of(read(tmp_path, entry))
    assert "upstreams[0] ('gpu')" in str(info.value) and words in str(info.value)
