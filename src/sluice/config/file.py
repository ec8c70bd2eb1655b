"""The TOML config file (``--config``): read, with errors that name the file and key.

Each top-level table belongs to one package: ``[[models]]`` to the model catalog,
``[[upstreams]]`` to the upstream backend, ``[keys]`` to the server's auth.

Example::

    data = read_toml(Path("sluice.toml"))   # ConfigError if missing or not TOML
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """The model configuration is wrong; the message names the file, entry and key."""


def read_toml(file: Path) -> dict[str, Any]:
    try:
        with file.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: not valid TOML ({exc})") from None


def describe_value(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    kinds |= {list: "a list", dict: "a table"}
    return f"{kinds.get(type(value), type(value).__name__)} ({value!r})"
