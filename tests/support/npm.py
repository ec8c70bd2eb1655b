"""Command-line clients from npm (Claude Code, Codex CLI), installed once per machine.

Each package goes into ``~/.cache/sluice-npm/<folder>`` at a pinned version and is
reused while that version is there; tests that need one skip only when npm is
missing or the install fails (no registry access).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def _prefix(folder: str) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "sluice-npm" / folder


def _installed_version(prefix: Path, package: str) -> str | None:
    manifest = prefix / "node_modules" / package / "package.json"
    try:
        return str(json.loads(manifest.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def npm_tool(package: str, version: str, command: str, folder: str) -> str:
    """The path of ``command`` from ``package@version``, installed if it is not;
    ``pytest.skip`` when it cannot be installed or does not run (``--version``)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: cannot install {package}")
    prefix = _prefix(folder)
    prefix.mkdir(parents=True, exist_ok=True)
    entry = prefix / "node_modules" / ".bin" / command
    # One install at a time (parallel test runs share the folder).
    with open(prefix.parent / f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed_version(prefix, package) != version or not entry.exists():
            cmd = [npm, "install", "--prefix", str(prefix), "--save-exact", "--no-audit"]
            cmd += ["--no-fund", "--loglevel=error", f"{package}@{version}"]
            try:
                done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                pytest.skip(f"npm install {package} timed out (no registry?)")
            if done.returncode != 0 or not entry.exists():
                pytest.skip(
                    f"npm install {package} failed ({done.returncode}): "
                    f"{(done.stderr or done.stdout)[-1500:]}"
                )
    # The packages' binaries come from per-platform optional dependencies.
    try:
        ran = subprocess.run(
            [str(entry), "--version"], check=False, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"the installed {command} does not run: {e}")
    if ran.returncode != 0:
        pytest.skip(f"the installed {command} does not run: {ran.stdout}{ran.stderr}")
    assert version in ran.stdout, ran.stdout
    return str(entry)


def run_tool(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> tuple[int, str, str]:
    """Run an installed client to the end (stdin closed): (exit, stdout, stderr); a run
    that outlasts ``timeout`` fails the test with what it printed so far."""
    try:
        done = subprocess.run(
            cmd,
            check=False,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        name = Path(cmd[0]).name
        pytest.fail(f"{name} did not finish in {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}")
    return done.returncode, done.stdout, done.stderr
