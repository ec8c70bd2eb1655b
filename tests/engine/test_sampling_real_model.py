"""Every documented sampling field, sent to the real engine on both endpoints.

Each test checks an effect that would vanish if the field were dropped or
mishandled (not just a 200): greedy equivalences (``top_k`` 1, ``min_p`` 1,
``top_p`` 1e-6 at a high temperature), penalties that break a repeating greedy
continuation, ``repeat_last_n`` windows, seeds, ``logit_bias``, ``stop``,
``n``, ``ignore_eos``, the token limits and the logprobs options. Every request
that carries the field under test is sent streamed and not, and the streamed
text (and logprobs) reassembled must equal the non-streamed answer. Then each
field at its documented bounds is a 200 and just outside them a 400 naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest

from tests.support.real_server import data_chunks, parse_sse, wait_idle

pytestmark = pytest.mark.integration

KINDS = ("chat", "text")
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}

# Prompts, per endpoint, chosen on SmolLM2-135M-Instruct for what their greedy output does.
PLAIN = {  # greedy runs past 6 tokens without repeating itself
    "chat": "Tell me a story.",
    "text": "Once upon a time",
}
REPEATING = {  # greedy repeats itself: strong positive penalties must break it
    "chat": "Count from 1 to 20.",
    "text": "I love you. I love you. I love",
}
COPYING = {  # greedy does not repeat: negative penalties make it repeat
    "chat": "What is 2+2?",
    "text": "Once upon a time",
}
ENDING = {  # greedy ends (EOS) within a few tokens
    "chat": "Is the sky blue? Answer yes or no.",
    "text": "What is 2+2?",
}
FILLER = (
    "The weather today is sunny with a light breeze from the west, and the market downtown "
    "opens at nine in the morning. Farmers bring apples, pears, bread, cheese and honey; "
    "children run between the stalls while musicians play old songs near the fountain. In "
    "the afternoon the square fills with tourists who photograph the cathedral, buy postcards "
    "and rest in the shade of tall plane trees."
)
FAR_BACK = {  # the phrase greedy repeats is more than 64 tokens before the end of the prompt
    "chat": "Say 'I love you' five times.\n" + FILLER + "\nNow say it.",
    "text": "I love you. I love you.\n" + FILLER + "\nI love",
}
# A prompt, the id and text of its greedy first token (the id is checked against the server).
FIRST_TOKEN = {"chat": ("Hi", 19556, "Hello"), "text": ("Once upon a time", 28, ",")}
THE = (260, " the")  # a token to force with a +100 bias


# -- requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class Out:
    """A response reduced to what streamed and non-streamed answers must share."""

    texts: tuple[str, ...]
    finish: tuple[str, ...]
    completion_tokens: int
    logprobs: tuple[Any, ...]

    @property
    def text(self) -> str:
        assert len(self.texts) == 1, self.texts
        return self.texts[0]


def request_body(kind: str, prompt: str, **fields: Any) -> dict[str, Any]:
    if kind == "chat":
        return {"messages": [{"role": "user", "content": prompt}], **fields}
    return {"prompt": prompt, **fields}


def post(srv: httpx.Client, kind: str, body: dict[str, Any]) -> httpx.Response:
    return srv.post(PATHS[kind], json=body)


def complete(srv: httpx.Client, kind: str, body: dict[str, Any]) -> Out:
    r = post(srv, kind, {**body, "stream": False})
    assert r.status_code == 200, r.text
    data = r.json()
    choices = sorted(data["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(choices)))
    if kind == "chat":
        texts = tuple(c["message"]["content"] or "" for c in choices)
        lps = tuple(c["logprobs"] and c["logprobs"]["content"] for c in choices)
    else:
        texts = tuple(c["text"] for c in choices)
        lps = tuple(c["logprobs"] for c in choices)
    finish = tuple(c["finish_reason"] for c in choices)
    return Out(texts, finish, data["usage"]["completion_tokens"], lps)


def stream(srv: httpx.Client, kind: str, body: dict[str, Any]) -> Out:
    """The same request streamed, its chunks reassembled per choice."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = post(srv, kind, body)
    assert r.status_code == 200, r.text
    chunks = data_chunks(parse_sse(r.content))
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    lps: dict[int, Any] = {}
    for chunk in chunks[:-1]:
        for c in chunk["choices"]:
            i = c["index"]
            texts.setdefault(i, "")
            if c["finish_reason"] is not None:
                assert i not in finish, f"choice {i} finished twice"
                finish[i] = c["finish_reason"]
            lp = c["logprobs"]
            if kind == "chat":
                texts[i] += c["delta"].get("content") or ""
                if lp is not None:
                    lps.setdefault(i, []).extend(lp["content"])
            else:
                texts[i] += c["text"]
                if lp is not None:
                    acc = lps.setdefault(i, {k: [] for k in lp})
                    for k, v in lp.items():
                        acc[k].extend(v)
    n = len(texts)
    assert sorted(texts) == list(range(n)) and sorted(finish) == list(range(n))
    return Out(
        tuple(texts[i] for i in range(n)),
        tuple(finish[i] for i in range(n)),
        usage["completion_tokens"],
        tuple(lps.get(i) for i in range(n)),
    )


