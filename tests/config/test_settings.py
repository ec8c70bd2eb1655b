"""Each setting is declared once: its flag, its environment variable and its reference
row all come from the declaration in ``sluice.config.settings``."""

from __future__ import annotations

from dataclasses import Field, fields
from pathlib import Path
from typing import Any

import pytest

from sluice.cli import build_parser, main, settings_from_args
from sluice.config import GROUPS, Settings, env_var, flag_name, kind
from sluice.config.reference import markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
FIELDS = fields(Settings)


def _value(f: Field[Any]) -> tuple[str, object]:
    """A value unlike the default, as a command line writes it and as it parses."""
    match kind(f):
        case "int":
            return "7", 7
        case "float":
            return "2.5", 2.5
        case _:
            choices = f.metadata["choices"]
            text = choices[-1] if choices else "some-value"
            return text, text


def test_the_committed_reference_is_the_generated_one() -> None:
    assert DOCS.read_text() == markdown(), (
        "docs/configuration.md is stale: python -m sluice.config.reference > docs/configuration.md"
    )


def test_the_reference_has_a_row_per_setting_naming_flag_and_variable() -> None:
    text = markdown()
    for f in FIELDS:
        assert f"| `{flag_name(f)}` | `{env_var(f)}` |" in text


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_setting_is_a_flag_that_sets_it(f: Field[Any]) -> None:
    name = f.name
    if kind(f) == "bool":
        default = getattr(Settings(), name)
        flag = flag_name(f) if not default else "--no-" + flag_name(f)[2:]
        args = build_parser().parse_args(["serve", flag])
        assert getattr(settings_from_args(args), name) is (not default)
        return
    text, parsed = _value(f)
    args = build_parser().parse_args(["serve", flag_name(f), text])
    assert getattr(settings_from_args(args), name) == parsed


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_setting_is_an_environment_variable(f: Field[Any]) -> None:
    name = f.name
    if kind(f) == "bool":
        flipped = not getattr(Settings(), name)
        env = {env_var(f): "true" if flipped else "false"}
        assert getattr(Settings.from_env(env), name) is flipped
        return
    text, parsed = _value(f)
    assert getattr(Settings.from_env({env_var(f): text}), name) == parsed


def test_an_environment_variable_outside_the_choices_is_refused() -> None:
    with pytest.raises(ValueError, match="SLUICE_FLASH_ATTN='fast' is not one of auto, on, off"):
        Settings.from_env({"SLUICE_FLASH_ATTN": "fast"})
    assert Settings.from_env({"SLUICE_FLASH_ATTN": "on"}).flash_attn == "on"


def test_a_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_PORT", "9000")
    monkeypatch.setenv("SLUICE_CTX", "1024")
    args = build_parser().parse_args(["serve", "--port", "9100"])
    settings = settings_from_args(args)
    assert (settings.port, settings.ctx) == (9100, 1024)


def test_every_setting_has_a_known_group_and_help() -> None:
    keys = {key for key, *_ in GROUPS}
    for f in FIELDS:
        assert f.metadata["group"] in keys, f.name
        assert f.metadata["help"].strip(), f.name
    assert {f.metadata["group"] for f in FIELDS} == keys  # no empty group in --help


def test_serve_help_shows_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for _, title, _ in GROUPS:
        assert f"\n{title}:\n" in text
    assert "--cache-ram N" in text and "SLUICE_CACHE_RAM_MB" in text
