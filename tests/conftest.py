"""The whole suite's data folder ($XDG_DATA_HOME) is a fresh temporary one.

Servers started by the tests (in-process or as processes, which inherit the
environment) keep their conversations database and default models folder
there, never in the user's own ``~/.local/share/sluice``.
"""

from __future__ import annotations

import os
import tempfile

_data_home = tempfile.TemporaryDirectory(prefix="sluice-test-data-")
os.environ["XDG_DATA_HOME"] = _data_home.name
