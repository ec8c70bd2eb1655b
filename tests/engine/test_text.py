"""Pure text transformers: Utf8Assembler, StopMatcher, SequenceText."""

from __future__ import annotations

import pytest

from sluice.core.events import TokenLogprob
from sluice.engine.text import SequenceText, StopMatcher, Utf8Assembler

CHARS = ["é", "€", "😀"]  # 2-, 3- and 4-byte UTF-8


def splits(data: bytes) -> list[list[bytes]]:
    """Every way to cut ``data`` into two pieces, plus byte-by-byte."""
    out = [[data[:i], data[i:]] for i in range(1, len(data))]
    out.append([bytes([b]) for b in data])
    return out


def lp(i: int) -> TokenLogprob:
    return TokenLogprob(f"t{i}", 1000 + i, -0.1 * i, ())


def run(
    stops: tuple[str, ...], pieces: list[bytes], *, logprobs: bool = False, end: bool = True
) -> tuple[str, str | None, int, int]:
    """Feed pieces like the engine does; returns (text, stop, tokens released, logprobs released)."""
    seq = SequenceText(stops, logprobs)
    text, tokens, n_lps, stop = "", 0, 0, None
    for i, piece in enumerate(pieces):
        ready, stop = seq.feed_token(piece, lp(i) if logprobs else None)
        if ready is not None:
            text += ready.text
            tokens += ready.tokens
            n_lps += len(ready.logprobs or [])
        if stop is not None:
            break
    if stop is None and end:
        ready = seq.flush()
        if ready is not None:
            text += ready.text
            tokens += ready.tokens
            n_lps += len(ready.logprobs or [])
    return text, stop, tokens, n_lps


# -- Utf8Assembler ------------------------------------------------------------------


@pytest.mark.parametrize("char", CHARS)
def test_utf8_assembler_every_split(char: str) -> None:
    data = f"a{char}b".encode()
    for pieces in splits(data):
        asm = Utf8Assembler()
        outs = [asm.feed(p) for p in pieces]
        assert "".join(outs) + asm.flush() == f"a{char}b"
        assert all("\ufffd" not in o for o in outs)


def test_utf8_assembler_holds_incomplete_until_complete() -> None:
    asm = Utf8Assembler()
    assert asm.feed(b"\xf0\x9f") == ""
    assert asm.feed(b"\x98") == ""
    assert asm.feed(b"\x80!") == "😀!"
    assert asm.flush() == ""


def test_utf8_assembler_drops_incomplete_tail_at_the_end() -> None:
    asm = Utf8Assembler()
    assert asm.feed(b"ok\xe2\x82") == "ok"
    assert asm.flush() == ""
    # Invalid bytes in the middle are still replaced: there is no other text for them.
    assert asm.feed(b"a\xffb") == "a\ufffdb"


# -- StopMatcher ----------------------------------------------------------------------


def test_stop_matcher_earliest_wins() -> None:
    m = StopMatcher(("world", "o w", "o"))
    assert m.find("hello world") == (4, "o w")
    m2 = StopMatcher(("world", "lo w"))
    assert m2.find("hello world") == (3, "lo w")
    assert m2.find("nothing here") is None


def test_stop_matcher_holdback_is_longest_proper_prefix_suffix() -> None:
    m = StopMatcher(("abcd", "xy"))
    assert m.holdback("zzabc") == 3
    assert m.holdback("zza") == 1
    assert m.holdback("zzx") == 1
    assert m.holdback("zz") == 0
    assert m.holdback("abcd") == 0  # a complete stop is not a *proper* prefix


def test_stop_matcher_ignores_empty_stops() -> None:
    m = StopMatcher(("", "x"))
    assert m.stops == ("x",)
    assert m.find("abc") is None
    assert StopMatcher(()).holdback("anything") == 0


# -- SequenceText: UTF-8 ---------------------------------------------------------------


@pytest.mark.parametrize("char", CHARS)
@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_sequence_text_split_char_every_position(char: str, stops: tuple[str, ...]) -> None:
    data = f"<{char}>".encode()
    for pieces in splits(data):
        seq = SequenceText(stops, True)
        released = []
        for i, piece in enumerate(pieces):
            ready, stop = seq.feed_token(piece, lp(i))
            assert stop is None
            if ready is not None:
                assert "\ufffd" not in ready.text
                assert ready.logprobs is not None and len(ready.logprobs) == ready.tokens
                released.append(ready)
        tail = seq.flush()
        if tail is not None:
            released.append(tail)
        assert "".join(r.text for r in released) == f"<{char}>"
        assert sum(r.tokens for r in released) == len(pieces)
        assert [x.token for r in released for x in (r.logprobs or [])] == [
            f"t{i}" for i in range(len(pieces))
        ]


