"""Sampling on llama.cpp: the sampler chains, the grammar gate beside them, logprobs.

:class:`SamplingMixin` is the sampling half of :class:`~sluice.engine.llama_runner.
LlamaRunner`: the chain llama.cpp's server builds, greedy as a numpy argmax when
nothing in the chain is stateful, and a grammar checked one sampled token at a
time (a mask over the vocabulary only for a refused one).
"""

from __future__ import annotations

import ctypes
import logging
import re
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice.core.errors import InvalidRequest
from sluice.core.events import TokenLogprob, TopLogprob
from sluice.core.request import LLAMA_CPP_SAMPLING, SamplingParams
from sluice.engine.llg_gate import Gate, Grammars
from sluice.engine.runner import DecodeError
from sluice.engine.trigger import TriggerScanner

log = logging.getLogger("sluice.llama")

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed per sampler

# llama.cpp's llama_token_data, for numpy-filled candidate arrays.
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def token_data_array(L: Any, buf: npt.NDArray[Any]) -> Any:
    """A ``llama_token_data_array`` over ``buf``'s memory (which must outlive it)."""
    assert buf.dtype.itemsize == ctypes.sizeof(L.llama_token_data)
    data = ctypes.cast(buf.ctypes.data, ctypes.POINTER(L.llama_token_data))
    return L.llama_token_data_array(data=data, size=len(buf), selected=-1, sorted=False)


class Chain:
    """A sampler chain handle (a pointer owned by llama.cpp), or greedy without one.

    Greedy sampling with nothing stateful in the chain (no grammar, no
    penalties) is an argmax over the logits (plus any logit biases), which
    llama.cpp's ``llama_sampler_sample`` reaches by copying the whole vocabulary
    into a candidate array first: ~150 us a token for SmolLM2's 49,152 in a busy
    server, against ~10 us for numpy's argmax over llama.cpp's own logits. Same
    token: llama.cpp's greedy also takes the first of equal maxima, and a bias is
    the same float32 addition. Biases that only lower logits (``ignore_eos``, a
    ban) cannot change an argmax that none of them touches, so the copy they
    need is made only when the argmax is a biased token.
    """

    __slots__ = (
        "bias",
        "biased",
        "biases",
        "gate",
        "grammar",
        "lowers_only",
        "ptr",
        "scan",
    )

    def __init__(self, ptr: Any, biases: list[tuple[int, float]] | None = None) -> None:
        self.ptr = ptr  # None: greedy, done in LlamaRunner.sample
        self.biases = biases or []
        self.bias: tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]] | None = None
        self.biased: frozenset[int] = frozenset()
        self.lowers_only = True
        # The grammar that constrains the output (llg_gate), beside the chain: the
        # token the chain picks is checked against it alone, and only a refused one
        # costs a mask over the vocabulary (LlamaRunner._sample_gated).
        self.gate: Gate | None = None
        # A lazy grammar not engaged yet, kept aside while `scan` watches the output
        # for its trigger (see sluice.engine.trigger).
        self.grammar: Gate | None = None
        self.scan: TriggerScanner | None = None
        if biases:
            ids = np.array([t for t, _ in biases], dtype=np.intp)
            self.bias = (ids, np.array([b for _, b in biases], dtype=np.float32))
            self.biased = frozenset(t for t, _ in biases)
            self.lowers_only = all(b <= 0 for _, b in biases)


