"""The leaf of the package: settings, and the config file they may name.

``config`` imports nothing else of sluice's; every other package may import it.
"""

from sluice.config.settings import (
    DEFAULT_MODEL,
    GROUPS,
    Settings,
    default_models_dir,
    default_store_path,
    env_var,
    flag_name,
    kind,
    shown_default,
)

__all__ = [
    "DEFAULT_MODEL",
    "GROUPS",
    "Settings",
    "default_models_dir",
    "default_store_path",
    "env_var",
    "flag_name",
    "kind",
    "shown_default",
]