def both(srv: httpx.Client, kind: str, body: dict[str, Any]) -> Out:
    """Non-streamed and streamed; the two must agree. Returns the answer."""
    whole = complete(srv, kind, body)
    streamed = stream(srv, kind, body)
    assert streamed == whole, f"streamed != non-streamed for {body}"
    return whole


def greedy(srv: httpx.Client, kind: str, prompt: str, max_tokens: int = 6) -> Out:
    """The plain greedy answer (temperature 0, no other field), on a primed prompt cache.

    llama.cpp's logits differ slightly with how the prompt was prefilled (all at once,
    or after a cached prefix): enough to flip near-ties. A test's first request for a
    prompt may prefill it whole; every later one reuses it (all but its last token)
    from the same slot. So each test calls this first, and a one-token request before
    the baseline puts every compared request in that second, identical regime.
    """
    prime = request_body(kind, prompt, max_tokens=1, temperature=0)
    complete(srv, kind, prime)
    return complete(srv, kind, request_body(kind, prompt, max_tokens=max_tokens, temperature=0))


def repeats(text: str) -> int:
    """How many words, punctuation marks and newlines repeat an earlier one."""
    units = re.findall(r"\w+|[^\w ]", text)
    return len(units) - len(set(units))


@pytest.fixture(scope="module")
def http(base: str) -> Iterator[httpx.Client]:
    # One client for the module: a new httpx client per request costs more CPU than a
    # one-token generation.
    with httpx.Client(base_url=base, timeout=120) as client:
        yield client


@pytest.fixture
def srv(base: str, http: httpx.Client) -> httpx.Client:
    """The session server, idle, through the module's client."""
    wait_idle(base, within=10)
    return http


# -- temperature, top_k, top_p, min_p, seed ---------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_temperature_zero_is_greedy_and_two_is_not(srv: httpx.Client, kind: str) -> None:
    g = greedy(srv, kind, PLAIN[kind])

    def run(temperature: float, seed: int, how: Any = complete) -> Out:
        body = request_body(kind, PLAIN[kind], max_tokens=6, temperature=temperature, seed=seed)
        return how(srv, kind, body)  # type: ignore[no-any-return]

    # temperature 0 ignores the seed: every seed gives the greedy text
    assert run(0, 1, both).text == g.text
    assert run(0, 2).text == g.text
    hot = run(2, 1, both)
    assert hot.text != g.text
    assert hot.text != run(1, 1).text, "temperature 2 sampled exactly as temperature 1"


@pytest.mark.parametrize("kind", KINDS)
def test_seed_reproduces_and_different_seeds_differ(srv: httpx.Client, kind: str) -> None:
    greedy(srv, kind, PLAIN[kind])

    def run(seed: int, how: Any = complete) -> str:
        body = request_body(kind, PLAIN[kind], max_tokens=6, temperature=1, seed=seed)
        return str(how(srv, kind, body).text)

    first = run(11, both)
    assert run(11) == first
    others = {run(12), run(13)}
    assert others != {first}, "three seeds drew the same text"


@pytest.mark.parametrize("kind", KINDS)
def test_truncation_to_one_token_is_greedy(srv: httpx.Client, kind: str) -> None:
    """At temperature 1.5, top_k 1, top_p 1e-6 and min_p 1 keep only the top token: greedy."""
    g = greedy(srv, kind, PLAIN[kind])
    bounds = [("top_k", 1, 0), ("top_p", 1e-6, 1.0), ("min_p", 1.0, 0.0)]
    # Every truncation explicitly off (left out, each would take the model's default).
    off = {field: wide for field, _narrow, wide in bounds}
    hot = request_body(kind, PLAIN[kind], max_tokens=6, temperature=1.5, seed=5, **off)
    free = complete(srv, kind, hot)
    assert free.text != g.text, "precondition: this seed at 1.5 does not sample greedy"
    for field, narrow, _wide in bounds:
        assert both(srv, kind, {**hot, field: narrow}).text == g.text, field
    # Left out, the fields take the defaults (top-k 40, top-p 0.95, min-p 0.05): not
    # the sample over the whole vocabulary.
    defaulted = {k: v for k, v in hot.items() if k not in off}
    assert complete(srv, kind, defaulted) != free


