"""Random texts of a grammar: a seeded walk over the tokens llguidance allows.

A :class:`Vocab` is what a walk chooses from: a byte-level vocabulary with a family's
markers as single special tokens (:func:`marker_vocab`), or a real model's
(:func:`model_vocab`). :func:`walk` takes one allowed token at a time, as a model
under the grammar would: in free text (reasoning, a string value up to its closing
markup) mostly random tokens, with markup-like phrases (every family's markers,
quotes, braces, ``<``, line breaks) spliced in with raised probability, and after a
few tokens the closing text of the region, so every region ends; elsewhere a
uniform choice among the allowed tokens; at an accepting state it may stop.

Example::

    vocab = marker_vocab(("<|end|>", "<think>"))
    matcher = vocab.matcher(lark)
    tokens = walk(matcher, vocab, random.Random(7), phrases, closers)
    text = vocab.text(tokens)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np

from sluice.engine.llg_gate import with_special_tokens

# Markup that looks like a control token: <|x|>, <｜x｜>, [X], <|x>, <x|>, Gemma's quote,
# MiniMax-M3's namespace token, and a whole tag without attributes (<think>, </x:y>).
_MARKER = re.compile(
    r"<\|[^<>|\s]*\|>|<｜[^<>｜]*｜>|\[/?[A-Z_]+\]|<\|[a-z_]+>|<[a-z_]+\|>|<\|\"\|>"
    r"|\]<\]minimax\[>\[|</?[A-Za-z_][A-Za-z0-9_:.\-]*>"
)


def markers(texts: Sequence[str]) -> tuple[str, ...]:
    """The pieces of ``texts`` that a model's vocabulary may hold as one special token."""
    found: dict[str, None] = {}
    for text in texts:
        for m in _MARKER.finditer(text):
            found[m.group()] = None
    return tuple(found)


@dataclass
class Vocab:
    """A vocabulary to walk on: llguidance's tokenizer, its end tokens, the control-token
    texts the grammar writes as tokens (``special``), and text for each token."""

    name: str
    tokenizer: Any
    n_vocab: int
    eos: frozenset[int]
    special: dict[str, int]
    piece: Callable[[int], bytes]
    encode: Callable[[str], list[int]]  # text as text tokens (no control tokens)
    _words: int = field(init=False, default=0)
    _text: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._words = (self.n_vocab + 31) // 32
        self._text = np.ones(self.n_vocab, dtype=bool)  # tokens that are not an end
        self._text[list(self.eos)] = False

    def allowed_text(self, matcher: Any) -> np.ndarray[Any, Any]:
        """The allowed tokens that are not an end of generation."""
        allowed = self.allowed(matcher)
        return allowed[self._text[allowed]]

    def matcher(self, lark: str) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_lark(with_special_tokens(lark, self.special))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def allowed(self, matcher: Any) -> np.ndarray[Any, Any]:
        mask = np.zeros(self._words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.n_vocab]
        return np.flatnonzero(bits)

    def spellings(self, text: str) -> list[list[int]]:
        """The ways to write ``text``: as text, and with its markers as their tokens."""
        out = [self.encode(text)]
        if self.special:
            find = "|".join(re.escape(m) for m in sorted(self.special, key=len, reverse=True))
            tokens: list[int] = []
            at = 0
            for hit in re.finditer(find, text):
                tokens += self.encode(text[at : hit.start()]) + [self.special[hit.group()]]
                at = hit.end()
            if at:
                out.append(tokens + self.encode(text[at:]))
        return out

    def text(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8")

    def pieces(self, tokens: Sequence[int]) -> Iterator[str]:
        """The text token by token, as the engine hands it on (whole characters only)."""
        held = b""
        for t in tokens:
            held += self.piece(t)
            for cut in range(len(held), max(len(held) - 4, -1), -1):
                try:
                    text = held[:cut].decode("utf-8")
                except UnicodeDecodeError:
                    continue
                held = held[cut:]
                if text:
                    yield text
                break
        assert not held, held


class _Bytes:
    """A byte-level tokenizer (one token a byte) with extra special tokens."""

    def __init__(self, extra: Sequence[str]) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.tokens += [m.encode() for m in extra]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = list(range(256, 257 + len(extra)))

    def __call__(self, text: Any) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


def marker_vocab(extra: Sequence[str]) -> Vocab:
    """Bytes, an end token (256), and each of ``extra`` as one special token."""
    raw = _Bytes(extra)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(raw))
    pieces = raw.tokens

    return Vocab(
        name="markers",
        tokenizer=tokenizer,
        n_vocab=len(pieces),
        eos=frozenset({256}),
        special={m: 257 + i for i, m in enumerate(extra)},
        piece=lambda t: b"" if t == 256 else pieces[t],
        encode=lambda text: list(text.encode()),
    )


