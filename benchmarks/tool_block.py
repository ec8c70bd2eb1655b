"""The tool block for templates without tools: prompt tokens, before and after.

A model whose chat template cannot show tools (the embedded SmolLM2 among
them) gets the tools described in a system block. This script renders that
block for the tool sets real agents send (captured from their first request:
``benchmarks/data/tools/``) two ways, and counts the tokens with SmolLM2's
tokenizer:

- before: each tool's JSON schema as JSON (sluice's block until 2026-11-27,
  reproduced here as the anchor);
- after: compact signatures (``sluice.parsers.signatures``), what sluice sends now.

Usage::

    ./dev sluice ...   # (environment)
    .venv/bin/python benchmarks/tool_block.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sluice.models.catalog import PACKAGED
from sluice.parsers.generic import CALL_CLOSE, CALL_OPEN, tool_system_prompt

DATA = Path(__file__).parent / "data" / "tools"


def json_block(tools: list[dict[str, Any]]) -> str:
    """The block as sluice wrote it before signatures (the anchor)."""
    lines = ["You can call these functions:", ""]
    for tool in tools:
        fn = tool.get("function", tool)
        lines.append(f"- {fn.get('name', '')}: {fn.get('description') or '(no description)'}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(f"  parameters (JSON schema): {json.dumps(params, ensure_ascii=False)}")
    lines += [
        "",
        "To call a function, reply with exactly this block, one block per call:",
        CALL_OPEN,
        '{"name": "<function name>", "arguments": <JSON object>}',
        CALL_CLOSE,
        "The arguments must be a JSON object that follows the function's parameters schema.",
        (
            "Call a function only when it helps to answer; otherwise answer the user directly, "
            "without any block."
        ),
        "You may call several functions at once: one block for each call.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()
    import llama_cpp

    path = str(PACKAGED["smollm2"]().path)
    vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)

    def count(text: str) -> int:
        return len(vocab.tokenize(text.encode(), add_bos=False, special=False))

    rows: list[tuple[str, int, int, int]] = []  # tool set, tools, before, after
    for file in sorted(DATA.glob("*.json")):
        tools = json.loads(file.read_text(encoding="utf-8"))
        before = count(json_block(tools))
        after = count(tool_system_prompt(tools, "auto", parallel=True))
        rows.append((file.stem, len(tools), before, after))
    if args.json:
        keys = ("tools", "n", "before", "after")
        print(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=1))
        return 0
    print("| tool set | tools | JSON schemas (tokens) | signatures (tokens) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, n, before, after in rows:
        print(f"| {name} | {n} | {before} | {after} | {after / before:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