# -- penalties --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_positive_penalties_break_a_repeating_greedy_output(srv: httpx.Client, kind: str) -> None:
    g = greedy(srv, kind, REPEATING[kind], 10)
    assert repeats(g.text) >= 4, f"precondition: greedy repeats itself: {g.text!r}"
    body = request_body(kind, REPEATING[kind], max_tokens=10, temperature=0)
    warm = request_body(kind, REPEATING[kind], max_tokens=6, temperature=1, seed=3)
    free = complete(srv, kind, warm)
    for field, value in [
        ("repeat_penalty", 1.5),
        ("presence_penalty", 2),
        ("frequency_penalty", 2),
    ]:
        out = both(srv, kind, {**body, field: value})
        assert repeats(out.text) < repeats(g.text), (field, g.text, out.text)
        # and when sampling (another chain): the same seed draws another text
        assert complete(srv, kind, {**warm, field: value}).text != free.text, field


@pytest.mark.parametrize("kind", KINDS)
def test_negative_penalties_make_greedy_repeat(srv: httpx.Client, kind: str) -> None:
    g = greedy(srv, kind, COPYING[kind], 10)
    body = request_body(kind, COPYING[kind], max_tokens=10, temperature=0)
    for field in ("presence_penalty", "frequency_penalty"):
        out = both(srv, kind, {**body, field: -2})
        assert repeats(out.text) > repeats(g.text), (field, g.text, out.text)
        positive = complete(srv, kind, {**body, field: 2}).text
        assert out.text != positive, f"{field} -2 penalised like +2"


@pytest.mark.parametrize("kind", KINDS)
def test_repeat_last_n_zero_turns_penalties_off(srv: httpx.Client, kind: str) -> None:
    g = greedy(srv, kind, REPEATING[kind], 10)
    penalties = {"repeat_penalty": 1.5, "presence_penalty": 2, "frequency_penalty": 2}
    body = request_body(kind, REPEATING[kind], max_tokens=10, temperature=0, **penalties)
    # (each of these penalties alone changes this output: the test above)
    assert both(srv, kind, {**body, "repeat_last_n": 0}).text == g.text


@pytest.mark.parametrize("kind", KINDS)
def test_repeat_last_n_window(srv: httpx.Client, kind: str) -> None:
    """-1 is the whole context (the server's --ctx 2048), n the last n tokens, 64 the default."""
    g = greedy(srv, kind, FAR_BACK[kind], 8)
    body = request_body(kind, FAR_BACK[kind], max_tokens=8, temperature=0, repeat_penalty=1.5)

    def window(n: int) -> str:
        return complete(srv, kind, {**body, "repeat_last_n": n}).text

    default = complete(srv, kind, body).text
    whole = both(srv, kind, {**body, "repeat_last_n": -1}).text
    assert default != g.text
    assert window(64) == default
    assert whole == window(2048)
    assert whole != default, "-1 must reach the phrase more than 64 tokens back"
    assert window(16) != default


# -- logit_bias -------------------------------------------------------------------------


def token_text(srv: httpx.Client, token: int) -> str:
    """The text of one token id, through a token-id prompt echoed back."""
    body = {"prompt": [token], "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    out = complete(srv, "text", body)
    return str(out.logprobs[0]["tokens"][0])


@pytest.mark.parametrize("kind", KINDS)
def test_logit_bias_minus_100_bans_the_greedy_first_token(srv: httpx.Client, kind: str) -> None:
    prompt, token, piece = FIRST_TOKEN[kind]
    assert token_text(srv, token) == piece
    g = greedy(srv, kind, prompt)
    assert g.text.startswith(piece), "precondition: greedy starts with this token"
    lp = {"logprobs": True} if kind == "chat" else {"logprobs": 0}
    body = request_body(kind, prompt, max_tokens=6, temperature=0, **lp)
    out = both(srv, kind, {**body, "logit_bias": {str(token): -100}})
    first = out.logprobs[0][0]["token"] if kind == "chat" else out.logprobs[0]["tokens"][0]
    assert first != piece
    assert out.text != g.text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0, 1])