class SamplingMixin:
    """The sampling methods of the runner; it provides what is declared here."""

    _L: Any
    _Q: Any
    _ctx: Any
    n_vocab: int
    n_ctx_seq: int
    _rows: dict[int, int] | None
    _logits_row: Any
    _cand: npt.NDArray[Any]
    _cand_ids: npt.NDArray[np.int32]
    _cand_arr: Any
    _cand_data: Any
    _grammars: Grammars
    grammar_checks: int
    grammar_rejections: int
    forced_tokens: int

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        raise NotImplementedError

    def valid_token(self, token: int) -> bool:
        raise NotImplementedError

    def _eog_tokens(self) -> list[int]:
        raise NotImplementedError

    def new_sampler(self, params: SamplingParams, prompt: list[int]) -> Chain:
        """Build the chain llama.cpp's own server uses, in the same order.

        A lazy grammar with trigger words stays out of the chain until a trigger
        matches (see :mod:`sluice.engine.trigger` and :meth:`_engage`); it is built
        here all the same, so that a grammar llama.cpp refuses is a 400 now.
        """
        for token, _bias in params.logit_bias:
            if not self.valid_token(token):
                raise InvalidRequest(
                    f"logit_bias token id {token} is out of range", param="logit_bias"
                )
        params = LLAMA_CPP_SAMPLING.fill(params)  # fields left out: llama.cpp's defaults
        biases = list(params.logit_bias)
        if params.ignore_eos and not params.grammar:
            # (With a grammar, its end is the output's end: banning it would leave
            # nothing to sample once the grammar is complete.)
            biases += [(t, float("-inf")) for t in self._eog_tokens()]
        grammar = self._grammars.gate(params.grammar) if params.grammar else None
        penalties_on = params.uses_penalties and params.penalty_last_n != 0
        if (params.temperature or 0.0) <= 0 and not penalties_on:
            sampler = Chain(None, biases)
        else:
            sampler = Chain(self._chain(params, prompt, biases))
        if grammar is not None and (params.grammar_triggers or params.grammar_trigger_words):
            triggers = params.grammar_triggers or tuple(
                rf"[\s\S]*?({re.escape(w)})[\s\S]*" for w in params.grammar_trigger_words
            )
            sampler.grammar = grammar
            sampler.scan = TriggerScanner(triggers, params.grammar_trigger_words)
        elif grammar is not None:
            sampler.gate = grammar
        return sampler

    def _chain(
        self,
        params: SamplingParams,
        prompt: list[int],
        biases: list[tuple[int, float]],
    ) -> Any:
        L = self._L
        chain_params = L.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        chain = L.llama_sampler_chain_init(chain_params)
        if biases:
            L.llama_sampler_chain_add(chain, self._bias_sampler(biases))
        window = params.penalty_last_n if params.penalty_last_n is not None else 64
        if params.uses_penalties and window != 0:
            # llama.cpp's convention: -1 is the whole context, 0 turns penalties off.
            last_n = self.n_ctx_seq if window < 0 else window
            last_n = min(last_n, self.n_ctx_seq)
            penalties = L.llama_sampler_init_penalties(
                self.n_vocab,  # the pinned bindings still take n_vocab first
                last_n,
                1.0 if params.repeat_penalty is None else params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
            # Penalties see the prompt too, as in llama.cpp's server.
            for token in prompt[-last_n:]:
                L.llama_sampler_accept(penalties, token)
            L.llama_sampler_chain_add(chain, penalties)
        temperature, top_k = params.temperature or 0.0, params.top_k or 0
        top_p = 1.0 if params.top_p is None else params.top_p
        min_p = params.min_p or 0.0
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            if top_k > 0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(top_k))
            if top_p < 1.0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(top_p, 1))
            if min_p > 0.0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(min_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
            seed = DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
        return chain

    def _bias_sampler(self, biases: list[tuple[int, float]]) -> Any:
        L = self._L
        arr = (L.llama_logit_bias * len(biases))()
        for i, (token, bias) in enumerate(biases):
            arr[i].token = token
            arr[i].bias = bias
        return L.llama_sampler_init_logit_bias(self.n_vocab, len(biases), arr)

    def _engage(self, sampler: Chain, capture: bytes) -> None:
        """A trigger matched: the lazy grammar constrains the output from now on, the
        output from the match's capture on taken as its start. Output the grammar
        does not allow leaves the rest unconstrained (llama.cpp's lazy sampler would
        stop the server on it)."""
        gate, sampler.grammar, sampler.scan = sampler.grammar, None, None
        if gate is not None and gate.accept_text(capture):
            sampler.gate = gate
        else:
            log.warning(
                "a lazy grammar's trigger matched output it does not allow (%r): "
                "the rest of the answer is not constrained",
                capture[:80],
            )

    def free_sampler(self, sampler: Any) -> None:
        assert isinstance(sampler, Chain)
        if sampler.ptr:
            self._L.llama_sampler_free(sampler.ptr)
            sampler.ptr = None
        sampler.grammar = sampler.gate = None  # llguidance's: Python objects

    def sample(self, sampler: Any, row: int) -> int:
        if self._rows is not None:
            row = self._rows[row]
        if sampler.gate is not None:
            token = self._sample_gated(sampler, row)
        elif sampler.ptr is not None:
            token = int(self._L.llama_sampler_sample(sampler.ptr, self._ctx, row))
        else:
            token = self._argmax(sampler, row)
        scan = sampler.scan
        if scan is not None and scan.feed(self.token_bytes(token, special=True)) is not None:
            self._engage(sampler, scan.capture)
        return token

    def force(self, sampler: Any, limit: int) -> list[int]:
        """Jump-forward: the tokens the grammar allows as the only continuation
        (llguidance's fast-forward tokens, which already leave out the last ones where
        a longer vocabulary token could span the boundary), at most ``limit``, taken
        by the grammar and by the chain (its penalties) as if sampled."""
        gate = sampler.gate
        if gate is None or limit <= 0:
            return []
        tokens: list[int] = gate.matcher.compute_ff_tokens()[:limit]
        if not tokens:
            return []
        if not gate.matcher.consume_tokens(tokens):
            return []  # (it offered them: not expected) the tokens are then not forced
        if sampler.ptr is not None:
            for token in tokens:
                self._Q.llama_sampler_accept(sampler.ptr, token)
        self.forced_tokens += len(tokens)
        return tokens

    def force_tokens(self, sampler: Any, tokens: list[int]) -> bool:
        gate = sampler.gate
        if gate is not None:
            # On a copy (llguidance's validate_tokens stops where a lazy text's stop
            # string ends, as "</think>" ends the reasoning): all of them or none.
            probe = gate.matcher.deep_copy()
            if probe.try_consume_tokens(tokens) != len(tokens) or probe.is_error():
                return False
            gate.matcher = probe
        if sampler.ptr is not None:
            for token in tokens:
                self._Q.llama_sampler_accept(sampler.ptr, token)
        scan = sampler.scan
        if scan is not None:
            for token in tokens:
                if scan.feed(self.token_bytes(token, special=True)) is not None:
                    self._engage(sampler, scan.capture)
                    break
        self.forced_tokens += len(tokens)
        return True

    def _sample_gated(self, sampler: Chain, row: int) -> int:
        """Sample first, then ask the grammar about the chosen token only (as llama.cpp's
        own ``common_sampler_sample`` does): the unconstrained choice is usually one the
        grammar allows. Only a refused token costs the grammar's mask and a second
        pick among the tokens it allows. The grammar and the chain then accept the
        token, as ``llama_sampler_sample`` would have."""
        gate = sampler.gate
        assert gate is not None
        token = self._pick(sampler, row, None)
        self.grammar_checks += 1
        if not gate.allows(token):
            self.grammar_rejections += 1
            token = self._pick(sampler, row, gate)
        gate.accept(token)
        if sampler.ptr is not None:
            self._Q.llama_sampler_accept(sampler.ptr, token)
        return token

    def _pick(self, sampler: Chain, row: int, gate: Gate | None) -> int:
        """The token the chain would sample from batch row ``row`` (no accept), among
        those ``gate`` allows when it is given (its mask over the vocabulary)."""
        if sampler.ptr is None and gate is None:
            return self._argmax(sampler, row)
        cand = self._cand
        cand["id"] = self._cand_ids
        cand["logit"] = self._logits(row)
        cand["p"] = 0.0
        arr = self._cand_arr
        arr.data = self._cand_data  # in case a sampler pointed it elsewhere
        arr.size, arr.selected, arr.sorted = self.n_vocab, -1, False
        if gate is not None:
            cand["logit"][~gate.allowed()] = -np.inf
        if sampler.ptr is not None:  # as llama_sampler_sample: top-k & co. release the GIL
            self._L.llama_sampler_apply(sampler.ptr, ctypes.byref(arr))
            if not 0 <= arr.selected < arr.size:
                raise DecodeError(f"the sampler chose no token (selected {arr.selected})")
            return int(arr.data[arr.selected].id)
        logits = cand["logit"]
        if sampler.bias is not None:
            np.add.at(logits, *sampler.bias)
        return int(cand["id"][int(logits.argmax())])

    def _argmax(self, sampler: Chain, row: int) -> int:
        logits = self._logits(row)
        best = int(logits.argmax())
        if sampler.bias is None or (sampler.lowers_only and best not in sampler.biased):
            return best
        logits = logits.copy()
        np.add.at(logits, *sampler.bias)  # in order, repeated ids included, like the chain
        return int(logits.argmax())

    def _logits(self, row: int) -> npt.NDArray[np.float32]:
        """Batch row ``row``'s logits (in llama.cpp's last batch): a view of its buffer,
        valid until the next decode."""
        ptr = self._Q.llama_get_logits_ith(self._ctx, row)
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        if not address:
            raise DecodeError(f"no logits for batch row {row}")
        row_buffer = memoryview(self._logits_row.from_address(address)).cast("B")
        return np.frombuffer(row_buffer, dtype=np.float32)

    def logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
        logits = self._logits(row if self._rows is None else self._rows[row])
        peak = float(logits.max())
        logz = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
        top: tuple[TopLogprob, ...] = ()
        if top_n > 0:
            ids = np.argpartition(-logits, top_n - 1)[:top_n]
            ids = ids[np.argsort(-logits[ids], kind="stable")]
            top = tuple(self._top(int(t), float(logits[t]) - logz) for t in ids)
        piece = self.token_bytes(token)
        return TokenLogprob(
            piece.decode("utf-8", "replace"), token, float(logits[token]) - logz, tuple(piece), top
        )

    def _top(self, token: int, logprob: float) -> TopLogprob:
        # A control token (``<|im_end|>``) has no output text; show its own text.
        piece = self.token_bytes(token) or self.token_bytes(token, special=True)
        return TopLogprob(piece.decode("utf-8", "replace"), logprob, tuple(piece))
