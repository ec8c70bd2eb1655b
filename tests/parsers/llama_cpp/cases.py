"""llama.cpp's chat parser cases (``cases.jsonl``, made by ``extract.sh``), replayed
through sluice: each template's cases become one replay model whose recorded answers
are the cases' model outputs, each found by a marker in the case's user message.

A case is "complete output -> message" (what the tests hold sluice to) when it is
not partial, has no ``json_schema``, no custom messages and no continuation, and
holds under the default (auto) reasoning handling: it asks for it (``auto``,
``deepseek``), or it asks for none but its output has no reasoning markers and it
expects no reasoning (so the handling cannot matter).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
CASES = HERE / "cases.jsonl"


@dataclass(frozen=True)
class Case:
    id: str  # "<template stem>#<n>", n counting that template's cases in file order
    template: str  # file name in sluice.templates
    output: str  # what the model wrote
    tools: list[dict[str, Any]]
    tool_choice: str
    parallel: bool
    enable_thinking: bool
    expect: dict[str, Any]  # content, reasoning_content, tool_calls [{name, arguments, id}]

    @property
    def model(self) -> str:
        return self.template.removesuffix(".jinja")

    @property
    def marker(self) -> str:
        return f"[case {self.id}]"

    def user(self) -> str:
        return f"{self.marker} Hello, world!"


_CHOICES = {0: "auto", 1: "required", 2: "none"}


def load(path: Path = CASES) -> list[Case]:
    """The complete output -> message cases, in file order."""
    out: list[Case] = []
    counts: dict[str, int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        raw = json.loads(line)
        stem = raw["template"].removesuffix(".jinja")
        counts[stem] = counts.get(stem, 0) + 1
        if (
            raw["is_partial"]
            or raw["json_schema"]
            or raw["custom_messages"]
            or raw["continue_final_message"]
            or not _auto_handling(raw)
        ):
            continue
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t["description"],
                    "parameters": t["parameters"],
                },
            }
            for t in raw["tools"]
        ]
        out.append(
            Case(
                id=f"{stem}#{counts[stem]}",
                template=raw["template"],
                output=raw["input"],
                tools=tools,
                tool_choice=_CHOICES[raw["tool_choice"]],
                parallel=raw["parallel_tool_calls"],
                enable_thinking=raw["enable_thinking"],
                expect=raw["expect"],
            )
        )
    return out


def _auto_handling(raw: dict[str, Any]) -> bool:
    if raw["reasoning_format"] != "none":
        return True
    llama = raw["llama"]
    tags = [t for t in (llama["thinking_start_tag"], *llama["thinking_end_tags"]) if t]
    return not raw["expect"]["reasoning_content"] and not any(t in raw["input"] for t in tags)


def write_config(folder: Path, cases: list[Case]) -> Path:
    """One replay model per template (named by its stem), answering every case."""
    entries = []
    for model in sorted({c.model for c in cases}):
        answers = folder / f"{model}.jsonl"
        answers.write_text(
            "".join(
                json.dumps({"when": c.marker, "output": c.output}, ensure_ascii=False) + "\n"
                for c in cases
                if c.model == model
            ),
            encoding="utf-8",
        )
        entries.append(
            f"[[models]]\nname = {json.dumps(model)}\nsource = {json.dumps('replay:' + str(answers))}\n"
            f"chat_template = {json.dumps(model)}\nctx = 16384\n"
        )
    config = folder / "models.toml"
    config.write_text("\n".join(entries), encoding="utf-8")
    return config


def same_message(
    case: Case, got: dict[str, Any], ids: Callable[[str], str] | None = str
) -> str | None:
    """None if ``got`` (content, reasoning_content, tool_calls) is the expected message,
    as llama.cpp compares (whitespace around content and reasoning aside, arguments as
    JSON, ids only where the format carries one); else what differs. ``ids``: how the
    dialect writes a call id (None: it has none)."""
    want = case.expect
    for key in ("content", "reasoning_content"):
        if (got.get(key) or "").strip() != (want[key] or "").strip():
            return f"{key}: {got.get(key)!r} != {want[key]!r}"
    calls, wanted = got.get("tool_calls") or [], want["tool_calls"]
    if len(calls) != len(wanted):
        return f"{len(calls)} calls != {len(wanted)}: {calls!r}"
    for call, w in zip(calls, wanted, strict=True):
        if call["name"] != w["name"]:
            return f"name {call['name']!r} != {w['name']!r}"
        try:
            if json.loads(call["arguments"] or "{}") != json.loads(w["arguments"] or "{}"):
                return f"arguments {call['arguments']!r} != {w['arguments']!r}"
        except ValueError:
            return f"arguments {call['arguments']!r} are not JSON"
        if w["id"] and ids is not None and call.get("id") != ids(w["id"]):
            return f"id {call.get('id')!r} != {ids(w['id'])!r}"
    return None
