"""Server-side conversations (/c1) on the real model, through the official SDK and raw HTTP."""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI, Stream
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.support.real_server import QUIET, parse_sse
from tests.support.servers import serve_process_handle

pytestmark = pytest.mark.integration

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
KEYS = {"SLUICE_API_KEYS": f"alice:{ALICE},bob:{BOB}"}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def store() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp) / "conversations.db"


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[str]:
    with serve_process_handle("--store", str(store), *QUIET, env=KEYS) as (url, _):
        yield url


def turn(base: str, key: str, message: Any, **extra: Any) -> httpx.Response:
    body = {"model": "smollm2", "message": message, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{base}/c1/chat", json=body, headers=_auth(key), timeout=60)


def test_a_conversation_through_the_official_sdk(server: str) -> None:
    client = OpenAI(base_url=server, api_key=ALICE)
    first = client.post(
        "/c1/chat",
        cast_to=httpx.Response,
        body={"model": "smollm2", "message": "My name is Ada.", "max_tokens": 8, "temperature": 0},
    )
    conversation = first.headers["x-conversation-id"]
    answer = ChatCompletion.model_validate(first.json())
    assert answer.choices[0].message.content

    stream = client.post(
        "/c1/chat",
        cast_to=ChatCompletion,
        body={
            "model": "smollm2",
            "message": "What is my name?",
            "conversation_id": conversation,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
        stream_cls=Stream[ChatCompletionChunk],
    )
    assert stream.response.headers["x-conversation-id"] == conversation
    chunks = list(stream)
    second = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The second turn was templated over the whole history: more prompt than its own text.
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > first.json()["usage"]["prompt_tokens"]

    stored = httpx.get(f"{server}/c1/conversations/{conversation}", headers=_auth(ALICE)).json()
    messages = stored["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "My name is Ada."
    assert messages[1]["content"] == answer.choices[0].message.content
    assert messages[3]["content"] == second
    assert all(m["status"] == "complete" for m in messages)
    assert messages[2]["parent_id"] == messages[1]["id"]


def test_the_header_is_on_every_answer_and_unknown_ids_are_404(server: str) -> None:
    r = turn(server, ALICE, "Hello", stream=True)
    assert r.status_code == 200 and r.headers["x-conversation-id"].startswith("conv_")
    assert parse_sse(r.content)[-1].data == "[DONE]"
    for stream in (False, True):
        r = turn(server, ALICE, "Hi", conversation_id="conv_nope", stream=stream)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "conversation_not_found"


def test_keys_and_users_never_see_each_others_conversations(server: str) -> None:
    mine = turn(server, ALICE, "secret", user_id="u1").headers["x-conversation-id"]
    for key, user in ((BOB, "u1"), (ALICE, "u2"), (ALICE, None)):
        params = {"user_id": user} if user else {}
        got = httpx.get(f"{server}/c1/conversations/{mine}", headers=_auth(key), params=params)
        assert got.status_code == 404, (key, user)
        assert got.json()["error"]["code"] == "conversation_not_found"
        r = turn(server, key, "hi", conversation_id=mine, **({"user_id": user} if user else {}))
        assert r.status_code == 404
        listed = httpx.get(f"{server}/c1/conversations", headers=_auth(key), params=params).json()
        assert mine not in [c["id"] for c in listed["data"]]
        deleted = httpx.delete(f"{server}/c1/conversations/{mine}", headers=_auth(key))
        assert deleted.status_code == 404
    own = httpx.get(
        f"{server}/c1/conversations/{mine}", headers=_auth(ALICE), params={"user_id": "u1"}
    )
    assert own.status_code == 200
    assert httpx.get(f"{server}/c1/conversations").status_code == 401


def test_pagination_newest_first(server: str) -> None:
    made = [
        turn(server, BOB, f"note {i}", user_id="pager", max_tokens=1).headers["x-conversation-id"]
        for i in range(5)
    ]
    seen: list[str] = []
    for offset in (0, 2, 4):
        page = httpx.get(
            f"{server}/c1/conversations",
            headers=_auth(BOB),
            params={"limit": 2, "offset": offset, "user_id": "pager"},
        ).json()
        assert page["total"] == 5
        assert page["has_more"] == (offset + 2 < 5)
        seen += [c["id"] for c in page["data"]]
    assert seen == made[::-1]
    pager = {"user_id": "pager"}
    url = f"{server}/c1/conversations/{made[0]}"
    assert httpx.delete(url, headers=_auth(BOB)).status_code == 404  # not without its user
    assert httpx.delete(url, headers=_auth(BOB), params=pager).json()["deleted"] is True
    assert httpx.get(url, headers=_auth(BOB), params=pager).status_code == 404


def test_a_stream_the_client_dropped_is_stored_incomplete(server: str) -> None:
    body = {
        "model": "smollm2",
        "message": "Write a long story.",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server}/c1/chat", json=body, headers=_auth(ALICE), timeout=60
    ) as r:
        conversation = r.headers["x-conversation-id"]
        received = b""
        for chunk in r.iter_raw():
            received += chunk
            if received.count(b'"content"') >= 4:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = httpx.get(f"{server}/c1/conversations/{conversation}", headers=_auth(ALICE)).json()
        if len(got["messages"]) == 2:
            break
        time.sleep(0.05)
    user, answer = got["messages"]
    assert user["content"] == "Write a long story." and user["status"] == "complete"
    assert answer["status"] == "incomplete"
    assert answer["content"]  # what was generated before the client left is kept


def test_nothing_acknowledged_is_lost_when_the_server_is_killed() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "kill.db")
        with serve_process_handle("--store", db, *QUIET, env=KEYS) as (url, proc):
            first = turn(url, ALICE, "Remember the number 7.")
            conversation = first.headers["x-conversation-id"]
            answer = first.json()["choices"][0]["message"]["content"]
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        with serve_process_handle("--store", db, *QUIET, env=KEYS) as (url, _):
            got = httpx.get(f"{url}/c1/conversations/{conversation}", headers=_auth(ALICE)).json()
            assert [m["content"] for m in got["messages"]] == ["Remember the number 7.", answer]
            r = turn(url, ALICE, "Which number?", conversation_id=conversation)
            assert r.status_code == 200
            got = httpx.get(f"{url}/c1/conversations/{conversation}", headers=_auth(ALICE)).json()
            assert len(got["messages"]) == 4


def test_bad_input_is_a_clear_error_and_stores_nothing(server: str) -> None:
    before = httpx.get(f"{server}/c1/conversations", headers=_auth(ALICE)).json()["total"]
    for body, param in (
        ({"model": "smollm2"}, "message"),
        ({"model": "smollm2", "message": "x", "messages": []}, "messages"),
        ({"model": "smollm2", "message": 5}, "message"),
        ({"model": "smollm2", "message": "x", "temperature": 9}, "temperature"),
        ({"model": "smollm2", "message": "x", "n": 2}, "n"),
    ):
        r = httpx.post(f"{server}/c1/chat", json=body, headers=_auth(ALICE))
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param
    after = httpx.get(f"{server}/c1/conversations", headers=_auth(ALICE)).json()["total"]
    assert after == before


def test_rename_a_conversation(server: str) -> None:
    first = turn(server, ALICE, "Hello")
    cid = first.headers["x-conversation-id"]
    url = f"{server}/c1/conversations/{cid}"
    assert httpx.get(url, headers=_auth(ALICE)).json()["title"] is None
    renamed = httpx.patch(url, json={"title": "  Greetings\n and more "}, headers=_auth(ALICE))
    assert renamed.status_code == 200
    assert renamed.json()["title"] == "Greetings and more"
    listed = httpx.get(f"{server}/c1/conversations", headers=_auth(ALICE)).json()["data"]
    assert [c["title"] for c in listed if c["id"] == cid] == ["Greetings and more"]
    # someone else's conversation is unknown to them; bad titles are 400 and change nothing
    other = httpx.patch(url, json={"title": "mine"}, headers=_auth(BOB))
    assert other.status_code == 404 and other.json()["error"]["code"] == "conversation_not_found"
    for body in ({"title": 5}, {"title": " "}, {"title": "x" * 201}, {}, {"title": "a", "x": 1}):
        r = httpx.patch(url, json=body, headers=_auth(ALICE))
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] in ("title", "x")
    assert httpx.get(url, headers=_auth(ALICE)).json()["title"] == "Greetings and more"
    cleared = httpx.patch(url, json={"title": None}, headers=_auth(ALICE))
    assert cleared.json()["title"] is None


