"""cases.jsonl from test-chat's dump: each case once, without llama.cpp's rendered
prompt and grammar (large, and not what the tests compare)."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    seen = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            case = json.loads(line)
            llama = case.pop("llama")
            case["llama"] = {
                "format": llama["format"],
                "generation_prompt": llama["generation_prompt"],
                "grammar_lazy": llama["grammar_lazy"],
                "has_grammar": bool(llama["grammar"]),
                "triggers": llama["triggers"],
                "thinking_start_tag": llama["thinking_start_tag"],
                "thinking_end_tags": llama["thinking_end_tags"],
            }
            case["template"] = case["template"].removeprefix("models/templates/")
            if not case["custom_messages"]:
                case.pop("messages")
            key = json.dumps(case, sort_keys=True)
            if key not in seen:
                seen.add(key)
                print(json.dumps(case, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1])
