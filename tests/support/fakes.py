"""A scripted model runner: the real engine loop, with chosen token pieces.

The fake replaces only the model (``ModelRunner``). Scheduling, slots, UTF-8
reassembly, stop strings, cancellation, formatters and HTTP are the real
code, so boundary cases are tested deterministically through all of them.

Example::

    runner = ScriptedRunner({"Hi": [b"\\xe2\\x82", b"\\xac", b" done"]})
    app = create_app(Settings(model="scripted"), runner_factory=lambda s: runner)

A prompt's script is looked up by the rendered prompt text (for chat: the
fake ChatML template below); a prompt with no script gets ``default``.
Each script item is the bytes of one token, or a marker:

* ``EOS``: the end-of-sequence token (generation stops with ``stop``);
* ``FAIL``: the next decode of a batch holding this sequence fails.

When a script runs out, the sequence emits EOS.
"""

from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from sluice.core.events import TokenLogprob, TopLogprob
from sluice.core.request import SamplingParams
from sluice.engine.embed_batch import EmbedBatcher
from sluice.engine.runner import BatchEntry, DecodeError, ModelInfo

EOS = object()
FAIL = object()

EOS_ID = 2


@dataclass(frozen=True)
class Forced:
    """A script item its grammar forces: ``force`` hands it over (jump-forward) when it
    comes right after a sampled token; ``sample`` takes it like any piece otherwise."""

    piece: bytes


_PIECE_BASE = 0x200000

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_prompt(*messages: tuple[str, str]) -> str:
    """The rendered CHATML prompt for (role, content) pairs, as the fake sees it."""
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return out + "<|im_start|>assistant\n"


@dataclass
class FakeSampler:
    prompt: list[int]
    script: list[Any]
    params: SamplingParams
    pos: int = 0
    freed: bool = False


