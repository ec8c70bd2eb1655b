"""Every family of llama.cpp's chat parser tests, parsed as llama.cpp parses it.

Each complete output -> message case of ``tests/test-chat.cpp`` (see
``llama_cpp/cases.py``) is answered by a replay model with the case's own chat
template, through the real server, and read back with the official clients:
OpenAI chat (whole and streamed), Anthropic Messages and Ollama's ``/api/chat``.
The cases sluice does not parse yet are listed in ``llama_cpp/known_failures.txt``;
a listed case that passes fails the test, so the list only ever shrinks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from sluice.config import Settings
from sluice.server.app import create_app
from tests.parsers.llama_cpp.cases import HERE, Case, load, same_message, write_config
from tests.support.servers import serve_app

CASES = load()
KNOWN = HERE / "known_failures.txt"
KNOWN_FAILURES = {
    line.split()[0]
    for line in (KNOWN.read_text().splitlines() if KNOWN.exists() else [])
    if line.strip() and not line.startswith("#")
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("llama-cpp-cases")
    config = write_config(folder, CASES)
    settings = Settings(
        model=CASES[0].model,
        config=str(config),
        store=str(folder / "store.db"),
        max_loaded_models=100,
        parallel=1,
    )
    with serve_app(create_app(settings)) as url:
        yield url


def _openai_request(case: Case) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": case.model,
        "messages": [{"role": "user", "content": case.user()}],
        "max_tokens": 4096,
    }
    if case.tools:
        body["tools"] = case.tools
        body["tool_choice"] = case.tool_choice
        body["parallel_tool_calls"] = case.parallel
    if not case.enable_thinking:
        body["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    return body


def openai_whole(base: str, case: Case) -> dict[str, Any]:
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    done = c.chat.completions.create(**_openai_request(case))
    message: Any = done.choices[0].message
    calls = [
        {"name": t.function.name, "arguments": t.function.arguments, "id": t.id}
        for t in message.tool_calls or []
    ]
    extra = message.model_extra or {}
    return {
        "content": message.content,
        "reasoning_content": extra.get("reasoning_content"),
        "tool_calls": calls,
    }


def openai_streamed(base: str, case: Case) -> dict[str, Any]:
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    content, reasoning = "", ""
    calls: list[dict[str, Any]] = []
    for chunk in c.chat.completions.create(**_openai_request(case), stream=True):
        for choice in chunk.choices:
            delta: Any = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                while len(calls) <= tc.index:
                    calls.append({"name": "", "arguments": "", "id": ""})
                if tc.id:
                    calls[tc.index]["id"] = tc.id
                if tc.function and tc.function.name:
                    calls[tc.index]["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    calls[tc.index]["arguments"] += tc.function.arguments
    return {"content": content, "reasoning_content": reasoning, "tool_calls": calls}


def anthropic_messages(base: str, case: Case, stream: bool = False) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": case.model,
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": case.user()}],
    }
    if case.tools:
        kwargs["tools"] = [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in case.tools
        ]
        choice = {"auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"}}
        kwargs["tool_choice"] = {
            **choice[case.tool_choice],
            **(
                {"disable_parallel_tool_use": True}
                if not case.parallel and case.tool_choice != "none"
                else {}
            ),
        }
    if not case.enable_thinking:
        kwargs["thinking"] = {"type": "disabled"}
    with anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60) as c:
        if stream:  # the SDK assembles the message from the named events
            with c.messages.stream(**kwargs) as events:
                done = events.get_final_message()
        else:
            done = c.messages.create(**kwargs)
    content = "".join(b.text for b in done.content if b.type == "text")
    reasoning = "".join(b.thinking for b in done.content if b.type == "thinking")
    calls = [
        {"name": b.name, "arguments": json.dumps(b.input), "id": b.id}
        for b in done.content
        if b.type == "tool_use"
    ]
    return {"content": content, "reasoning_content": reasoning, "tool_calls": calls}


def ollama_chat(base: str, case: Case, stream: bool = False) -> dict[str, Any]:
    c = ollama.Client(host=base, timeout=60)
    kwargs: dict[str, Any] = {
        "model": case.model,
        "messages": [{"role": "user", "content": case.user()}],
        "options": {"num_predict": 4096},
    }
    if case.tools:
        kwargs["tools"] = case.tools
    if not case.enable_thinking:
        kwargs["think"] = False
    parts = list(c.chat(**kwargs, stream=True)) if stream else [c.chat(**kwargs)]
    content = "".join(p.message.content or "" for p in parts)
    thinking = "".join(p.message.thinking or "" for p in parts)
    calls = [
        {"name": t.function.name, "arguments": json.dumps(t.function.arguments), "id": ""}
        for p in parts
        for t in p.message.tool_calls or []
    ]
    return {"content": content, "reasoning_content": thinking, "tool_calls": calls}


# How each dialect writes a call's id (the model's, where its format has one).
IDS: dict[str, Callable[[str], str] | None] = {
    "openai": str,
    "openai-stream": str,
    "anthropic": lambda i: i if i.startswith("toolu_") else "toolu_" + i.removeprefix("call_"),
    "anthropic-stream": lambda i: (
        i if i.startswith("toolu_") else "toolu_" + i.removeprefix("call_")
    ),
    "ollama": None,  # Ollama's tool calls carry no id
    "ollama-stream": None,
}
DIALECTS: dict[str, Callable[[str, Case], dict[str, Any]]] = {
    "openai": openai_whole,
    "openai-stream": openai_streamed,
    "anthropic": anthropic_messages,
    "anthropic-stream": lambda base, case: anthropic_messages(base, case, stream=True),
    "ollama": ollama_chat,
    "ollama-stream": lambda base, case: ollama_chat(base, case, stream=True),
}


def _applies(dialect: str, case: Case) -> bool:
    """Ollama's /api/chat has no tool_choice: a case that forces or forbids calls is
    asked only where the request can say so."""
    return not (dialect.startswith("ollama") and case.tools and case.tool_choice != "auto")


@pytest.mark.parametrize("dialect", list(DIALECTS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_llama_cpp_case(base: str, case: Case, dialect: str) -> None:
    if not _applies(dialect, case):
        pytest.skip("ollama has no tool_choice")
    key = f"{case.id}@{dialect}"
    if f"{case.id}@{dialect.removesuffix('-stream')}" in KNOWN_FAILURES:
        key = f"{case.id}@{dialect.removesuffix('-stream')}"  # listed for the whole dialect
    try:
        got = DIALECTS[dialect](base, case)
        problem = same_message(case, got, IDS[dialect])
    except Exception as exc:  # noqa: BLE001 - a request that fails is a case that fails
        problem = f"{type(exc).__name__}: {exc}"
    if key in KNOWN_FAILURES or case.id in KNOWN_FAILURES:
        assert problem is not None, f"{key} passes now: take it off known_failures.txt"
        pytest.xfail(problem)
    assert problem is None, problem


def test_known_failures_name_cases_that_run() -> None:
    """Each listed failure is a case (and dialect) the test asks, so a stale entry
    cannot hide behind a skip."""
    by_id = {c.id: c for c in CASES}
    stale = []
    for entry in sorted(KNOWN_FAILURES):
        case_id, _, dialect = entry.partition("@")
        case = by_id.get(case_id)
        if case is None or (dialect and not _applies(dialect, case)):
            stale.append(entry)
    assert stale == [], f"known_failures.txt lists cases that do not run: {stale}"


# -- a few cases on the other dialects ----------------------------------------------------

_SAMPLED = (
    "Qwen3-Coder",
    "Qwen3.5-4B",
    "deepseek-ai-DeepSeek-V3.2",
    "openai-gpt-oss-120b",
    "GLM-4.7-Flash",
    "moonshotai-Kimi-K2",
    "google-gemma-4-31B-it",
    "LFM2.5-8B-A1B",
)


def _sample(with_tools: bool) -> list[Case]:
    """Per sampled family, its first passing case with reasoning or calls (with tools or
    without, as the dialect can carry them) and thinking on."""
    out = []
    for family in _SAMPLED:
        for case in CASES:
            passing = case.id not in KNOWN_FAILURES and not any(
                k.startswith(case.id + "@") for k in KNOWN_FAILURES
            )
            rich = case.expect["tool_calls"] or case.expect["reasoning_content"]
            if (
                case.model == family
                and passing
                and rich
                and case.enable_thinking
                and bool(case.tools) == with_tools
                and case.tool_choice != "none"
            ):
                out.append(case)
                break
    return out


def responses(base: str, case: Case) -> dict[str, Any]:
    body: dict[str, Any] = {"model": case.model, "input": case.user(), "store": False}
    if case.tools:
        body["tools"] = [{"type": "function", **t["function"]} for t in case.tools]
        body["tool_choice"] = case.tool_choice
        body["parallel_tool_calls"] = case.parallel
    done = httpx.post(f"{base}/v1/responses", json=body, timeout=60).json()
    got: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    for item in done["output"]:
        if item["type"] == "message":
            got["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "reasoning":
            got["reasoning_content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            got["tool_calls"].append(
                {"name": item["name"], "arguments": item["arguments"], "id": item["call_id"]}
            )
    return got


def lmstudio(base: str, case: Case) -> dict[str, Any]:
    body = {"model": case.model, "input": case.user(), "store": False}
    done = httpx.post(f"{base}/api/v1/chat", json=body, timeout=60).json()
    got: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    for item in done["output"]:
        key = "reasoning_content" if item["type"] == "reasoning" else "content"
        got[key] += item["content"]
    return got


def gateway(base: str, case: Case) -> dict[str, Any]:
    body: dict[str, Any] = {"model": case.model, "message": case.user()}
    if case.tools:
        body.update(tools=case.tools, tool_choice=case.tool_choice)
    done = httpx.post(f"{base}/c1/chat", json=body, timeout=60).json()
    message = done["choices"][0]["message"]
    calls = [
        {"name": t["function"]["name"], "arguments": t["function"]["arguments"], "id": t["id"]}
        for t in message.get("tool_calls") or []
    ]
    return {
        "content": message.get("content"),
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": calls,
    }


@pytest.mark.parametrize(
    "dialect,case",
    [("responses", c) for c in _sample(True) + _sample(False)]
    + [("lmstudio", c) for c in _sample(False)]
    + [("c1", c) for c in _sample(True)],
    ids=lambda v: v if isinstance(v, str) else v.id,
)
def test_a_case_on_the_other_dialects(base: str, dialect: str, case: Case) -> None:
    ask = {"responses": responses, "lmstudio": lmstudio, "c1": gateway}[dialect]
    problem = same_message(case, ask(base, case), None)
    assert problem is None, problem