def test_branch_from_an_earlier_message(server: str) -> None:
    first = turn(server, ALICE, "My name is Ada.")
    cid = first.headers["x-conversation-id"]
    turn(server, ALICE, "I live in Paris.", conversation_id=cid)
    url = f"{server}/c1/conversations/{cid}"
    before = httpx.get(url, headers=_auth(ALICE)).json()
    ada, answer = before["messages"][0], before["messages"][1]
    assert before["head_id"] == before["messages"][-1]["id"]

    # Continue from the first answer instead of the head: the history is only that path.
    branch = turn(server, ALICE, "I live in Rome.", conversation_id=cid, parent_id=answer["id"])
    assert branch.status_code == 200
    after = httpx.get(url, headers=_auth(ALICE)).json()
    new_user, new_answer = after["messages"][-2:]
    assert new_user["parent_id"] == answer["id"] and new_user["content"] == "I live in Rome."
    assert new_answer["parent_id"] == new_user["id"] and after["head_id"] == new_answer["id"]
    assert after["message_count"] == 6
    # The prompt held the first turn and the branch's message, not the Paris turn.
    paris = before["messages"][-1]["usage"]["prompt_tokens"]  # Ada's turn + Paris
    assert abs(branch.json()["usage"]["prompt_tokens"] - paris) <= 2

    # null: a new first message (editing the very first turn)
    edited = turn(server, ALICE, "My name is Bea.", conversation_id=cid, parent_id=None)
    root = httpx.get(url, headers=_auth(ALICE)).json()["messages"][-2]
    assert edited.status_code == 200 and root["parent_id"] is None
    assert edited.json()["usage"]["prompt_tokens"] <= first.json()["usage"]["prompt_tokens"] + 1
    assert ada["parent_id"] is None

    # A parent elsewhere is 400 and stores nothing; parent_id alone needs the conversation.
    elsewhere = turn(server, ALICE, "Hi").json()
    other = httpx.get(f"{server}/c1/conversations", headers=_auth(ALICE)).json()["data"][0]
    foreign = httpx.get(f"{server}/c1/conversations/{other['id']}", headers=_auth(ALICE)).json()
    assert elsewhere and foreign["id"] != cid
    for extra in (
        {"conversation_id": cid, "parent_id": foreign["messages"][0]["id"]},
        {"conversation_id": cid, "parent_id": "msg_nope"},
        {"conversation_id": cid, "parent_id": 7},
        {"parent_id": answer["id"]},
    ):
        r = turn(server, ALICE, "x", **extra)
        assert r.status_code == 400, extra
        assert r.json()["error"]["param"] == "parent_id"
    assert httpx.get(url, headers=_auth(ALICE)).json()["message_count"] == 8