def test_logit_bias_plus_100_forces_a_token(
    srv: httpx.Client, kind: str, temperature: float
) -> None:
    token, piece = THE
    assert token_text(srv, token) == piece
    greedy(srv, kind, PLAIN[kind])
    body = request_body(
        kind, PLAIN[kind], max_tokens=6, temperature=temperature, seed=1, ignore_eos=True
    )
    assert complete(srv, kind, body).text != piece * 6
    assert both(srv, kind, {**body, "logit_bias": {str(token): 100}}).text == piece * 6


# -- stop, n, ignore_eos, token limits ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_stop_cuts_before_the_stop_string(srv: httpx.Client, kind: str) -> None:
    g = greedy(srv, kind, PLAIN[kind])
    assert g.finish == ("length",)
    # three characters from the middle of the greedy text, wherever its tokens split
    mid = len(g.text) // 2
    stop = g.text[mid : mid + 3]
    expected = g.text[: g.text.index(stop)]
    body = request_body(kind, PLAIN[kind], max_tokens=6, temperature=0)
    out = both(srv, kind, {**body, "stop": stop})
    assert (out.text, out.finish) == (expected, ("stop",))
    assert out.completion_tokens < 6
    # up to four; the earliest match wins
    out = both(srv, kind, {**body, "stop": ["\u2603never", g.text[-3:], stop, "\u2603nor"]})
    assert (out.text, out.finish) == (expected, ("stop",))


@pytest.mark.parametrize("kind", KINDS)
def test_n_gives_n_choices(srv: httpx.Client, kind: str) -> None:
    body = request_body(kind, PLAIN[kind], temperature=1, seed=7, n=3, ignore_eos=True)
    complete(srv, kind, {**body, "max_tokens": 1})  # the prompt cached in three slots
    out = both(srv, kind, {**body, "max_tokens": 6})
    assert len(out.texts) == 3
    assert out.finish == ("length",) * 3
    assert out.completion_tokens == 18
    assert len(set(out.texts)) > 1, out.texts


@pytest.mark.parametrize("kind", KINDS)
def test_ignore_eos_generates_exactly_max_tokens(srv: httpx.Client, kind: str) -> None:
    g = greedy(srv, kind, ENDING[kind], 10)
    assert g.finish == ("stop",) and g.completion_tokens < 10, "precondition: greedy ends early"
    body = request_body(kind, ENDING[kind], max_tokens=10, temperature=0)
    out = both(srv, kind, {**body, "ignore_eos": True})
    assert (out.completion_tokens, out.finish) == (10, ("length",))
    assert out.text.startswith(g.text) and len(out.text) > len(g.text)
    assert complete(srv, kind, {**body, "ignore_eos": False}) == g


@pytest.mark.parametrize(
    ("kind", "limits", "n_tokens"),
    [
        ("text", {"max_tokens": 5}, 5),
        ("chat", {"max_tokens": 5}, 5),
        ("chat", {"max_completion_tokens": 3}, 3),
        ("chat", {"max_tokens": 7, "max_completion_tokens": 3}, 3),  # the newer name wins
        ("text", {"max_tokens": 1}, 1),
    ],
)
def test_token_limit(srv: httpx.Client, kind: str, limits: dict[str, int], n_tokens: int) -> None:
    g = greedy(srv, kind, PLAIN[kind])
    assert g.finish == ("length",), "precondition: greedy runs past the limits"
    out = both(srv, kind, request_body(kind, PLAIN[kind], temperature=0, **limits))
    assert (out.completion_tokens, out.finish) == (n_tokens, ("length",))
    assert out.text and g.text.startswith(out.text)


