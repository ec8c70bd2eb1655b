"""Two sluice processes on one PostgreSQL database serve as one: a ``/c1`` conversation
started through one continues through the other, a 10-a-minute key gets exactly 10 of
12 requests through when they are spread over both, usage counted on one is read on
the other, and a background response started on one is read, resumed, cancelled and
deleted through the other."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.support.postgres import PostgresServer
from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

ADMIN = "sk-admin-shared-01"
TEN = "sk-ten-shared-0001"
SINGLE = "sk-single-stream-01"
HI = [{"role": "user", "content": "Hi"}]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def pair(
    postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    url = postgres_server.create_database()
    conf: Path = tmp_path_factory.mktemp("shared") / "sluice.toml"
    conf.write_text(
        f'[keys]\nadmin = "{ADMIN}"\nten = {{ key = "{TEN}", rpm = 10 }}\n'
        f'single = {{ key = "{SINGLE}", max_streams = 1 }}\n'
    )
    args = ("--config", str(conf), "--store", url, *QUIET)
    try:
        with serve_process(*args) as one, serve_process(*args) as two:
            yield one, two
    finally:
        postgres_server.drop_database(url)


def turn(base: str, message: str, **extra: object) -> httpx.Response:
    body = {"model": "smollm2", "message": message, "max_tokens": 8, "temperature": 0, **extra}
    answer = httpx.post(f"{base}/c1/chat", json=body, headers=_auth(ADMIN), timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def test_a_conversation_continues_through_the_other_instance(pair: tuple[str, str]) -> None:
    one, two = pair
    first = turn(one, "My name is Ada.")
    conversation = first.headers["x-conversation-id"]
    second = turn(two, "What is my name?", conversation_id=conversation)
    assert second.headers["x-conversation-id"] == conversation
    # Templated over the history the first instance stored: more prompt than its own text.
    assert second.json()["usage"]["prompt_tokens"] > first.json()["usage"]["prompt_tokens"]
    turn(one, "Thanks.", conversation_id=conversation)
    for base in pair:
        stored = httpx.get(f"{base}/c1/conversations/{conversation}", headers=_auth(ADMIN))
        messages = stored.json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        assert messages[2]["content"] == "What is my name?"
        assert messages[2]["parent_id"] == messages[1]["id"]


def test_a_limit_holds_across_both_instances(pair: tuple[str, str]) -> None:
    outcomes = []
    for i in range(12):
        base = pair[i % 2]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=TEN, max_retries=0)
        try:
            client.chat.completions.create(model="smollm2", messages=HI, max_tokens=1)  # type: ignore[arg-type]
            outcomes.append(200)
        except openai.RateLimitError as refused:
            assert refused.code == "rate_limit_exceeded"
            outcomes.append(429)
    assert outcomes.count(200) == 10 and outcomes[-2:] == [429, 429], outcomes


def test_usage_counted_on_one_is_read_on_the_other(pair: tuple[str, str]) -> None:
    one, two = pair
    client = openai.OpenAI(base_url=f"{one}/v1", api_key=ADMIN, max_retries=0)
    answer = client.chat.completions.create(model="smollm2", messages=HI, max_tokens=2)  # type: ignore[arg-type]
    assert answer.usage is not None

    def admin_requests(base: str) -> int:
        got = httpx.get(f"{base}/v1/usage?key=admin", headers=_auth(ADMIN), timeout=10)
        return int(got.json()["totals"]["requests"])

    # The first instance writes its counts within a second; the second reads the database.
    deadline = time.monotonic() + 10
    while admin_requests(two) != admin_requests(one):
        assert time.monotonic() < deadline, "the other instance never saw the usage"
        time.sleep(0.3)
    assert admin_requests(two) >= 1


def test_a_background_response_is_read_from_the_other_instance(pair: tuple[str, str]) -> None:
    one, two = pair
    created = openai.OpenAI(base_url=f"{one}/v1", api_key=ADMIN).responses.create(
        model="smollm2", input="Say hello.", max_output_tokens=8, background=True
    )
    other = openai.OpenAI(base_url=f"{two}/v1", api_key=ADMIN)
    deadline = time.monotonic() + 60
    while (got := other.responses.retrieve(created.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    # (8 tokens: it may stop at its max_output_tokens, "incomplete": an end all the same.)
    assert got.status in ("completed", "incomplete") and got.output_text


STORY = "Tell me a long story about a dragon who learns to bake bread."


def _in_flight(base: str) -> list[str]:
    listed = httpx.get(f"{base}/v1/requests", headers=_auth(ADMIN), timeout=10)
    return [entry["id"] for entry in listed.json()["data"]]


def _wait_generating(base: str, response_id: str) -> None:
    """Until ``response_id`` is generating on the instance at ``base`` (60 s at most)."""
    deadline = time.monotonic() + 60
    while response_id not in _in_flight(base):
        assert time.monotonic() < deadline, "the response never started"
        time.sleep(0.1)


def _story(base: str, key: str = ADMIN) -> Response:
    """A background response of a couple of hundred tokens, started through ``base``."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key).responses.create(
        model="smollm2", input=STORY, max_output_tokens=200, temperature=0, background=True
    )