@dataclass
class ScriptedRunner:
    """A :class:`~sluice.engine.runner.ModelRunner` that replays scripts."""

    scripts: dict[str, list[Any]] = field(default_factory=dict)
    default: list[Any] = field(default_factory=lambda: [b"Hello", b" world", b"!"])
    n_ctx_seq: int = 256
    n_seq_max: int = 4
    n_batch: int = 64
    step_delay: float = 0.0  # seconds each decode takes
    token_delay: float = 0.0  # and seconds per token in it (prefill costs by the token)
    # seconds a tokenize takes (preparing a request), by a word in its text ("" for any)
    tokenize_delays: dict[str, float] = field(default_factory=dict)
    chat_template: str | None = CHATML
    partial_keep: bool = True  # False: behave like a cache that cannot drop a suffix
    dense_sequences: bool = True  # the engine compacts active sequences onto low ids
    trim_after_restore: bool = True  # False: like a sliding-window model's saved state
    control_texts: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")
    min_prefill_chunk: int = 1
    # keep_prefix drops any suffix, so the engine may speculate: off by default, so that a
    # long scripted answer (``[b"w"] * 1000``) takes a step a token, as timing tests expect
    can_rewind: bool = False
    state_bytes_per_token: int = 4  # size of a saved state, like a real KV's (>= 4)
    embedders: list[FakeEmbedder] = field(default_factory=list)  # made by new_embedder
    embed_delay: float = 0.0  # seconds each embedding decode takes
    embed_bytes: int = 1 << 20  # what an embedding context holds (new_embedder's bytes)
    grammar_tokenizer_bytes: int = 1 << 20  # what the grammar tokenizer holds, once made
    grammar_made: bool = False  # made on the first sampler with a grammar

    def __post_init__(self) -> None:
        self.info = ModelInfo(
            id="scripted",
            path="<scripted>",
            n_ctx_train=self.n_ctx_seq,
            n_params=0,
            size_bytes=0,
            description="scripted test runner",
            chat_template=self.chat_template,
            bos_token="",
            eos_token="<|im_end|>",
            add_bos=False,
        )
        self.n_vocab = _PIECE_BASE * 2
        self._pieces: dict[bytes, int] = {}
        self._by_id: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.history: dict[int, list[int]] = {}
        self.decodes: list[list[BatchEntry]] = []
        self.moves: list[tuple[int, int]] = []
        self.saves: list[tuple[int, list[int]]] = []  # (seq, tokens) per save_seq
        self.loads: list[tuple[int, list[int]]] = []  # (seq, tokens) per load_seq
        self.samplers: list[FakeSampler] = []
        self._rows: dict[int, int] = {}
        self._fail_next = False
        self.closed = False
        self.forced_closers: list[list[int]] = []  # force_tokens' tokens, call by call

    # -- any thread -----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        for word, seconds in self.tokenize_delays.items():
            if word in text:
                time.sleep(seconds)
                break
        return [ord(c) for c in text]

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        if token >= _PIECE_BASE:
            return self._by_id[token]
        if token == EOS_ID:
            return b""
        return chr(token).encode()

    def is_eog(self, token: int) -> bool:
        return token == EOS_ID

    def new_sampler(self, params: SamplingParams, prompt: list[int]) -> FakeSampler:
        text = "".join(chr(t) for t in prompt)
        script = list(self.scripts.get(text, self.default))
        sampler = FakeSampler(list(prompt), script, params)
        with self._lock:
            self.samplers.append(sampler)
            if params.grammar:
                self.grammar_made = True
        return sampler

    def free_sampler(self, sampler: Any) -> None:
        sampler.freed = True

    def piece_id(self, piece: bytes) -> int:
        with self._lock:
            token = self._pieces.get(piece)
            if token is None:
                token = _PIECE_BASE + len(self._pieces)
                self._pieces[piece] = token
                self._by_id[token] = piece
            return token

    # -- engine thread ----------------------------------------------------------

    def keep_prefix(self, seq: int, n_keep: int) -> int:
        hist = self.history.setdefault(seq, [])
        if n_keep > 0 and self.partial_keep:
            del hist[n_keep:]
            return min(n_keep, len(hist))
        hist.clear()
        return 0

    def move_sequence(self, src: int, dst: int) -> None:
        self.moves.append((src, dst))
        self.history[dst] = self.history.pop(src, [])

    def save_seq(self, seq: int) -> bytearray:
        """The sequence's history (a count, then int32 tokens), padded to
        ``state_bytes_per_token`` per token: what load_seq puts back."""
        hist = list(self.history.get(seq, []))
        self.saves.append((seq, hist))
        data = bytearray(array("i", [len(hist), *hist]).tobytes())
        return data.ljust(max(len(data), len(hist) * self.state_bytes_per_token), b"\0")

    def load_seq(self, seq: int, data: bytearray) -> int:
        n = array("i", bytes(data[:4]))[0]
        hist = array("i", bytes(data[4 : 4 + 4 * n])).tolist()
        self.loads.append((seq, list(hist)))
        self.history[seq] = hist
        return len(hist)

    def decode(self, entries: list[BatchEntry]) -> None:
        if self.step_delay or self.token_delay:
            time.sleep(self.step_delay + self.token_delay * sum(len(e.tokens) for e in entries))
        self.decodes.append(list(entries))
        if self._fail_next:
            self._fail_next = False
            raise DecodeError("scripted decode failure")
        row = 0
        self._rows = {}
        for entry in entries:
            hist = self.history.setdefault(entry.seq, [])
            assert len(hist) == entry.pos0, (entry.seq, len(hist), entry.pos0)
            hist.extend(entry.tokens)
            for _ in entry.tokens:
                self._rows[row] = entry.seq
                row += 1

    def sample(self, sampler: Any, row: int) -> int:
        assert row in self._rows, f"row {row} has no logits in the last decode"
        while sampler.pos < len(sampler.script):
            item = sampler.script[sampler.pos]
            sampler.pos += 1
            if item is FAIL:
                self._fail_next = True
                continue
            if item is EOS:
                return EOS_ID
            if isinstance(item, Forced):
                return self.piece_id(item.piece)
            return self.piece_id(item)
        return EOS_ID

    def force(self, sampler: Any, limit: int) -> list[int]:
        out: list[int] = []
        while (
            len(out) < limit
            and sampler.pos < len(sampler.script)
            and isinstance(sampler.script[sampler.pos], Forced)
        ):
            out.append(self.piece_id(sampler.script[sampler.pos].piece))
            sampler.pos += 1
        return out

    def force_tokens(self, sampler: Any, tokens: list[int]) -> bool:
        """A reasoning budget's closer: the script goes on after the piece the closer
        ends with (where the scripted model closes its reasoning itself)."""
        self.forced_closers.append(list(tokens))
        closer = b"".join(self.token_bytes(t, special=True) for t in tokens)
        script = sampler.script
        for i in range(sampler.pos, len(script)):
            item = script[i].piece if isinstance(script[i], Forced) else script[i]
            if isinstance(item, bytes) and len(item) > 1 and closer.endswith(item):
                sampler.pos = i + 1
                break
        return True

    def logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
        piece = self.token_bytes(token)
        text = piece.decode("utf-8", "replace")
        top = tuple(
            TopLogprob(text if i == 0 else f"alt{i}", -0.5 - i, tuple(piece)) for i in range(top_n)
        )
        return TokenLogprob(text, token, -0.5, tuple(piece), top)

    def new_embedder(self, n_ctx: int) -> FakeEmbedder:
        embedder = FakeEmbedder(
            n_ctx=min(n_ctx, self.n_ctx_seq),
            bytes=self.embedder_bytes(n_ctx),
            decode_delay=self.embed_delay,
        )
        self.embedders.append(embedder)
        return embedder

    def embedder_bytes(self, n_ctx: int) -> int:
        return self.embed_bytes

    def grammar_bytes(self) -> tuple[int, bool]:
        return self.grammar_tokenizer_bytes, self.grammar_made

    def close(self) -> None:
        self.closed = True

    # -- test helpers -------------------------------------------------------------

    def seqs_per_decode(self) -> list[int]:
        return [len({e.seq for e in entries}) for entries in self.decodes]


@dataclass
class FakeEmbedder:
    """Deterministic unit vectors from the token ids (a token's count per bucket),
    through the real :class:`EmbedBatcher` (``batches``: inputs per decode)."""

    n_ctx: int
    n_embd: int = 8
    pooling: str = "mean"
    bytes: int = 1 << 20
    decode_delay: float = 0.0
    batches: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._batcher = EmbedBatcher(self._decode, max_tokens=self.n_ctx, max_seqs=64)

    def embed(self, inputs: Any) -> list[list[float]]:
        return self._batcher.embed(inputs)

    def _decode(self, group: list[list[int]]) -> list[list[float]]:
        self.batches.append(len(group))
        time.sleep(self.decode_delay)
        out = []
        for tokens in group:
            assert 0 < len(tokens) <= self.n_ctx, len(tokens)
            v = [0.0] * self.n_embd
            for t in tokens:
                v[t % self.n_embd] += 1.0
            norm = sum(x * x for x in v) ** 0.5
            out.append([x / norm for x in v])
        return out

    def close(self) -> None:
        pass
