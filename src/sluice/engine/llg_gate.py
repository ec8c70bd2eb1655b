"""Grammars on llguidance: a per-request gate that checks tokens and computes masks.

The grammars sluice builds (``sluice.grammar``: Lark, JSON schemas inline) run on
llguidance's matcher (``llguidance.LLMatcher``, the grammar engine of vLLM and
SGLang and llama.cpp's optional one), not on llama.cpp's GBNF sampler: on
SmolLM2's 49k vocabulary a token's mask takes ~20 us (p90 ~100 us) against
3.5-5 ms for llama.cpp's pass over the vocabulary, and checking one token
~0.6 us.

The engine samples first and asks the gate about the chosen token only
(``LlamaRunner._sample_gated``); the mask is computed only when that token is
refused.

Example::

    grammars = Grammars(vocab, n_vocab, eog_tokens)   # per model; one tokenizer for it
    gate = grammars.gate('start: "yes" | "no"')
    if not gate.allows(token):
        logits[~gate.allowed()] = -inf
    gate.accept(token)
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice.core.deepstack import run_deep
from sluice.core.errors import InvalidRequest
from sluice.core.syntax import regex_text


class Gate:
    """One request's grammar state (the engine thread's, once sampling starts)."""

    __slots__ = ("_grammars", "_mask", "matcher")

    def __init__(self, grammars: Grammars, matcher: Any) -> None:
        self._grammars = grammars
        self.matcher = matcher
        self._mask = np.zeros((grammars.n_vocab + 31) // 32, dtype=np.int32)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (without taking it). An end-of-generation
        token may end an accepting grammar (llguidance's token check counts text
        tokens only; its mask has them)."""
        if token in self._grammars.eog:
            return bool(self.matcher.is_accepting())
        return bool(self.matcher.validate_tokens([token]) == 1)

    def allowed(self) -> npt.NDArray[np.bool_]:
        """Which tokens may come next, as a mask over the vocabulary."""
        mask = self._mask
        self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        allowed = bits[: self._grammars.n_vocab].view(np.bool_)
        if not allowed.any():  # a matcher in error (it should not be): end the output
            allowed[list(self._grammars.eog)] = True
        return allowed

    def accept(self, token: int) -> None:
        """``token`` was sampled (one :meth:`allows` or :meth:`allowed` let through)."""
        self.matcher.consume_token(token)

    def accept_text(self, data: bytes) -> bool:
        """Output that came before the grammar engaged (a lazy grammar's trigger on):
        taken as it tokenizes; False if the grammar does not allow it."""
        tokens = self._grammars.tokenizer().tokenize_bytes(data)
        return bool(self.matcher.consume_tokens(tokens)) and not self.matcher.is_error()


_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
# A lazy text rule (grammar.native): ``name[stop="closing"]: /regex/``.
_LAZY_TEXT = re.compile(r'^([\w-]+)\[stop=("(?:[^"\\]|\\.)*")\]: (/.*/)$')


def with_special_tokens(lark: str, special: dict[str, int]) -> str:
    """``lark`` with each control-token text inside a string literal written as that
    token (``<[id]>``): llguidance never matches a control token with text, and a
    family's markup (``<|tool_call_begin|>``, ``[TOOL_CALLS]``, ``<|channel|>``) is
    control tokens in its own vocabulary. Lines with a JSON schema or a stop string
    are left as they are."""
    if not special:
        return lark
    find = re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)))

    def literal(m: re.Match[str]) -> str:
        text = json.loads(m.group())
        if find.search(text) is None:
            return m.group()
        parts = []
        at = 0
        for hit in find.finditer(text):
            if hit.start() > at:
                parts.append(json.dumps(text[at : hit.start()], ensure_ascii=False))
            parts.append(f"<[{special[hit.group()]}]>")
            at = hit.end()
        if at < len(text):
            parts.append(json.dumps(text[at:], ensure_ascii=False))
        return "(" + " ".join(parts) + ")"

    lines: list[str] = []
    for line in lark.split("\n"):
        lazy = _LAZY_TEXT.match(line)
        head = find.match(json.loads(lazy.group(2))) if lazy is not None else None
        if lazy is not None and head is not None:
            # Text up to closing markup that opens with a control token: the text cannot
            # hold the token, so it runs until the token comes (a stop string is text
            # and would never see it). Nor may it hold the token's text: a reader of
            # the output sees the same characters either way, and takes the first.
            closing = _LITERAL.sub(literal, lazy.group(2))
            text = f"LAZY_TEXT_{len(lines)}"
            lines.append(f"{lazy.group(1)}: {text} {closing}")
            lines.append(f"{text}: {lazy.group(3)} & ~/(.|\\n)*{regex_text(head.group())}(.|\\n)*/")
        elif "%json" in line or "[stop=" in line:
            lines.append(line)
        else:
            lines.append(_LITERAL.sub(literal, line))
    return "\n".join(lines)


TOKENIZER_BYTES_PER_TOKEN = 448  # llguidance's token trie and tables, with a margin


class Grammars:
    """A model's grammar compiler: llguidance's tokenizer for its vocabulary (made on
    the first grammar, ~0.2 s for 49k tokens, ~1.3 s for 262k), shared by its gates."""

    def __init__(
        self,
        vocab: Any,
        n_vocab: int,
        eog: Callable[[], list[int]],
        special: dict[str, int] | None = None,
    ) -> None:
        self._vocab = vocab
        self.special = special or {}  # control-token texts -> ids (with_special_tokens)
        self.n_vocab = n_vocab
        self._eog = eog
        self._tokenizer: Any = None
        self._eog_set: frozenset[int] | None = None
        self._lock = threading.Lock()

    @property
    def eog(self) -> frozenset[int]:
        """The model's end-of-generation tokens (the grammar's ends)."""
        eog = self._eog_set
        if eog is None:
            eog = self._eog_set = frozenset(self._eog())
        return eog

    @property
    def tokenizer_bytes(self) -> int:
        """What the tokenizer takes in memory: measured (the process's RSS growth while
        it is made) at 432 bytes a token for SmolLM2's 49k and Gemma 3's 262k tokens."""
        return self.n_vocab * TOKENIZER_BYTES_PER_TOKEN

    @property
    def made(self) -> bool:
        return self._tokenizer is not None

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab

                with warnings.catch_warnings():  # a deprecation warning per token
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(
                        self._vocab, n_vocab=self.n_vocab, eos_token=self._eog() or None
                    )
            return self._tokenizer

    def gate(self, lark: str) -> Gate:
        """A gate on ``lark`` (llguidance's Lark, start rule ``start``); a grammar that
        cannot be compiled is a 400 naming llguidance's reason."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(with_special_tokens(lark, self.special))
        tokenizer = self.tokenizer()
        matcher = run_deep(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0))
        if matcher.is_error():
            raise InvalidRequest(
                f"The constraint grammar could not be compiled: {matcher.get_error()}"
            )
        return Gate(self, matcher)
