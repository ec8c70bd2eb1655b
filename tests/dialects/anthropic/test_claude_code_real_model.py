"""Claude Code itself (``@anthropic-ai/claude-code`` from npm) against ``sluice serve``
on the real model, as a user would run it: ``ANTHROPIC_BASE_URL`` at sluice, an API
key (sent as ``x-api-key``), ``claude -p "..." --model smollm2``.

Claude Code is installed once per machine with npm into ``~/.cache/sluice-npm``
(a pinned version, reused when present); the tests skip only when npm is missing
or the install fails (no registry access).

What Claude Code 2.1 sends (recorded with a fake server): ``HEAD /`` first (a 401
here, since keys are set: Claude Code goes on), then one streamed ``POST
/v1/messages?beta=true`` with ``max_tokens`` 32000 (above the 8192-token context),
``thinking: {"type": "adaptive"}``, ``output_config``, ``context_management``,
``metadata``, a system of text blocks with ``cache_control`` and tools whose
schemas carry ``$schema``. ``--bare`` keeps three tools (Bash, Edit, Read), a prompt
of about 1,100 tokens; the default set (~22K tokens) does not fit the context.
``claude -p /context`` asks ``/v1/messages/count_tokens`` and prints the answers.

Claude Code sends no ``temperature``, so sluice samples with the model's defaults
(llama.cpp's: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05). At Anthropic's
own default (1.0 over the whole vocabulary, which sluice used before) SmolLM2-135M
rambled on this prompt in about one answer in five until the context was full;
with the defaults, eight runs in a row ended by themselves in 3-6 s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.npm import npm_tool, run_tool
from tests.support.real_server import QUIET, outcome_counts, wait_idle
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

CLAUDE_CODE_VERSION = "2.1.197"
API_KEY = "sluice-claude-code-test-key"
MODEL = "smollm2"
TIMEOUT = 300  # seconds per `claude` run: generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def claude() -> str:
    """The ``claude`` executable, installed with npm once per machine."""
    return npm_tool("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude", "claude-code")


@pytest.fixture(scope="module")
def cc_base() -> Iterator[str]:
    """A server of its own: an 8192-token context (Claude Code's prompt is ~1,100
    tokens and it asks for 32000 more), one slot, and an API key."""
    with serve_process("--ctx", "8192", "--parallel", "1", "--api-key", API_KEY, *QUIET) as url:
        yield url


def _auth() -> dict[str, str]:
    return {"x-api-key": API_KEY}


def _metrics(base: str) -> dict[str, float]:
    return outcome_counts(base, _auth())


def _run_claude(
    claude: str, base: str, tmp: Path, prompt: str, extra_env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``claude -p PROMPT`` in a fresh home and working folder, with nothing of this
    process's environment (no proxies, no user settings); returns (exit, stdout, stderr)."""
    home, work = tmp / "home", tmp / "work"
    (home / "tmp").mkdir(parents=True)
    work.mkdir()
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": API_KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # No retries: an error from sluice fails the run at once, visibly (with its
        # default 10 retries Claude Code spends ~3 minutes on a 401 before exiting).
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "CLAUDE_CODE_TMPDIR": str(home / "tmp"),
        **(extra_env or {}),
    }
    cmd = [
        claude,
        "-p",
        prompt,
        "--model",
        MODEL,
        "--bare",
        "--no-session-persistence",
        "--output-format",
        "json",
    ]
    return run_tool(cmd, cwd=work, env=env, timeout=TIMEOUT)


def _result(code: int, out: str, err: str) -> dict[str, Any]:
    """The JSON result line of ``--output-format json``, checked to be a success."""
    report = f"exit {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert code == 0, report
    lines = [line for line in out.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        pytest.fail(f"no JSON result line\n{report}")
    assert isinstance(result, dict), report
    assert result.get("type") == "result", report
    assert result.get("subtype") == "success", report
    assert result.get("is_error") is False, report
    return result


def test_claude_code_answers_a_question(claude: str, cc_base: str, tmp_path: Path) -> None:
    wait_idle(cc_base, within=10)
    before = _metrics(cc_base)

    code, out, err = _run_claude(
        claude,
        cc_base,
        tmp_path,
        "What is the capital of France? Answer in one word.",
    )
    result = _result(code, out, err)
    report = f"--- stdout\n{out}\n--- stderr\n{err}"
    # SmolLM2-135M is not asked to be right, only to answer (text, ended by itself).
    assert isinstance(result.get("result"), str) and result["result"].strip(), report
    assert result.get("stop_reason") == "end_turn", report
    # Sampled, the model may call one of the three tools first; Claude Code then
    # runs it and asks again: more turns, each answered by sluice.
    turns = result.get("num_turns")
    assert isinstance(turns, int) and turns >= 1, report
    usage = result.get("usage") or {}
    assert usage.get("output_tokens", 0) > 0, report
    # The prompt (system, three tools, the question) as sluice counted it.
    prompt_tokens = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
    assert 500 < prompt_tokens < 8192, report

    # It was sluice that answered, with the key Claude Code sent (x-api-key): one
    # generation a turn, each ended well, and the key counted Claude Code's requests
    # besides the /metrics request of `after`.
    wait_idle(cc_base, within=10)
    after = _metrics(cc_base)
    assert after["ok"] - before["ok"] == turns, (before, after, report)
    assert after["error"] == before["error"], (before, after, report)
    assert after["keyed"] - before["keyed"] >= 2, (before, after, report)


def test_claude_code_context_counts_tokens_with_sluice(
    claude: str, cc_base: str, tmp_path: Path
) -> None:
    wait_idle(cc_base, within=10)
    # Claude Code measures its "Messages" row as the tokens of a one-message
    # conversation, "foo": sluice's own count of that must be what it prints.
    foo = {"model": MODEL, "messages": [{"role": "user", "content": "foo"}], "tools": []}
    counted = httpx.post(
        f"{cc_base}/v1/messages/count_tokens", json=foo, headers=_auth(), timeout=30
    )
    assert counted.status_code == 200, counted.text
    foo_tokens = counted.json()["input_tokens"]
    before = _metrics(cc_base)

    code, out, err = _run_claude(claude, cc_base, tmp_path, "/context")
    result = _result(code, out, err)
    report = f"--- stdout\n{out}\n--- stderr\n{err}"
    text = result.get("result")
    assert isinstance(text, str) and "Context Usage" in text, report
    assert re.search(r"\*\*Tokens:\*\* [0-9.]+k? / ", text), report
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([0-9.]+k?) \|", text, re.MULTILINE))
    assert {"System prompt", "System tools", "Messages"} <= set(rows), report
    assert rows["Messages"] == str(foo_tokens), (foo_tokens, report)
    # The three tools' schemas are counted by sluice too: far more than "foo".
    assert rows["System tools"].isdigit() and int(rows["System tools"]) > foo_tokens, report
    assert rows["System prompt"].isdigit() and int(rows["System prompt"]) > 0, report

    # Counting generates nothing; the key counted Claude Code's count_tokens
    # requests besides the /metrics request of `after`.
    after = _metrics(cc_base)
    assert (after["ok"], after["error"]) == (before["ok"], before["error"]), (before, after)
    assert after["keyed"] - before["keyed"] >= 2, (before, after, report)