def _raw_events(base: str, response_id: str) -> bytes:
    url = f"{base}/v1/responses/{response_id}?stream=true&starting_after=-1"
    answer = httpx.get(url, headers=_auth(ADMIN), timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.content


def test_a_background_response_is_resumed_through_the_other_instance(
    pair: tuple[str, str],
) -> None:
    one, two = pair
    created = _story(one)
    other = openai.OpenAI(base_url=f"{two}/v1", api_key=ADMIN)
    # The first few events through the other instance, then the client drops...
    seen: list[int] = []
    with other.responses.retrieve(created.id, stream=True) as first:
        for event in first:
            seen.append(event.sequence_number)
            if len(seen) == 5:
                break
    assert seen == [0, 1, 2, 3, 4]
    # ... and resumes there after the last one it had, while the first still generates.
    kinds = []
    with other.responses.retrieve(created.id, stream=True, starting_after=seen[-1]) as rest:
        for event in rest:
            seen.append(event.sequence_number)
            kinds.append(event.type)
    assert seen == list(range(len(seen))), "sequence numbers skip or repeat"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.count("response.output_text.delta") > 20  # it streamed while generating
    # The same bytes as the instance that ran it sends (its events kept in its memory).
    assert _raw_events(two, created.id) == _raw_events(one, created.id)
    ended = other.responses.retrieve(created.id)
    assert ended.status == kinds[-1].removeprefix("response.") and ended.output_text


def test_a_background_response_is_cancelled_through_the_other_instance(
    pair: tuple[str, str],
) -> None:
    one, two = pair
    created = _story(one)
    _wait_generating(one, created.id)
    started = time.monotonic()
    cancelled = openai.OpenAI(base_url=f"{two}/v1", api_key=ADMIN).responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert time.monotonic() - started < 3, "the running instance noticed too late"
    assert created.id not in _in_flight(one)  # it stopped generating
    for base in pair:
        got = openai.OpenAI(base_url=f"{base}/v1", api_key=ADMIN).responses.retrieve(created.id)
        assert got.status == "cancelled"
    # Its stream through either instance ends with the cancel.
    for base in pair:
        frames = _raw_events(base, created.id).split(b"\n\n")
        assert frames[-2].startswith(b"event: response.cancelled\n")


def test_a_background_response_deleted_through_the_other_instance_stays_deleted(
    pair: tuple[str, str],
) -> None:
    """The running instance stops it first: its end would otherwise store it again."""
    one, two = pair
    created = _story(one)
    _wait_generating(one, created.id)
    deleted = httpx.delete(f"{two}/v1/responses/{created.id}", headers=_auth(ADMIN), timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert created.id not in _in_flight(one)  # it stopped generating
    time.sleep(1.0)  # past the running instance's end, had it gone on
    for base in pair:
        got = httpx.get(f"{base}/v1/responses/{created.id}", headers=_auth(ADMIN), timeout=10)
        assert got.status_code == 404, got.text


def test_streams_at_once_hold_across_the_instances(pair: tuple[str, str]) -> None:
    """A key of one stream at once: its background response running on one instance
    holds it on the other too, until it ends."""
    one, two = pair
    created = _story(one, SINGLE)
    body = {"model": "smollm2", "messages": HI, "max_tokens": 4}
    refused = httpx.post(f"{two}/v1/chat/completions", json=body, headers=_auth(SINGLE), timeout=30)
    assert refused.status_code == 429, refused.text
    assert "across the sluice instances" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    cancelled = openai.OpenAI(base_url=f"{one}/v1", api_key=SINGLE).responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 10
    while True:  # its lease is dropped as it ends
        answer = httpx.post(
            f"{two}/v1/chat/completions", json=body, headers=_auth(SINGLE), timeout=60
        )
        if answer.status_code == 200:
            break
        assert answer.status_code == 429 and time.monotonic() < deadline, answer.text
        time.sleep(0.2)


def test_a_running_background_response_is_read_as_it_stands_through_the_other_instance(
    pair: tuple[str, str],
) -> None:
    """GET through the other instance while it generates: in progress, with the text so
    far (as of the running instance's last write of its events), which the final
    answer then begins with."""
    one, two = pair
    created = _story(one)
    other = openai.OpenAI(base_url=f"{two}/v1", api_key=ADMIN)
    deadline = time.monotonic() + 60
    while True:
        partial = other.responses.retrieve(created.id)
        if partial.status == "in_progress" and partial.output_text:
            break
        assert partial.status in ("queued", "in_progress"), partial.status
        assert time.monotonic() < deadline, "no text through the other instance"
        time.sleep(0.05)
    while (ended := other.responses.retrieve(created.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert ended.status in ("completed", "incomplete")
    assert ended.output_text.startswith(partial.output_text)
    assert len(ended.output_text) > len(partial.output_text)
