"""The machine a benchmark runs on: CPU time of processes, other processes' CPU, facts.

The benchmarks run on shared 2-core machines whose speed drifts by tens of percent over
minutes: ``Noise`` tells how many cores processes other than ours used during a
measurement, so that a disturbed one is measured again or named in the checks.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from harness import REPO

T = TypeVar("T")


def proc_cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all threads), or of one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def system_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used (all cores), from /proc/stat."""
    try:
        parts = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return float("nan")


class Noise:
    """CPU used by processes other than ours (the given pids and this one)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _ours(self) -> float:
        return sum(proc_cpu_seconds(p) for p in self.pids) + time.process_time()

    def start(self) -> None:
        self._t = time.perf_counter()
        self._busy = system_busy_seconds()
        self._ours0 = self._ours()

    def stop(self) -> float:
        """Foreign CPU since start(), in cores (0.0 = nobody else ran, 1.0 = one busy core)."""
        wall = time.perf_counter() - self._t
        foreign = (system_busy_seconds() - self._busy) - (self._ours() - self._ours0)
        return max(0.0, foreign) / wall if wall > 0 else 0.0

    def wait_quiet(self, threshold: float, timeout: float) -> float:
        """Wait (up to ``timeout`` s) until others use < ``threshold`` cores over 1 s."""
        deadline = time.monotonic() + timeout
        while True:
            self.start()
            time.sleep(1.0)
            level = self.stop()
            if level < threshold or time.monotonic() > deadline:
                return level
            print(f"  (machine busy: others use {level:.2f} cores; waiting)", flush=True)

    def run(self, fn: Callable[[], T], threshold: float, timeout: float) -> tuple[T, float, float]:
        """``fn()`` once the machine is quiet (``wait_quiet``): its result, the cores others
        used during it, and before it."""
        before = self.wait_quiet(threshold, timeout)
        self.start()
        res = fn()
        return res, self.stop(), before


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict[str, Any]:
    """CPU, cores, Python, llama-cpp-python, sluice, git commit (and whether src/ is dirty)."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*a: str) -> str | None:
        try:
            return (
                subprocess.run(
                    ["git", *a], check=False, cwd=REPO, capture_output=True, text=True, timeout=10
                ).stdout.strip()
                or None
            )
        except OSError:
            return None

    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "llama_cpp_python": version("llama_cpp_python") or version("llama-cpp-python"),
        "sluice": version("sluice"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--", "src")),
    }
