"""``sluice chat`` driven in tmux (send-keys, capture-pane) against a real server: a
turn streams and is kept on the server, /reset and multi-line input, Ctrl-C stops
an answer (the server's slot frees, the partial answer is kept), /exit quits, and
/image attaches an image to the next message (a server with the suite's colour-seeing
projector, ``tests/support/projector.py``)."""

from __future__ import annotations

import base64
import itertools
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.projector import colour_projector, solid_png
from tests.support.real_server import QUIET
from tests.support.servers import serve_process

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]
_ids = itertools.count()


def tmux(*args: str) -> str:
    done = subprocess.run(["tmux", *args], capture_output=True, text=True, check=False)
    return done.stdout


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_process("--parallel", "1", "--ctx", "2048", *QUIET) as base:
        yield base


@pytest.fixture(scope="module")
def vision_url() -> Iterator[str]:
    projector = str(colour_projector("smollm2"))
    with serve_process("--mmproj", projector, "--parallel", "1", "--ctx", "2048", *QUIET) as base:
        yield base


class Session:
    def __init__(self, url: str, *extra: str) -> None:
        self.name = f"sluice-chat-{next(_ids)}-{time.monotonic_ns()}"
        cmd = [sys.executable, "-m", "sluice", "chat", "--url", url, *extra]
        tmux("new-session", "-d", "-s", self.name, "-x", "160", "-y", "50", shlex.join(cmd))

    def screen(self) -> str:
        return tmux("capture-pane", "-p", "-J", "-t", self.name, "-S", "-500")

    def keys(self, *keys: str) -> None:
        tmux("send-keys", "-t", self.name, *keys)

    def wait(self, check: Callable[[str], Any], within: float = 60.0) -> str:
        deadline = time.monotonic() + within
        while True:
            text = self.screen()
            if check(text):
                return text
            assert time.monotonic() < deadline, f"not seen in time:\n{text}"
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.name in tmux("list-sessions", "-F", "#{session_name}").split()

    def close(self) -> None:
        tmux("kill-session", "-t", self.name)


def prompts(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith(">>> "))


def conversations(url: str) -> list[dict[str, Any]]:
    data = httpx.get(f"{url}/c1/conversations", timeout=10).json()["data"]
    return [httpx.get(f"{url}/c1/conversations/{c['id']}", timeout=10).json() for c in data]


