"""The TOML config file (``--config``): read, with errors that name the file and key.

Each top-level table belongs to one package: ``[[models]]`` to the model catalog,
``[[upstreams]]`` to the upstream backend, ``[keys]`` to the server's auth.

The file is read once, when the app is made; each package is handed its table.

Example::

    config = ConfigFile.read("sluice.toml")   # ConfigError if missing, not TOML, or unknown
    config.table("models")                    # the [[models]] array, or None
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The top-level tables and who reads them; "server" is kept for server options.
TABLES = ("models", "upstreams", "keys", "server")


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


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """The config file's top-level tables, read and checked once."""

    path: Path
    tables: dict[str, Any]

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ConfigFile:
        """Read ``path``; a :class:`ConfigError` names it if it is missing, not TOML, or
        has a top-level key no package reads."""
        file = Path(path).expanduser()
        data = read_toml(file)
        unknown = sorted(set(data) - set(TABLES))
        if unknown:
            raise ConfigError(
                f"{file}: unknown top-level key '{unknown[0]}' (known: {', '.join(sorted(TABLES))})"
            )
        return cls(file, data)

    def table(self, name: str) -> Any:
        """The value of top-level key ``name``, or None when the file has none."""
        return self.tables.get(name)
