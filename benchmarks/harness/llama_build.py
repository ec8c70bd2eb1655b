"""llama.cpp's own ``llama-server``, built once from the llama.cpp sluice runs on.

The comparison point of the benchmarks: the C++ server around the very kernels sluice
calls. It is built from the source distribution of the pinned
``llama-cpp-python`` (the version in ``./dev``), from its ``vendor/llama.cpp``, with the
CMake flags ``./dev`` builds the wheel with (its ``CMAKE_ARGS``, or the environment's if
set, as ``./dev`` does) plus what the server target needs:

* ``-DLLAMA_BUILD_SERVER=ON`` and only the ``llama-server`` target is compiled (tools
  stay on since the server lives under ``tools/``; tests, examples and the unified app
  off);
* ``-DLLAMA_CURL=OFF``, ``-DLLAMA_OPENSSL=OFF``: no network code (no ``-hf`` downloads,
  no HTTPS);
* ``-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF``: the web UI is neither built
  with npm nor downloaded from a Hugging Face bucket (the server embeds an empty asset
  table and still answers the API);
* ``-DBUILD_SHARED_LIBS=OFF``: one self-contained binary (the wheel links llama.cpp as
  shared libraries; the same sources and flags, so the same kernels);
* ``-DCMAKE_BUILD_TYPE=Release`` (scikit-build-core's default for the wheel).

The source is fetched with ``pip download --no-binary :all: --no-deps`` (never a
prebuilt binary); the sdist and the binary are cached under ``~/.cache/sluice-bench/``
(``$SLUICE_BENCH_CACHE`` if set; ``llama-server-<hash of version and flags>/``, like
``./dev``'s wheel cache), so the build (about 7 minutes on 2 cores) happens once. The
compiler runs under ``nice -n 19``. Benchmarks only: nothing in ``tests/`` calls this.

``python benchmarks/llama_server.py`` prints the binary's path (building it if needed);
the benchmarks call ``ensure_llama_server()`` before anything is timed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import CACHE, REPO

SERVER_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_CCACHE=OFF",
]


def dev_settings() -> tuple[str, list[str]]:
    """The llama-cpp-python version and the CMake flags of ``./dev`` (the environment's
    ``CMAKE_ARGS`` win, as in ``./dev``)."""
    text = (REPO / "dev").read_text()
    version = re.search(r'^llama_version="([^"]+)"', text, re.MULTILINE)
    default = re.search(r'CMAKE_ARGS="\$\{CMAKE_ARGS:-([^}]*)\}"', text)
    if not (version and default):
        sys.exit("llama_server: cannot read llama_version / CMAKE_ARGS from ./dev")
    return version.group(1), shlex.split(os.environ.get("CMAKE_ARGS") or default.group(1))


def build_dir_for(version: str, flags: list[str]) -> Path:
    key = hashlib.sha1(f"{version} {' '.join(flags)} {' '.join(SERVER_FLAGS)}".encode())
    return CACHE / f"llama-server-{key.hexdigest()[:12]}"


def _log(msg: str) -> None:
    print(f"llama_server: {msg}", file=sys.stderr, flush=True)


def _sdist(version: str) -> Path:
    """The llama-cpp-python source distribution, downloaded once with pip."""
    src = CACHE / "src"
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (src / name).exists():
        src.mkdir(parents=True, exist_ok=True)
        _log(f"pip download --no-binary :all: --no-deps llama-cpp-python=={version}")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:"]
        cmd += ["--no-deps", f"llama-cpp-python=={version}", "-d"]
        subprocess.run([*cmd, str(src)], check=True, stdout=sys.stderr)
    return src / name


def vendored_file(relpath: str) -> Path:
    """A file of the llama.cpp that the pinned llama-cpp-python vendors (e.g.
    ``models/templates/X.jinja``), extracted once from its source distribution."""
    version, _ = dev_settings()
    out = CACHE / "vendored" / version / relpath
    if not out.exists():
        sdist = _sdist(version)
        member = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/{relpath}"
        with tarfile.open(sdist) as tar:
            data = tar.extractfile(member)
            if data is None:
                sys.exit(f"llama_server: no {relpath} in {sdist.name}")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data.read())
    return out


def _build(version: str, flags: list[str], out: Path) -> None:
    sdist = _sdist(version)
    nice = ["nice", "-n", "19"]
    jobs = str(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="llama-server-build-", dir=CACHE) as tmp:
        _log(f"extracting {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        root = Path(tmp) / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
        if not (root / "tools" / "server").is_dir():
            sys.exit(f"llama_server: no tools/server in {root}")
        build = Path(tmp) / "build"
        configure = ["cmake", "-S", str(root), "-B", str(build), *flags, *SERVER_FLAGS]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        _log("configure: " + shlex.join(configure))
        t0 = time.monotonic()
        subprocess.run([*nice, *configure], check=True, stdout=sys.stderr)
        _log(f"building llama-server ({jobs} jobs, nice 19; about 7 minutes on 2 cores)")
        compile_ = ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs]
        subprocess.run([*nice, *compile_], check=True, stdout=sys.stderr)
        binary = build / "bin" / "llama-server"
        if not binary.exists():
            sys.exit(f"llama_server: the build produced no {binary}")
        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copy2(binary, staging / "llama-server")
        info = {
            "llama_cpp_python": version,
            "source": sdist.name,
            "source_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
            "cmake_flags": [*flags, *SERVER_FLAGS],
            "build_seconds": round(time.monotonic() - t0, 1),
            "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (staging / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)  # the cache entry appears whole or not at all
        _log(f"built in {info['build_seconds']:.0f} s")


def ensure_llama_server() -> Path:
    """The path of the cached ``llama-server`` binary, built first if missing."""
    version, flags = dev_settings()
    out = build_dir_for(version, flags)
    binary = out / "llama-server"
    if binary.exists():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "llama-server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a waiter reuses it
        if not binary.exists():
            _log(f"no {binary}: building llama.cpp's server from llama-cpp-python {version}")
            _build(version, flags, out)
    return binary


def build_info(binary: Path) -> dict[str, Any]:
    """What ``ensure_llama_server`` recorded about the build (``{}`` if nothing)."""
    try:
        info: dict[str, Any] = json.loads((binary.parent / "build-info.json").read_text())
        return info
    except (OSError, ValueError):
        return {}