def model_vocab(runner: Any) -> Vocab:
    """A real model's vocabulary, with its grammar tokenizer as the runner builds it."""
    grammars = runner._grammars
    return Vocab(
        name="model",
        tokenizer=grammars.tokenizer(),
        n_vocab=grammars.n_vocab,
        eos=grammars.eog,
        special=grammars.special,
        piece=lambda t: runner.token_bytes(t, True),
        encode=lambda text: runner.tokenize(text, add_special=False, parse_special=False),
    )


@dataclass
class Walked:
    tokens: list[int]
    stopped: bool  # the walk ended where the grammar may end (else: cut at max_tokens)


def walk(
    matcher: Any,
    vocab: Vocab,
    rng: random.Random,
    phrases: Sequence[str],
    closers: Sequence[str],
    *,
    max_tokens: int = 1000,
    stop: float = 0.45,
) -> Walked:
    """A random sentence of ``matcher``'s grammar (see the module's doc)."""
    tokens: list[int] = []
    free = 0  # tokens of free text in a row
    budget = rng.choice((0, 1, 2, 3, 6, 12))  # free tokens before the walk closes it
    while len(tokens) < max_tokens:
        if matcher.is_stopped():
            return Walked(tokens, True)
        if matcher.is_accepting() and rng.random() < stop:
            return Walked(tokens, True)
        allowed = vocab.allowed_text(matcher)
        if not allowed.size:
            return Walked(tokens, bool(matcher.is_accepting()))
        if allowed.size * 3 > vocab.n_vocab:  # free text
            free += 1
            if free > budget and _close(matcher, vocab, rng, closers, tokens):
                free, budget = 0, rng.choice((0, 1, 2, 3, 6, 12))
                continue
            if rng.random() < 0.3 and _splice(matcher, vocab, rng, phrases, tokens, whole=False):
                continue
            token = int(allowed[rng.randrange(allowed.size)])
            if vocab.name == "markers" and rng.random() < 0.7:
                ascii_ = allowed[(allowed >= 32) & (allowed < 127)]
                token = int(ascii_[rng.randrange(ascii_.size)]) if ascii_.size else token
        else:
            free = 0
            token = int(allowed[rng.randrange(allowed.size)])
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    return Walked(tokens, False)


def _splice(
    matcher: Any,
    vocab: Vocab,
    rng: random.Random,
    phrases: Sequence[str],
    tokens: list[int],
    *,
    whole: bool,
) -> bool:
    """Write one of ``phrases`` (any spelling the grammar allows; with ``whole`` all of
    it, else as much of it as is allowed); False if none could be written."""
    order = list(phrases)
    rng.shuffle(order)
    for phrase in order[:24]:
        spellings = vocab.spellings(phrase)
        rng.shuffle(spellings)
        for spelling in spellings:
            n = _fits(matcher, spelling)
            if n == 0 or (whole and n < len(spelling)):
                continue
            assert matcher.consume_tokens(spelling[:n]), matcher.get_error()
            tokens.extend(spelling[:n])
            return True
    return False


def _fits(matcher: Any, spelling: list[int]) -> int:
    """How many of ``spelling``'s tokens the grammar takes next (on a copy: llguidance's
    validate_tokens stops where a lazy text's stop string ends)."""
    return int(matcher.deep_copy().try_consume_tokens(spelling))


def _close(
    matcher: Any, vocab: Vocab, rng: random.Random, closers: Sequence[str], tokens: list[int]
) -> bool:
    """Write one of ``closers`` that ends the free text; False if none does."""
    order = list(closers)
    rng.shuffle(order)
    for phrase in order:
        spellings = vocab.spellings(phrase)
        rng.shuffle(spellings)
        for spelling in spellings:
            probe = matcher.deep_copy()
            if probe.try_consume_tokens(spelling) < len(spelling):
                continue
            if vocab.allowed(probe).size * 3 <= vocab.n_vocab or probe.is_accepting():
                assert matcher.consume_tokens(spelling), matcher.get_error()
                tokens.extend(spelling)
                return True
    return False
