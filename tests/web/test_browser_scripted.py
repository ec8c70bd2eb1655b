"""What the small real model never writes, shown in a real Chromium: reasoning folded
while it streams and after, and an agent's tool calls in a stored conversation; and
images attached to a message (picked, pasted, dropped), refused by a model without a
projector. The server is the real app with a scripted runner that replays chosen token
pieces."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fakes import EOS, ScriptedRunner
from tests.support.helpers import scripted_server
from tests.support.projector import solid_png
from tests.support.tools import WEATHER

# A Qwen3-like template: it knows tools (hermes <tool_call> framing) and <think>.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}. Call one as <tool_call>\n{...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{# <think> #}"
)
THINKING = [b"<th", b"ink>Two and two", b" make four.</th", b"ink>\n\nIt is **4**.", EOS]
CALL = [
    b'<tool_call>\n{"name": "get_weather", "argu',
    b'ments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    EOS,
]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ScriptedRunner]]:
    runner = ScriptedRunner(chat_template=TEMPLATE, n_ctx_seq=2048, default=THINKING)
    runner.token_delay = 0.01  # the reasoning streams in over several frames
    with scripted_server(runner) as base:
        yield base, runner


@pytest.fixture
def page(browser: Any, server: tuple[str, ScriptedRunner]) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1000, "height": 700})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server[0] + "/")
    yield page
    ctx.close()
    assert errors == []


def test_reasoning_is_folded_above_the_answer(page: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    box = page.get_by_role("textbox", name="Message")
    box.fill("What is 2 + 2?")
    box.press("Enter")
    reasoning = page.locator("article.assistant details.reasoning")
    expect(reasoning).to_be_visible()
    expect(reasoning.locator("summary")).to_have_text(re.compile("^Reasoning"))
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(page).to_have_url(re.compile("#conv_"))
    answer = page.locator("article.assistant")
    expect(answer.locator(".content strong")).to_have_text("4")  # markdown
    expect(answer.locator(".content")).not_to_contain_text("make four")
    assert reasoning.get_attribute("open") is None  # folded
    expect(reasoning.locator(".reasoning-text")).to_be_hidden()
    reasoning.locator("summary").click()
    expect(reasoning.locator(".reasoning-text")).to_have_text("Two and two make four.")
    page.screenshot(path=shots / "reasoning.png")


def test_an_agents_tool_calls_show_in_its_conversation(
    page: Any, server: tuple[str, ScriptedRunner], shots: Path
) -> None:
    from playwright.sync_api import expect

    base, runner = server
    runner.default = CALL
    try:
        r = httpx.post(
            f"{base}/c1/chat",
            json={"message": "Weather in Paris?", "tools": [WEATHER]},
            timeout=30,
        )
    finally:
        runner.default = THINKING
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    page.reload()
    page.get_by_role("navigation", name="Conversations").get_by_role("button").first.click()
    call = page.locator("article.assistant .tool-call")
    expect(call.locator(".tool-name")).to_have_text("Tool call: get_weather")
    expect(call.locator(".tool-args")).to_contain_text('"city": "Paris"')
    page.screenshot(path=shots / "tool-call.png")


def test_the_list_shows_older_conversations_on_asking(
    page: Any, server: tuple[str, ScriptedRunner]
) -> None:
    from playwright.sync_api import expect

    base, runner = server
    delay, runner.token_delay = runner.token_delay, 0.0
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            total = client.get("/c1/conversations").json()["total"]
            for i in range(total, 105):
                r = client.post("/c1/chat", json={"message": f"Question {i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
    finally:
        runner.token_delay = delay
    page.reload()
    entries = page.get_by_role("navigation", name="Conversations").get_by_role("listitem")
    expect(entries).to_have_count(100)
    page.get_by_role("button", name="Older conversations").click()
    expect(entries).to_have_count(105)
    expect(page.get_by_role("button", name="Older conversations")).to_be_hidden()


def test_a_code_block_has_a_copy_button(page: Any, server: tuple[str, ScriptedRunner]) -> None:
    from playwright.sync_api import expect

    _, runner = server
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    runner.default = [b"Here:\n\n```python\nprint(", b'"hi")\n```\n', EOS]
    try:
        box = page.get_by_role("textbox", name="Message")
        box.fill("Some code, please.")
        box.press("Enter")
        copy = page.locator("article.assistant").get_by_role("button", name="Copy the code")
        expect(copy).to_be_visible()
    finally:
        runner.default = THINKING
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == 'print("hi")\n'


def test_the_page_names_each_dialects_base_url(
    page: Any, server: tuple[str, ScriptedRunner], shots: Path
) -> None:
    from playwright.sync_api import expect

    page.get_by_text("Use this server from your tools").click()
    base = server[0]
    connect = page.locator("#connect")
    for shown in (
        f"{base}/v1",
        f"ANTHROPIC_BASE_URL={base}",
        f"GOOGLE_GEMINI_BASE_URL={base}",
        f"OLLAMA_HOST={base}",
        f"{base}/api/v1",
    ):
        expect(connect.get_by_text(shown, exact=True)).to_be_visible()
    page.screenshot(path=str(shots / "connect.png"))


def test_images_attach_by_picker_paste_and_drop_and_a_refusal_gives_them_back(
    page: Any, tmp_path: Path, shots: Path
) -> None:
    """The scripted model has no projector: the server's 400 shows, and the message and
    its images go back to the box. Without images the message is the text, as ever."""
    from playwright.sync_api import expect

    bodies: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/c1/chat") else None,
    )
    red, green, blue = (solid_png(rgb) for rgb in ((230, 20, 20), (20, 200, 30), (20, 30, 220)))
    (tmp_path / "red.png").write_bytes(red)
    (tmp_path / "notes.txt").write_text("not an image")
    thumbs = page.locator("#attachments img")
    page.locator("#attach-input").set_input_files(tmp_path / "red.png")
    expect(thumbs).to_have_count(1)
    page.evaluate(
        "dt => document.getElementById('message').dispatchEvent("
        "new ClipboardEvent('paste', {clipboardData: dt, bubbles: true}))",
        transfer(page, "green.png", green),
    )
    expect(thumbs).to_have_count(2)
    page.locator("#composer").dispatch_event(
        "drop", {"dataTransfer": transfer(page, "blue.png", blue)}
    )
    expect(thumbs).to_have_count(3)
    page.locator("#attach-input").set_input_files(tmp_path / "notes.txt")
    expect(page.get_by_role("alert")).to_contain_text("notes.txt is not an image.")
    expect(thumbs).to_have_count(3)
    assert [thumbs.nth(i).get_attribute("alt") for i in range(3)] == [
        "red.png",
        "green.png",
        "blue.png",
    ]
    page.get_by_role("button", name="Remove green.png").click()
    expect(thumbs).to_have_count(2)
    page.screenshot(path=shots / "attachments.png")

    box = page.get_by_role("textbox", name="Message")
    box.fill("What colours are these?")
    box.press("Enter")
    expect(page.get_by_role("alert")).to_contain_text("has no vision projector")
    expect(box).to_have_value("What colours are these?")  # given back, to send again
    expect(thumbs).to_have_count(2)
    expect(page.locator("article")).to_have_count(0)
    pngs = [base64.b64encode(png).decode() for png in (red, blue)]
    assert bodies[-1]["message"] == [
        {"type": "text", "text": "What colours are these?"},
        *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}} for b in pngs),
    ]

    for name in ("red.png", "blue.png"):
        page.get_by_role("button", name=f"Remove {name}").click()
    expect(page.locator("#attachments")).to_be_hidden()
    box.press("Enter")
    expect(page).to_have_url(re.compile("#conv_"))
    assert bodies[-1]["message"] == "What colours are these?"
    expect(page.locator("article.user .images")).to_have_count(0)


def transfer(page: Any, name: str, png: bytes) -> Any:
    """A DataTransfer holding one PNG file (what a drop or a paste carries)."""
    return page.evaluate_handle(
        "([name, b64]) => { const data = new DataTransfer();"
        " const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));"
        " data.items.add(new File([bytes], name, {type: 'image/png'})); return data; }",
        [name, base64.b64encode(png).decode()],
    )


def test_a_large_image_is_scaled_down_before_it_is_sent(
    page: Any, tmp_path: Path, shots: Path
) -> None:
    """A 3,000 x 1,500 photo-like PNG (noise: 13 MB, over the server's 8 MiB body limit
    as it is) goes as a JPEG of 2,048 x 1,024, which fits; a small PNG goes unchanged
    (the first test checks its bytes)."""
    import io
    import os

    from PIL import Image
    from playwright.sync_api import expect

    bodies: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/c1/chat") else None,
    )
    out = io.BytesIO()
    Image.frombytes("RGB", (3000, 1500), os.urandom(3000 * 1500 * 3)).save(out, format="PNG")
    (tmp_path / "photo.png").write_bytes(out.getvalue())
    assert len(out.getvalue()) > 8 * 2**20
    thumbs = page.locator("#attachments img")
    page.locator("#attach-input").set_input_files(tmp_path / "photo.png")
    expect(thumbs).to_have_count(1)
    expect(thumbs.first).to_have_attribute("title", "photo.png (sent at 2048×1024)")
    box = page.get_by_role("textbox", name="Message")
    box.fill("What is this?")
    box.press("Enter")
    # The scripted model has no projector: the server read the body (under its limit)
    # and refused the image as such, not the body as too large.
    expect(page.get_by_role("alert")).to_contain_text("has no vision projector")
    page.screenshot(path=shots / "scaled-attachment.png")
    url = bodies[-1]["message"][1]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert (sent.format, sent.size) == ("JPEG", (2048, 1024))
    assert len(url) < 8 * 2**20