# -- logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("top", [0, 3, 20])
def test_chat_logprobs_and_top_logprobs(srv: httpx.Client, top: int) -> None:
    g = greedy(srv, "chat", PLAIN["chat"], 6)
    assert g.logprobs == (None,)
    body = request_body("chat", PLAIN["chat"], max_tokens=6, temperature=0)
    out = both(srv, "chat", {**body, "logprobs": True, "top_logprobs": top})
    assert out.text == g.text
    entries = out.logprobs[0]
    assert len(entries) == out.completion_tokens == 6
    assert "".join(e["token"] for e in entries) == out.text
    for e in entries:
        assert e["logprob"] <= 0
        assert len(e["top_logprobs"]) == top
        values = [t["logprob"] for t in e["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        if top:  # greedy: the chosen token is the most likely one
            assert e["top_logprobs"][0]["token"] == e["token"]


@pytest.mark.parametrize("top", [0, 2, 20])
def test_text_logprobs(srv: httpx.Client, top: int) -> None:
    g = greedy(srv, "text", PLAIN["text"], 6)
    assert g.logprobs == (None,)
    body = request_body("text", PLAIN["text"], max_tokens=6, temperature=0)
    out = both(srv, "text", {**body, "logprobs": top})
    assert out.text == g.text
    lp = out.logprobs[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == out.completion_tokens == 6
    assert "".join(lp["tokens"]) == out.text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(6)]
    rows = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    for token, logprob, tops in rows:
        assert logprob <= 0
        assert len(tops) == top
        if top:  # greedy: the chosen token is the most likely one
            assert max(tops, key=tops.get) == token and tops[token] == logprob


def test_text_echo(srv: httpx.Client) -> None:
    prompt = PLAIN["text"]
    g = greedy(srv, "text", prompt)
    out = both(srv, "text", request_body("text", prompt, max_tokens=6, temperature=0, echo=True))
    assert out.text == prompt + g.text
    assert out.completion_tokens == 6
    # with logprobs the prompt's tokens come first, the first one without a logprob
    body = request_body("text", prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    out = both(srv, "text", body)
    lp = out.logprobs[0]
    assert out.completion_tokens == 4
    assert "".join(lp["tokens"]) == out.text
    n_prompt = len(lp["tokens"]) - 4
    assert "".join(lp["tokens"][:n_prompt]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n_prompt] == len(prompt)


# -- bounds -----------------------------------------------------------------------------

COMMON_OK: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 2.0},
    {"top_p": 1e-6},
    {"top_p": 1.0},
    {"top_k": 0},
    {"top_k": 100_000},  # more than the vocabulary
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"repeat_penalty": 1e-6},
    {"repeat_penalty": 10.0},
    {"repeat_last_n": -1},
    {"repeat_last_n": 0},
    {"repeat_last_n": 100_000},  # more than the context
    {"presence_penalty": -2.0},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -2.0},
    {"frequency_penalty": 2.0},
    {"seed": 0},
    {"seed": 2**32 - 1},  # (this and -1 are llama.cpp's "random seed")
    {"seed": -1},
    {"logit_bias": {"0": -100, "49151": 100}},  # first and last token ids, both extremes
    {"stop": ["a", "b", "c", "d"]},
    {"n": 1},
    {"ignore_eos": True},
    {"max_tokens": 1},
]
COMMON_BAD: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -0.01}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"seed": "x"}, "seed"),
    ({"logit_bias": {"28": 100.5}}, "logit_bias"),
    ({"logit_bias": {"28": -100.5}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # one past the last token id
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"the": 1}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"max_tokens": 0}, "max_tokens"),
]
OK = {
    "chat": COMMON_OK
    + [
        {"max_completion_tokens": 1},
        {"logprobs": True, "top_logprobs": 0},
        {"logprobs": True, "top_logprobs": 20},
    ],
    "text": COMMON_OK + [{"logprobs": 0}, {"logprobs": 20}, {"echo": True}],
}
BAD = {
    "chat": COMMON_BAD
    + [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ],
    "text": COMMON_BAD
    + [
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"echo": "maybe"}, "echo"),
    ],
}


def concurrently(calls: list[Any]) -> None:
    """Run independent checks four at a time (the server's four slots)."""
    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(call) for call in calls]:
            f.result()


@pytest.mark.parametrize("kind", KINDS)
def test_bounds_are_accepted(srv: httpx.Client, kind: str) -> None:
    def check(fields: dict[str, Any], streamed: bool) -> None:
        body = request_body(kind, "Hi", **{"max_tokens": 1, **fields})
        out = (stream if streamed else complete)(srv, kind, body)
        n = fields.get("n", 1)
        assert len(out.texts) == n and out.completion_tokens <= n, fields

    concurrently([partial(check, f, s) for f in OK[kind] for s in (False, True)])
    for streamed in (False, True):  # n=16 fills every slot and queues 12
        check({"n": 16}, streamed)


@pytest.mark.parametrize("kind", KINDS)
def test_just_outside_the_bounds_is_400_naming_the_field(srv: httpx.Client, kind: str) -> None:
    def check(fields: dict[str, Any], param: str, streamed: bool) -> None:
        body = request_body(kind, "Hi", **{"max_tokens": 1, "stream": streamed, **fields})
        r = post(srv, kind, body)
        assert r.status_code == 400, (fields, streamed, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param, (fields, err)

    concurrently([partial(check, f, p, s) for f, p in BAD[kind] for s in (False, True)])