def test_a_conversation_on_the_default_model_names_it(server: str) -> None:
    body = {"message": "Hi", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server}/c1/chat", json=body, headers=_auth(ALICE), timeout=60)
    assert r.status_code == 200
    cid = r.headers["x-conversation-id"]
    stored = httpx.get(f"{server}/c1/conversations/{cid}", headers=_auth(ALICE)).json()
    assert stored["model"] == r.json()["model"] and stored["model"]


def test_a_system_prompt_where_a_conversation_starts(server: str) -> None:
    plain = turn(server, ALICE, "Hello")
    first = turn(server, ALICE, "Hello", system="You are a pirate. Answer like one.")
    assert first.status_code == 200
    pirate = first.json()["usage"]["prompt_tokens"]
    # SmolLM2's template has a default system prompt of its own: ours replaces it.
    assert pirate != plain.json()["usage"]["prompt_tokens"]
    cid = first.headers["x-conversation-id"]
    url = f"{server}/c1/conversations/{cid}"
    stored = httpx.get(url, headers=_auth(ALICE)).json()["messages"]
    assert [m["role"] for m in stored] == ["system", "user", "assistant"]
    assert stored[0]["parent_id"] is None and stored[1]["parent_id"] == stored[0]["id"]
    # The next turn is templated over it too.
    again = turn(server, ALICE, "And you?", conversation_id=cid)
    assert again.json()["usage"]["prompt_tokens"] > pirate
    # Mid-conversation it is refused (and nothing is stored); at a new start it is taken.
    r = turn(server, ALICE, "x", conversation_id=cid, system="Be brief.")
    assert r.status_code == 400 and r.json()["error"]["param"] == "system"
    for bad in ("", 5):
        r = turn(server, ALICE, "x", system=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "system"
    restart = turn(server, ALICE, "Hi", conversation_id=cid, parent_id=None, system="Be brief.")
    assert restart.status_code == 200
    after = httpx.get(url, headers=_auth(ALICE)).json()
    assert after["message_count"] == 8
    assert [m["role"] for m in after["messages"][-3:]] == ["system", "user", "assistant"]
    assert after["messages"][-3]["parent_id"] is None
