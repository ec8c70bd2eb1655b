"""Real servers on the real embedded model, shared across the integration suite.

One SmolLM2 server for the whole session (``--parallel 4 --ctx 2048``) and,
only when a test asks for it, a second small-context server (``--ctx 256``).
Every server gets ``helpers.QUIET`` (one llama.cpp thread, log level warning).
Each test starts on an idle server (``wait_idle``), so a test that leaked a busy
slot fails loudly instead of skewing the next one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servers import serve_process

from .helpers import QUIET, wait_idle


@pytest.fixture(scope="session")
def base() -> Iterator[str]:
    with serve_process("--parallel", "4", "--ctx", "2048", *QUIET) as url:
        yield url


@pytest.fixture(scope="session")
def small_base() -> Iterator[str]:
    """A second server whose context is only 256 tokens per sequence."""
    with serve_process("--parallel", "1", "--ctx", "256", *QUIET) as url:
        yield url


@pytest.fixture
def client(base: str) -> Iterator[OpenAI]:
    wait_idle(base, within=10)  # no test starts on slots a previous one left busy
    with OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def aclient(base: str) -> AsyncOpenAI:
    wait_idle(base, within=10)
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_id(base: str) -> str:
    import httpx

    return str(httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"])
