"""LiteLLM's proxy, the Python gateway the gateway benchmarks compare with: pinned, in a
venv of its own outside the repo, made on first use (``ensure_litellm``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import CACHE, prog

# LiteLLM's PyPI releases 1.82.7/1.82.8 (2026-03) and 1.107.0 (2026-10-21) were
# compromised; LiteLLM's notice for the latter asks to pin 1.106.2. Raise this pin only
# to a release checked against the maintainers' security notices.
LITELLM_VERSION = "1.106.2"
LITELLM_PACKAGES = [f"litellm[proxy]=={LITELLM_VERSION}", "httptools==0.9.0"]
LITELLM_VENV = CACHE / "litellm-venv"
BAD_PTH = {"litellm_init.pth", "cook.pth"}  # the incidents' startup hooks
LITELLM_ENV = {
    "LITELLM_LOG": "ERROR",  # also uvicorn's level: no access log
    "LITELLM_MODE": "PRODUCTION",  # no .env loading
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch at start
}


def ensure_litellm() -> Path:
    """LiteLLM's venv (outside the repo), set up on first use; returns its ``litellm``."""
    exe, stamp = LITELLM_VENV / "bin" / "litellm", LITELLM_VENV / ".sluice-bench-stamp"
    want = " ".join(LITELLM_PACKAGES)
    if not (exe.exists() and stamp.exists() and stamp.read_text().strip() == want):
        print(f"{prog()}: setting up LiteLLM in {LITELLM_VENV}", flush=True)
        if not (LITELLM_VENV / "bin" / "python").exists():
            print(f"{prog()}:   {sys.executable} -m venv {LITELLM_VENV}", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        print(f"{prog()}:   pip install {want} (a few minutes)", flush=True)
        pip = [str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, *LITELLM_PACKAGES], check=True)
        stamp.write_text(want + "\n")
    bad = {p.name for p in LITELLM_VENV.glob("lib/python*/site-packages/*.pth")} & BAD_PTH
    if bad:
        sys.exit(f"{prog()}: {LITELLM_VENV} holds {sorted(bad)}: compromised, not run")
    return exe
