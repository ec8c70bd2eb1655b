"""Where a lazy grammar engages: the trigger patterns, checked as the output grows.

llama.cpp's lazy grammar sampler appends every sampled token's piece to a buffer
and runs ``std::regex_match`` of each trigger pattern over the *whole* buffer, on
every token, until one matches. That is quadratic in the answer's length, and
libstdc++'s backtracking executor is slow at it: a tool-offering request whose
model rambled on without calling a tool was measured at 600 ms a token after
2,400 tokens (SmolLM2, a Codex CLI prompt), against 5 ms for the same request
without tools. So the engine does not hand llama.cpp the grammar until a trigger
has matched: :class:`TriggerScanner` watches the output at a cost that does not
grow with it, and the runner then builds llama.cpp's lazy sampler and feeds it
only the tokens from the one where the match's capture begins (see
``LlamaRunner.sample``).

The patterns keep llama.cpp's meaning (``regex_match`` over all the output so far;
the grammar takes over from the first non-empty capture group). ``words`` are the
literal texts every match's capture group starts with: a new match can only come
with a new occurrence of one of them, so the whole patterns run only then (once per
occurrence, not once per token). Without words the patterns run on every token,
as llama.cpp does (correct, and as slow).
"""

from __future__ import annotations

import bisect
import re


class TriggerScanner:
    """Feed it each generated token's piece; it says at which token a trigger matched.

    Example::

        scan = TriggerScanner([r"[\\s\\S]*?(<tool_call>)[\\s\\S]*"], ["<tool_call>"])
        scan.feed(b"Sure. <tool")  # None
        scan.feed(b"_call>")  # 0: the capture begins in token 0
    """

    __slots__ = ("_buf", "_longest", "_patterns", "_starts", "_words", "capture", "checks")

    def __init__(self, patterns: list[str] | tuple[str, ...], words: tuple[str, ...] = ()) -> None:
        self._patterns = [re.compile(p.encode()) for p in patterns]
        self._words = [w.encode() for w in words if w]
        self._longest = max((len(w) for w in self._words), default=0)
        self._buf = bytearray()
        self._starts: list[int] = []  # each token's first byte in _buf
        self.checks = 0  # full-pattern runs (tests count them)
        self.capture = b""  # the output from the match's capture on, once matched

    def feed(self, piece: bytes) -> int | None:
        """Append one token's piece; the index of the token the match's capture
        begins in, once a pattern matches the whole output (None before)."""
        buf = self._buf
        old = len(buf)
        self._starts.append(old)
        buf += piece
        if self._words:
            since = max(0, old - self._longest + 1)
            if not any(buf.find(w, since) >= 0 for w in self._words):
                return None
        self.checks += 1
        text = bytes(buf)
        for pattern in self._patterns:
            m = pattern.fullmatch(text)
            if m is not None:
                start = next(
                    (m.start(i) for i in range(1, len(m.groups()) + 1) if m.start(i) < m.end(i)),
                    0,
                )
                self.capture = text[start:]
                return bisect.bisect_right(self._starts, start) - 1
        return None
