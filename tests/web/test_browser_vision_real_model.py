"""An image attached on the chat page, in a real headless Chromium, against ``sluice
serve`` on the real SmolLM2 with the suite's colour-seeing projector
(``tests/support/projector.py``): the model names the colour it is shown, the thread
shows the image (after a reload too, from the stored conversation), and the next turn
is answered over the history, image included (the server keeps it: ``/c1``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.projector import colour_projector, solid_png
from tests.support.real_server import QUIET, wait_idle
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

ASK = "Name the colour of this image in one word."  # (text alone is answered "blue")
RED = (230, 20, 20)
LONG = 120_000  # ms: an answer on a loaded 2-core machine
SAMPLING = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    projector = str(colour_projector("smollm2"))
    with serve_process("--mmproj", projector, "--parallel", "1", "--ctx", "2048", *QUIET) as base:
        yield base


@pytest.fixture
def page(browser: Any, url: str) -> Iterator[tuple[Any, list[str]]]:
    from playwright.sync_api import expect

    wait_idle(url, within=10)
    ctx = browser.new_context(viewport={"width": 1000, "height": 760})
    ctx.add_init_script(f"localStorage.setItem('sluice.settings', '{json.dumps(SAMPLING)}')")
    page = ctx.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.goto(url + "/")
    expect(page.get_by_role("combobox", name="Model")).to_have_value(re.compile(".+"))
    yield page, problems
    ctx.close()


def answer_text(page: Any) -> str:
    from playwright.sync_api import expect

    expect(page.get_by_role("button", name="Send")).to_be_enabled(timeout=LONG)
    expect(page).to_have_url(re.compile(r"#conv_"), timeout=10_000)
    expect(page.locator("article.assistant[aria-busy]")).to_have_count(0)
    return str(page.locator("article.assistant .content").last.inner_text())


def test_the_model_names_the_colour_of_an_attached_image(
    page: tuple[Any, list[str]], url: str, tmp_path: Path, shots: Path
) -> None:
    from playwright.sync_api import expect

    p, problems = page
    png = tmp_path / "red.png"
    png.write_bytes(solid_png(RED))
    p.locator("#attach-input").set_input_files(png)
    expect(p.locator("#attachments img")).to_have_count(1)
    box = p.get_by_role("textbox", name="Message")
    box.fill(ASK)
    box.press("Enter")
    assert "red" in answer_text(p).lower()
    expect(p.locator("#attachments")).to_be_hidden()  # sent: the composer is empty again

    # The thread shows the image in the user's message, decoded (the CSP lets a data:
    # image in), before and after a reload (from the stored conversation).
    shown = p.locator("article.user .images img")
    expect(shown).to_have_count(1)
    assert shown.evaluate("img => img.complete && img.naturalWidth") == 64
    expect(p.locator("article.user .content")).to_have_text(ASK)
    p.screenshot(path=shots / "image-answer.png")
    p.reload()
    expect(shown).to_have_count(1)
    expect(shown).to_be_visible()
    assert shown.evaluate("img => img.decode().then(() => img.naturalWidth)") == 64

    # The next turn goes over the history, the image in it: its prompt is the one an
    # OpenAI request of the same messages, image included, has (16 tokens more than
    # without the image).
    box.fill("And in one word again?")
    box.press("Enter")
    answer_text(p)
    conversation = urlsplit(p.url).fragment
    stored = httpx.get(f"{url}/c1/conversations/{conversation}", timeout=10).json()
    user, answer, _, last = stored["messages"]
    assert user["content"][0] == {"type": "text", "text": ASK}
    assert user["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    history = [
        {"role": "user", "content": user["content"]},
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "And in one word again?"},
    ]
    with_image = prompt_tokens(url, history)
    history[0]["content"] = ASK
    assert last["usage"]["prompt_tokens"] == with_image == prompt_tokens(url, history) + 16

    # Editing the message puts its image back in the composer too; Cancel clears it.
    p.locator("article.user").first.get_by_role("button", name="Edit").click()
    expect(box).to_have_value(ASK)
    expect(p.locator("#attachments img")).to_have_count(1)
    p.get_by_role("button", name="Cancel").click()
    expect(p.locator("#attachments")).to_be_hidden()
    assert problems == []


def prompt_tokens(url: str, messages: list[dict[str, Any]]) -> int:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])
