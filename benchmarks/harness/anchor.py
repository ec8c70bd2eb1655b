"""An anchor of sluice's own past: a git revision's sources checked out beside a run, so
that a benchmark measures the code before a change and after it side by side.

Example::

    with anchor_sources("ff30c00", tmp / "anchor") as src:
        env["PYTHONPATH"] = str(src)   # that process runs the old sluice
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


@contextlib.contextmanager
def anchor_sources(rev: str, where: Path) -> Iterator[Path]:
    """``rev``'s ``src`` folder, from a git worktree at ``where``, removed afterwards."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
        check=True,
        capture_output=True,
    )
    try:
        yield where / "src"
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
            check=False,
            capture_output=True,
        )
