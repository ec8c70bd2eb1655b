"""Codex CLI itself (``@openai/codex`` from npm) against ``sluice serve`` on the real
model, as a user would run it: a provider in its ``config.toml`` with ``base_url`` at
sluice and ``wire_api = "responses"``, an API key from ``env_key``, and
``codex exec --skip-git-repo-check "..."``.

Codex CLI is installed once per machine with npm into ``~/.cache/sluice-npm`` (a pinned
version, reused when present); the test skips only when npm is missing or the install
fails (no registry access). The package is a native binary (through a per-platform
optional dependency): it runs without node's help.

What Codex 0.171 sends (recorded through a proxy): one streamed ``POST /v1/responses``
with ``store: false``, no ``temperature`` or ``max_output_tokens``, ``tool_choice:
"auto"``, ``parallel_tool_calls``, ``reasoning: {}``, ``include:
["reasoning.encrypted_content"]``, ``prompt_cache_key``, ``client_metadata`` and its
instructions as ``developer`` messages in ``input``. Its default prompt (~11,800
tokens: a long system prompt and a dozen tools) does not fit the 8,192-token context,
so the config below keeps what a small local model can take, as a user of one would:
its own short instructions file, no environment or permissions text, no skills, apps,
plugins, web search or sub-agents; two tools remain (``exec_command``,
``write_stdin``): a prompt of about 790 tokens.

Codex needs ``response.output_item.done`` and ``response.completed`` with the whole
output to finish a turn; with no temperature sent, sluice samples with the model's
defaults (llama.cpp's: 0.8, top-k 40, top-p 0.95, min-p 0.05), and the answer ends by
itself in well under a second on this model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.npm import npm_tool, run_tool
from tests.support.real_server import QUIET, outcome_counts, wait_idle
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

CODEX_VERSION = "0.171.0"
API_KEY = "sluice-codex-test-key"
MODEL = "smollm2"
TIMEOUT = 300  # seconds per `codex exec` run: generous for a loaded 2-core machine

CONFIG = """\
model = "{model}"
model_provider = "sluice"
model_instructions_file = "{instructions}"
model_reasoning_summary = "none"
include_permissions_instructions = false
include_environment_context = false
include_apps_instructions = false
web_search = "disabled"

[features]
goals = false
plugins = false
view_image = false

[agents]
enabled = false

[skills]
include_instructions = false

[skills.bundled]
enabled = false

[tools.experimental_request_user_input]
enabled = false

[analytics]
enabled = false

[model_providers.sluice]
name = "sluice"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "SLUICE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 120000
"""


@pytest.fixture(scope="module")
def codex() -> str:
    """The ``codex`` executable, installed with npm once per machine."""
    return npm_tool("@openai/codex", CODEX_VERSION, "codex", "codex")


@pytest.fixture(scope="module")
def codex_base() -> Iterator[str]:
    """A server of its own: the issue's 8192-token context, one slot, an API key. Codex
    sends no output limit and samples at the model's temperature: 512 tokens bound each
    answer, so one that rambles cannot take the test past its timeout."""
    args = ("--ctx", "8192", "--parallel", "1", "--default-max-tokens", "512")
    with serve_process(*args, "--api-key", API_KEY, *QUIET) as url:
        yield url


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _run_codex(codex: str, base: str, tmp: Path, prompt: str) -> tuple[int, str, str]:
    """``codex exec --json PROMPT`` in a fresh home and working folder, with nothing of
    this process's environment; returns (exit, stdout, stderr)."""
    home, work = tmp / "home", tmp / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    instructions = tmp / "instructions.md"
    instructions.write_text(
        "You are a helpful assistant. Answer the user's question directly and briefly.\n"
    )
    (home / ".codex" / "config.toml").write_text(
        CONFIG.format(model=MODEL, instructions=instructions, base=base)
    )
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "SLUICE_API_KEY": API_KEY,
    }
    cmd = [
        codex,
        "exec",
        "--skip-git-repo-check",
        "--ephemeral",
        "--sandbox",
        "read-only",
        "-c",
        "approval_policy=never",
        "--color",
        "never",
        "--json",
        prompt,
    ]
    return run_tool(cmd, cwd=work, env=env, timeout=TIMEOUT)


def _events(out: str) -> list[dict[str, Any]]:
    events = []
    for line in out.splitlines():
        if line.strip().startswith("{"):
            events.append(json.loads(line))
    return events


def test_codex_answers_a_question(codex: str, codex_base: str, tmp_path: Path) -> None:
    wait_idle(codex_base, within=10)
    before = outcome_counts(codex_base, _auth())

    code, out, err = _run_codex(
        codex, codex_base, tmp_path, "What is the capital of France? Answer in one word."
    )
    report = f"exit {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert code == 0, report
    events = _events(out)
    kinds = [e.get("type") for e in events]
    assert "turn.failed" not in kinds and "error" not in kinds, report
    # One turn, answered with a message (SmolLM2-135M is not asked to be right, only
    # to answer: text, the turn ended by itself).
    assert kinds.count("turn.completed") == 1, report
    messages = [
        e["item"]["text"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    assert len(messages) == 1 and messages[0].strip(), report
    usage = next(e for e in events if e.get("type") == "turn.completed")["usage"]
    assert usage["output_tokens"] > 0, report
    # The prompt (instructions, two tools, the question) as sluice counted it.
    assert 300 < usage["input_tokens"] < 8192, report

    # It was sluice that answered, with the key Codex sent: one generation, ended
    # well, and the key counted Codex's request besides the /metrics request of `after`.
    wait_idle(codex_base, within=10)
    after = outcome_counts(codex_base, _auth())
    assert after["ok"] - before["ok"] == 1, (before, after, report)
    assert after["error"] == before["error"], (before, after, report)
    assert after["keyed"] - before["keyed"] >= 2, (before, after, report)
    stored = httpx.get(f"{codex_base}/v1/responses/none", headers=_auth(), timeout=10)
    assert stored.status_code == 404  # Codex sends store: false: nothing was kept
