"""The whole suite's data folder, and the real servers the real-model tests share.

The data folder ($XDG_DATA_HOME) is a fresh temporary one. Servers started by
the tests (in-process or as processes, which inherit the environment) keep
their conversations database and default models folder there, never in the
user's own ``~/.local/share/sluice``.

The real-model tests (marker ``integration``, modules named ``*_real_model.py``)
share one SmolLM2 server for the whole session (``--parallel 4 --ctx 2048``)
and, only when a test asks for it, a second small-context server (``--ctx
256``). Every server gets ``real_server.QUIET`` (one llama.cpp thread, log
level warning). Each test starts on an idle server (``wait_idle``), so a test
that leaked a busy slot fails loudly instead of skewing the next one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support.postgres import PostgresServer, find_bin
from tests.support.real_server import QUIET, wait_idle
from tests.support.relay import Relay
from tests.support.servers import serve_process

_data_home = tempfile.TemporaryDirectory(prefix="sluice-test-data-")
os.environ["XDG_DATA_HOME"] = _data_home.name


@pytest.fixture(scope="session")
def base() -> Iterator[str]:
    with serve_process("--parallel", "4", "--ctx", "2048", *QUIET) as url:
        yield url


@pytest.fixture(scope="session")
def small_base() -> Iterator[str]:
    """A second server whose context is only 256 tokens per sequence."""
    with serve_process("--parallel", "1", "--ctx", "256", *QUIET) as url:
        yield url


@pytest.fixture(scope="module")
def relay(base: str) -> Iterator[Relay]:
    """A TCP relay in front of the session server that records what it sends back, for
    checking an upstream's passthrough byte for byte."""
    r = Relay(base)
    yield r
    r.close()


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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    if find_bin("initdb") is None:
        reason = "PostgreSQL is not installed (Debian: apt-get install postgresql)"
        if os.environ.get("SLUICE_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"SLUICE_REQUIRE_POSTGRES=1 but {reason}")
        pytest.skip(reason)
    with PostgresServer.start() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh database's URL (the password in it)."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)
