"""Reports: tables, result file names, and the lines every report has.

Results go to ``benchmarks/results/`` (``--out-dir`` elsewhere) as ``<kind>-<stamp>.json``
(the whole run: settings, machine, every measurement) and ``<kind>-<stamp>.md`` (the
tables and what they mean); the history of the results is git's.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def now() -> _dt.datetime:
    """The local time, with its zone (a report's ``date``)."""
    return _dt.datetime.now().astimezone()


def stamp(when: _dt.datetime) -> str:
    """The time part of a result file's name: ``2026-11-25-231628``."""
    return when.strftime("%Y-%m-%d-%H%M%S")


def render_table(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    """A Markdown table, or a right-aligned plain-text one."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    )


def machine_line(mach: Mapping[str, Any], load: Mapping[str, Any], platform: bool = False) -> str:
    """``Machine: <cpu>, <n> cores; Python ..., llama-cpp-python ...; git <commit>; load
    average <start> -> <end>`` (no final period); ``platform`` adds the OS after the cores."""
    return (
        f"Machine: {mach['cpu_model']}, {mach['cores']} cores; "
        + (f"{mach['platform']}; " if platform else "")
        + f"Python {mach['python']}, llama-cpp-python {mach['llama_cpp_python']}; git "
        f"{str(mach['git_commit'])[:10]}{' (src dirty)' if mach['git_dirty'] else ''}; load "
        f"average {load['start']} -> {load['end']}"
    )


def print_outcome(
    met: Mapping[str, bool], checks: list[str], load: Mapping[str, Any] | None = None
) -> None:
    """Each target met or not, the load average, the sanity checks (on stdout)."""
    for name, ok in met.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    if load is not None:
        print(f"load average: start {load['start']}, end {load['end']}")
    for c in checks:
        print("check:", c)


def targets_and_checks(met: Mapping[str, bool], checks: list[str], reproduce: str) -> str:
    """A report's closing Markdown: each target met or not, the sanity checks, the command."""
    return (
        "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in met.items())
        + ".\n"
        + "".join(f"\n- check: {c}" for c in checks)
        + f"\n\nReproduce: `{reproduce}`\n"
    )


def save_report(out_dir: Path, stem: str, doc: dict[str, Any], md: str) -> Path:
    """``<stem>.json`` (the whole result) and ``<stem>.md`` in ``out_dir``; their path
    without the suffix."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / stem
    path.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    path.with_suffix(".md").write_text(md)
    print(f"wrote {path}.json and {path}.md")
    return path
