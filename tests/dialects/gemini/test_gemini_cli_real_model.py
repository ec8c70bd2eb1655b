"""Gemini CLI itself (``@google/gemini-cli`` from npm) against ``sluice serve``: a
headless ``gemini -p`` answered by the real SmolLM2 through Google's Gemini API, with the
key the server requires, exit 0.

Gemini CLI is installed once per machine with npm into ``~/.cache/sluice-npm`` (a pinned
version, reused when present); the test skips only when npm is missing or the install
fails. Its own system prompt and tool declarations are ~8,100 tokens (a run takes
minutes on a 2-core machine's 135M model), so the test gives it a short system prompt
(``GEMINI_SYSTEM_MD``) and no core tools: what is checked is the dialect, not the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.npm import npm_tool, run_tool
from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

GEMINI_CLI_VERSION = "0.61.0"
API_KEY = "sluice-gemini-cli-test-key"
SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "tools": {"core": []},
}


@pytest.fixture(scope="module")
def gemini() -> str:
    return npm_tool("@google/gemini-cli", GEMINI_CLI_VERSION, "gemini", "gemini-cli")


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    # The CLI sets no output limit: a 135M model that rambles to the end of its context
    # took this test past its 300 s on a loaded machine. 256 tokens bound each call.
    args = ("--ctx", "4096", "--parallel", "1", "--default-max-tokens", "256")
    with serve_process(*args, "--api-key", API_KEY, *QUIET) as url:
        yield url


def test_gemini_cli_answers_a_prompt(gemini: str, keyed: str, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".gemini").mkdir(parents=True)
    work.mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps(SETTINGS))
    system = home / "system.md"
    system.write_text("You are a helpful assistant. Answer briefly.\n")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "GOOGLE_GEMINI_BASE_URL": keyed,
        "GEMINI_API_KEY": API_KEY,
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
        "GEMINI_SYSTEM_MD": str(system),
    }
    cmd = [gemini, "-p", "Say hello.", "-m", "smollm2", "-o", "json"]
    code, out, err = run_tool(cmd, cwd=work, env=env, timeout=300)
    report = f"exit {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert code == 0, report
    result = json.loads(out[out.index("{") :])
    assert result["response"].strip(), report
    tokens = result["stats"]["models"]["smollm2"]["tokens"]
    assert tokens["prompt"] > 0 and tokens["candidates"] > 0, report
    # A wrong key is refused in Google's shape, and the CLI says so.
    env["GEMINI_API_KEY"] = "sluice-wrong-key-0000"
    code, out, err = run_tool(cmd, cwd=work, env=env, timeout=300)
    assert code != 0 and ("401" in out + err or "API key" in out + err), (code, out, err)
