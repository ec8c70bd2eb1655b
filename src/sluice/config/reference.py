"""The settings reference, ``docs/configuration.md``, made from :class:`Settings`.

A test fails when the committed file differs from what this prints. Regenerate it::

    .venv/bin/python -m sluice.config.reference > docs/configuration.md
"""

from __future__ import annotations

from dataclasses import fields

from sluice.config.settings import GROUPS, Settings, env_var, flag_name, shown_default


def markdown() -> str:
    """The reference: one table per group, one row per setting."""
    lines = [
        "# Configuration",
        "",
        (
            "<!-- Generated from src/sluice/config/settings.py by "
            "`python -m sluice.config.reference`; edit the settings, not this file. -->"
        ),
        "",
        (
            "Every setting of `sluice serve` is a flag and an environment variable. A flag wins "
            "over the environment, which wins over the default:"
        ),
        "",
        "```sh",
        "SLUICE_PORT=9000 sluice serve --ctx 8192",
        "```",
        "",
        (
            "The config file (`--config`) holds what does not fit in a flag: the models "
            "(`[[models]]`, [models](models.md)), the upstream servers (`[[upstreams]]`, "
            "[upstreams](upstreams.md)) and the API keys (`[keys]`, [API keys](api-keys.md))."
        ),
    ]
    by_group = {
        key: [f for f in fields(Settings) if f.metadata["group"] == key] for key, *_ in GROUPS
    }
    for key, title, blurb in GROUPS:
        lines += [
            "",
            f"## {title[0].upper()}{title[1:]}",
            "",
            f"{blurb[0].upper()}{blurb[1:]}.",
            "",
        ]
        lines += ["| flag | environment | default | what it sets |", "|---|---|---|---|"]
        for f in by_group[key]:
            choices = f.metadata["choices"]
            what = f.metadata["help"] + (f"; one of {', '.join(choices)}" if choices else "")
            flag = flag_name(f)
            lines.append(
                f"| `{flag}` | `{env_var(f)}` | {_cell(shown_default(f))} | {_cell(what)} |"
            )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


if __name__ == "__main__":
    print(markdown(), end="")
