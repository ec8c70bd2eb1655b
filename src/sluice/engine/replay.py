"""A replay model: recorded answers, written out through the real engine like a model's.

No weights: a request's answer is the first recorded line whose ``when`` the
rendered prompt contains (a line without ``when`` answers anything), and the
runner emits it token by token as a model would: the template's markup (its
``<|...|>``, ``[TOOL_CALLS]``-style and tag strings) as single tokens, other text
in pieces of a few characters, then the end of the turn. Everything above the
runner (the engine loop, stop strings, ``max_tokens``, usage, the template, the
output parsers, the dialects) is the code a real model goes through. For people
who test their agents in CI without weights, and for sluice's own format tests.

Markup in ``<|...|>``, ``<｜...｜>`` or ``[UPPER_CASE]`` form is a control token,
as in the real vocabularies: its text shows only when the request renders
special tokens (as a family's own format does); tag-like markup (``<tool_call>``,
``<think>``) is ordinary text.

Example::

    runner = ReplayRunner.from_file("answers.jsonl", template_source, model_id="agent-ci")
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.core.errors import InvalidRequest, ModelLoadFailed
from sluice.core.events import TokenLogprob
from sluice.core.request import SamplingParams
from sluice.engine.runner import BatchEntry, DecodeError, ModelInfo

EOS_ID = 0
_FIRST_ID = 1
# Markup in a template's text: <|x|>, <｜x｜>, [X_Y], </tag>, <tag>, <tag:x>, <tag=...
_MARKUP = re.compile(
    r"<\|[^|<>\s]{1,48}\|>|<｜[^｜<>]{1,48}｜>|\[/?[A-Z][A-Z_]{1,30}\]"
    r"|</?[A-Za-z][\w:.\-]{0,40}>|<[A-Za-z][\w:.\-]{0,40}="
)
_CONTROL = re.compile(r"<\|.*\|>|<｜.*｜>|\[/?[A-Z_]+\]")
_PIECES = re.compile(r" ?[^\s]{1,3}|\s")  # other text: a few characters a token


@dataclass(frozen=True, slots=True)
class Answer:
    when: str | None
    output: str


def read_answers(path: str | Path) -> list[Answer]:
    """The recorded answers of a JSONL file; :class:`ModelLoadFailed` naming the line."""
    answers = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ModelLoadFailed(f"Cannot read the replay answers '{path}': {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ModelLoadFailed(f"{path}:{number}: not a JSON object: {exc}") from exc
        if not isinstance(item, dict) or not isinstance(item.get("output"), str):
            raise ModelLoadFailed(f'{path}:{number}: needs "output" (a string)')
        when = item.get("when")
        if when is not None and not isinstance(when, str):
            raise ModelLoadFailed(f'{path}:{number}: "when" must be a string')
        unknown = set(item) - {"when", "output"}
        if unknown:
            raise ModelLoadFailed(f"{path}:{number}: unknown key {min(unknown)!r}")
        answers.append(Answer(when, item["output"]))
    return answers


@dataclass
class _Sampler:
    script: list[int]
    pos: int = 0


class ReplayRunner:
    """A :class:`~sluice.engine.runner.ModelRunner` answering from recorded text."""

    dense_sequences = True
    trim_after_restore = True
    can_rewind = True
    min_prefill_chunk = 1

    def __init__(
        self,
        answers: list[Answer],
        chat_template: str | None,
        *,
        model_id: str,
        path: str = "<replay>",
        n_ctx: int = 4096,
        n_parallel: int = 1,
        n_batch: int = 512,
        end_of_turn: tuple[str, ...] = (),
    ) -> None:
        self.answers = answers
        markup = sorted(set(_MARKUP.findall(chat_template or "")), key=lambda m: (-len(m), m))
        self.n_ctx_seq = n_ctx
        self.n_seq_max = n_parallel
        self.n_batch = n_batch
        self.n_vocab = 1 << 24
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self._texts: dict[int, str] = {EOS_ID: ""}
        self._control: set[int] = set()
        for text in markup:
            token = self._id(text)
            if _CONTROL.fullmatch(text):
                self._control.add(token)
        # The template's end-of-turn markup ends the answer, as the model's EOG token does.
        self._eog = {EOS_ID} | {self._id(t) for t in end_of_turn if t}
        markup = sorted({*markup, *(t for t in end_of_turn if t)}, key=lambda m: (-len(m), m))
        self._special = re.compile("|".join(re.escape(m) for m in markup)) if markup else None
        self.control_texts = tuple(m for m in markup if _CONTROL.fullmatch(m))
        self.history: dict[int, list[int]] = {}
        self._rows: dict[int, int] = {}
        self.info = ModelInfo(
            id=model_id,
            path=path,
            n_ctx_train=n_ctx,
            n_params=0,
            size_bytes=0,
            description="replay model (recorded answers)",
            chat_template=chat_template,
            bos_token="",
            eos_token="",
            add_bos=False,
        )

    @classmethod
    def from_file(cls, path: str | Path, chat_template: str | None, **kwargs: Any) -> ReplayRunner:
        return cls(read_answers(path), chat_template, path=str(path), **kwargs)

    # -- the vocabulary ----------------------------------------------------------------

    def _id(self, text: str) -> int:
        with self._lock:
            token = self._ids.get(text)
            if token is None:
                token = _FIRST_ID + len(self._ids)
                self._ids[text] = token
                self._texts[token] = text
            return token

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        out: list[int] = []
        at = 0
        if parse_special and self._special is not None:
            for m in self._special.finditer(text):
                out += self._plain(text[at : m.start()])
                out.append(self._id(m.group()))
                at = m.end()
        out += self._plain(text[at:])
        return out

    def _plain(self, text: str) -> list[int]:
        return [self._id(p) for p in _PIECES.findall(text)]

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        if token in self._control and not special:
            return b""
        return self._texts.get(token, "").encode()

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    # -- answering ---------------------------------------------------------------------

    def answer_for(self, prompt: str) -> Answer | None:
        return next((a for a in self.answers if a.when is None or a.when in prompt), None)

    def new_sampler(self, params: SamplingParams, prompt: list[int]) -> _Sampler:
        text = "".join(self._texts.get(t, "") for t in prompt)
        answer = self.answer_for(text)
        if answer is None:
            raise InvalidRequest(
                f"The replay model '{self.info.id}' has no recorded answer for this prompt: "
                f'no line of {self.info.path} has a "when" that the prompt contains '
                '(a line without "when" answers anything).'
            )
        return _Sampler(self.tokenize(answer.output, add_special=False))

    def free_sampler(self, sampler: Any) -> None:
        pass

    def sample(self, sampler: Any, row: int) -> int:
        if row not in self._rows:
            raise DecodeError(f"row {row} has no logits in the last decode")
        if sampler.pos >= len(sampler.script):
            return EOS_ID
        token: int = sampler.script[sampler.pos]
        sampler.pos += 1
        return token

    def force(self, sampler: Any, limit: int) -> list[int]:
        return []  # no grammar runs here: the answers are recorded

    def force_tokens(self, sampler: Any, tokens: list[int]) -> bool:
        """A reasoning budget's closer: the recording goes on after its own end of the
        reasoning (the closer's last token), as a model would write its answer next."""
        script, end = sampler.script, tokens[-1]
        at = next((i for i in range(sampler.pos, len(script)) if script[i] == end), None)
        sampler.pos = len(script) if at is None else at + 1
        return True

    def logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
        piece = self.token_bytes(token, special=True)
        return TokenLogprob(piece.decode("utf-8", "replace"), token, 0.0, tuple(piece), ())

    # -- the "KV cache": each sequence's tokens --------------------------------------

    def decode(self, entries: list[BatchEntry]) -> None:
        row = 0
        self._rows = {}
        for entry in entries:
            hist = self.history.setdefault(entry.seq, [])
            del hist[entry.pos0 :]
            hist.extend(entry.tokens)
            for _ in entry.tokens:
                self._rows[row] = entry.seq
                row += 1

    def keep_prefix(self, seq: int, n_keep: int) -> int:
        hist = self.history.setdefault(seq, [])
        del hist[max(0, n_keep) :]
        return len(hist)

    def move_sequence(self, src: int, dst: int) -> None:
        self.history[dst] = self.history.pop(src, [])

    def save_seq(self, seq: int) -> bytearray:
        hist = self.history.get(seq, [])
        return bytearray(array("i", [len(hist), *hist]).tobytes())

    def load_seq(self, seq: int, data: bytearray) -> int:
        n = array("i", bytes(data[:4]))[0]
        self.history[seq] = array("i", bytes(data[4 : 4 + 4 * n])).tolist()
        return n

    def new_embedder(self, n_ctx: int) -> Any:
        raise InvalidRequest(f"The replay model '{self.info.id}' does not embed.", param="model")

    def embedder_bytes(self, n_ctx: int) -> int:
        return 0

    def grammar_bytes(self) -> tuple[int, bool]:
        return 0, True  # its answers are recorded: no grammar tokenizer to make

    def close(self) -> None:
        self.history.clear()