def test_turns_reset_multiline_and_exit(url: str) -> None:
    before = len(conversations(url))
    s = Session(url, "--max-tokens", "16")
    try:
        s.wait(lambda t: "sluice chat on" in t and prompts(t) == 1)
        s.keys("My name is Ada.", "Enter")
        s.wait(lambda t: prompts(t) == 2)
        s.keys("What is my name?", "Enter")
        s.wait(lambda t: prompts(t) == 3)
        convs = conversations(url)
        assert len(convs) == before + 1
        roles = [m["role"] for m in convs[0]["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]  # one conversation kept
        answer = convs[0]["messages"][1]["content"]
        assert answer and answer.split()[0] in s.screen()  # streamed to the terminal
        # Each answer ends with its figures.
        assert re.search(r"\(\d+ tokens, [0-9.]+ tok/s, first token \d+ ms\)", s.screen())
        s.keys("/reset", "Enter")
        s.wait(lambda t: "(new conversation)" in t)
        s.keys("Line one \\", "Enter")
        s.wait(lambda t: "... " in t)
        s.keys("line two", "Enter")
        s.wait(lambda t: prompts(t) == 5)
        newest = conversations(url)[0]
        assert newest["messages"][0]["content"] == "Line one \nline two"
        assert len(conversations(url)) == before + 2
        s.keys("/model", "Enter")
        s.wait(lambda t: "the server has: smollm2-135m-instruct" in t)
        s.keys("/exit", "Enter")
        deadline = time.monotonic() + 10
        while s.alive():
            assert time.monotonic() < deadline, "sluice chat did not quit"
            time.sleep(0.1)
    finally:
        s.close()


def test_ctrl_c_stops_the_answer_not_the_program(url: str) -> None:
    s = Session(url, "--max-tokens", "1500")
    try:
        s.wait(lambda t: prompts(t) == 1)
        s.keys("Write a very long story about a fox, a river and a mill.", "Enter")
        s.wait(lambda t: len(t.split("a mill.", 1)[-1].strip()) > 40)  # it is streaming
        s.keys("C-c")
        s.wait(lambda t: "[stopped]" in t and prompts(t) == 2, within=10)
        # The server stopped generating: its slot is free, the partial answer kept.
        deadline = time.monotonic() + 10
        while True:
            health = httpx.get(f"{url}/health", timeout=10).json()
            if all(m.get("active", 0) == 0 for m in health["models"].values()):
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        answer = conversations(url)[0]["messages"][-1]
        assert answer["role"] == "assistant" and answer["status"] == "incomplete"
        assert s.alive()  # the program goes on
        s.keys("C-d")
    finally:
        s.close()


def test_a_system_prompt_opens_each_new_conversation(url: str) -> None:
    s = Session(url, "--max-tokens", "8", "--system", "You are a pirate.")
    try:
        s.wait(lambda t: "sluice chat on" in t and prompts(t) == 1)
        s.keys("Hello", "Enter")
        s.wait(lambda t: prompts(t) == 2)
        s.keys("And you?", "Enter")
        s.wait(lambda t: prompts(t) == 3)
        first = conversations(url)[0]
        assert [m["role"] for m in first["messages"]] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
        ]
        assert first["messages"][0]["content"] == "You are a pirate."
        s.keys("/reset", "Enter")
        s.wait(lambda t: "(new conversation)" in t)
        s.keys("Hi", "Enter")
        s.wait(lambda t: prompts(t) == 5)
        second = conversations(url)[0]
        assert second["id"] != first["id"]
        assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant"]
    finally:
        s.close()


def test_an_image_goes_with_the_next_message(vision_url: str, tmp_path: Path) -> None:
    ask = "Name the colour of this image in one word."
    red = solid_png((230, 20, 20))
    (tmp_path / "red.png").write_bytes(red)
    (tmp_path / "notes.txt").write_text("no picture here")
    s = Session(vision_url, "--max-tokens", "12")
    try:
        s.wait(lambda t: prompts(t) == 1)
        s.keys(f"/image {tmp_path / 'missing.png'}", "Enter")
        s.wait(lambda t: prompts(t) == 2)
        assert f"error: cannot read {tmp_path / 'missing.png'}: No such file or directory" in (
            s.screen()
        )
        s.keys(f"/image {tmp_path / 'notes.txt'}", "Enter")
        s.wait(lambda t: prompts(t) == 3)
        assert "notes.txt is not an image (PNG, JPEG, GIF, WebP or BMP)" in s.screen()
        s.keys(f"/image {tmp_path / 'red.png'}", "Enter")
        s.wait(lambda t: prompts(t) == 4)
        assert f"(attached red.png: PNG, {len(red)} bytes; it goes with the next message)" in (
            s.screen()
        )
        s.keys(ask, "Enter")
        s.wait(lambda t: prompts(t) == 5)
        s.keys("Thanks.", "Enter")  # the image went with the message before
        s.wait(lambda t: prompts(t) == 6)
        assert s.alive()
        user, answer, thanks, _ = conversations(vision_url)[0]["messages"]
        assert user["content"] == [
            {"type": "text", "text": ask},
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(red).decode()},
            },
        ]
        assert thanks["content"] == "Thanks."
        # The model was shown it: its 16 rows are in the prompt.
        text_only = httpx.post(
            f"{vision_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": ask}], "max_tokens": 1},
            timeout=120,
        ).json()
        assert answer["usage"]["prompt_tokens"] == text_only["usage"]["prompt_tokens"] + 16
    finally:
        s.close()
