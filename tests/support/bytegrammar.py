"""Whether a text is a sentence of a grammar: llguidance's matcher on a byte-level
vocabulary (one token per byte), so a grammar is checked without any model."""

from __future__ import annotations

from typing import Any

import llguidance


class _Bytes:
    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]

    def __call__(self, text: Any) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def matches(grammar: str, text: str) -> bool:
    """True if ``text`` is a whole sentence of ``grammar`` (llguidance Lark)."""
    matcher = llguidance.LLMatcher(_TOKENIZER, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(list(text.encode()))) and bool(matcher.is_accepting())