def test_sequence_text_incomplete_tail_is_dropped_but_counted() -> None:
    # max_tokens cut a character in half: its bytes are dropped, the token still counts.
    text, stop, tokens, n_lps = run((), [b"ok", b"\xf0\x9f"], logprobs=True)
    assert stop is None
    assert text == "ok"
    assert tokens == 2 and n_lps == 2


def test_sequence_text_incomplete_tail_dropped_with_stops_configured() -> None:
    text, stop, tokens, _ = run(("STOP",), [b"ok", b"\xe2\x82"])
    assert (text, stop, tokens) == ("ok", None, 2)


# -- SequenceText: stop strings ----------------------------------------------------------


@pytest.mark.parametrize(
    "pieces",
    [
        [b"ab", b"<", b"/", b"s", b">", b"cd"],
        [b"ab<", b"/s", b">cd"],
        [b"ab<", b"/", b"s>", b"cd"],
        [b"a", b"b", b"<", b"/s>cd"],
    ],
)
def test_stop_spanning_tokens_never_leaks_a_prefix(pieces: list[bytes]) -> None:
    seq = SequenceText(("</s>",), False)
    out = ""
    stop = None
    for piece in pieces:
        ready, stop = seq.feed_token(piece, None)
        if ready is not None:
            out += ready.text
        assert "<" not in out, f"prefix of the stop leaked: {out!r}"
        if stop is not None:
            break
    assert stop == "</s>"
    assert out == "ab"


def test_partial_stop_flushed_when_stop_never_completes() -> None:
    text, stop, tokens, _ = run(("xyz",), [b"ab", b"x"])
    assert (text, stop, tokens) == ("abx", None, 2)
    text, stop, tokens, _ = run(("xyz",), [b"ab", b"xy"])
    assert (text, stop, tokens) == ("abxy", None, 2)


def test_partial_stop_released_when_it_diverges() -> None:
    seq = SequenceText(("xyz",), False)
    ready, _ = seq.feed_token(b"ab", None)
    assert ready is not None and ready.text == "ab"
    ready, _ = seq.feed_token(b"xy", None)
    assert ready is None  # could still be "xyz"
    ready, stop = seq.feed_token(b"q", None)
    assert stop is None and ready is not None and ready.text == "xyq" and ready.tokens == 2


def test_stop_inside_one_token_cuts_it() -> None:
    text, stop, tokens, _ = run(("STOP",), [b"ab", b"cdSTOPef", b"never"])
    assert (text, stop) == ("abcd", "STOP")
    assert tokens == 2


def test_stop_at_very_start_releases_nothing() -> None:
    text, stop, tokens, _ = run(("\n\n",), [b"\n", b"\nrest"])
    assert (text, stop, tokens) == ("", "\n\n", 0)


def test_earliest_of_several_stops_wins() -> None:
    # "ND" completes first in the last piece's text, but "END" starts earlier.
    text, stop, _, _ = run(("ND", "END"), [b"aEN", b"D"])
    assert (text, stop) == ("a", "END")
    text, stop, _, _ = run(("w", "x", "y", "z"), [b"abcz", b"y"])
    assert (text, stop) == ("abc", "z")


def test_stop_with_multibyte_characters() -> None:
    text, stop, _, _ = run(("€!",), [b"a\xe2", b"\x82\xac", b"!b"])
    assert (text, stop) == ("a", "€!")
    text, stop, _, _ = run(("€!",), [b"a\xe2", b"\x82\xac", b"?"])
    assert (text, stop) == ("a€?", None)


def test_logprobs_one_per_token_with_holdback() -> None:
    text, stop, tokens, n_lps = run(("xyz",), [b"a", b"x", b"y", b"b"], logprobs=True)
    assert (text, stop, tokens, n_lps) == ("axyb", None, 4, 4)
    # A stop cut keeps the straddling token's logprob but drops what follows.
    text, stop, tokens, n_lps = run(("xyz",), [b"a", b"bxy", b"zc"], logprobs=True)
    assert (text, stop, tokens, n_lps) == ("ab", "xyz", 2, 2)


def test_no_logprobs_when_not_asked() -> None:
    seq = SequenceText((), False)
    ready, _ = seq.feed_token(b"a", lp(0))
    assert ready is not None and ready.logprobs is None


def test_flush_on_empty_is_none() -> None:
    assert SequenceText(("x",), False).flush() is None
    seq = SequenceText((), False)
    seq.feed_token(b"abc", None)
    assert seq.flush() is None
