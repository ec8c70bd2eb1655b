"""The chat page in a real headless Chromium, against ``sluice serve`` on the real
models: it loads clean, streams an answer, stops one (the server's slot frees),
keeps conversations (reload, open, rename, branch, delete), sends its settings (a
system prompt where a conversation starts, sampling on every turn; a new chat names
them; another tab sees them saved), loads the second model with a progress bar (and
says it cannot chat: no chat template), and asks for the API key once (and again in
every tab once it is forgotten). Screenshots go to a folder
the tests print."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.real_server import QUIET, wait_idle
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

KEY = "sk-web-browser-01"
FIGURES = re.compile(r"^\d+ tokens · [\d.]+ tok/s · first token \d+ ms$")
LONG = 120_000  # ms: an answer on a loaded 2-core machine


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_process("--parallel", "1", "--ctx", "2048", *QUIET) as base:
        yield base


@dataclass
class Seen:
    """What a page did: every request's URL, console messages, uncaught errors."""

    requests: list[str] = field(default_factory=list)
    console: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def open_page(browser: Any, url: str, **context: Any) -> tuple[Any, Seen]:
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport={"width": 1200, "height": 820}, **context)
    page = ctx.new_page()
    seen = Seen()
    page.on("request", lambda r: seen.requests.append(r.url))
    page.on("console", lambda m: seen.console.append((m.type, m.text)))
    page.on("pageerror", lambda e: seen.errors.append(str(e)))
    page.on("dialog", lambda d: d.accept())  # Delete's confirmation
    page.goto(url + "/")
    expect(page.get_by_role("combobox", name="Model")).to_have_value(re.compile(".+"))
    return page, seen


@pytest.fixture
def page(browser: Any, url: str) -> Iterator[tuple[Any, Seen]]:
    wait_idle(url, within=10)
    page, seen = open_page(browser, url)
    yield page, seen
    page.context.close()


def send(page: Any, text: str) -> None:
    box = page.get_by_role("textbox", name="Message")
    box.fill(text)
    box.press("Enter")


def answered(page: Any) -> None:
    """The turn is over and the page shows it as stored (the hash names it)."""
    from playwright.sync_api import expect

    expect(page.get_by_role("button", name="Send")).to_be_enabled(timeout=LONG)
    expect(page).to_have_url(re.compile(r"#conv_"), timeout=10_000)
    expect(page.locator("article.assistant[aria-busy]")).to_have_count(0)


def conversation_id(page: Any) -> str:
    return urlsplit(page.url).fragment


def watch_answer(page: Any) -> None:
    """Record the last answer's text length at every change, and whether it had its
    figures yet (window.lengths)."""
    page.evaluate(
        """() => {
        window.lengths = [];
        new MutationObserver(() => {
          const a = [...document.querySelectorAll('article.assistant')].pop();
          if (a) window.lengths.push([a.querySelector('.content').textContent.length,
                                      Boolean(a.querySelector('.metrics'))]);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
      }"""
    )


def test_the_page_loads_clean_and_all_local(page: tuple[Any, Seen], url: str) -> None:
    from playwright.sync_api import expect

    p, seen = page
    # The controls, by their exact accessible names.
    expect(p.get_by_role("combobox", name="Model", exact=True)).to_have_value(
        "smollm2-135m-instruct"
    )
    expect(p.get_by_role("textbox", name="Message", exact=True)).to_be_editable()
    expect(p.get_by_role("button", name="Send", exact=True)).to_be_enabled()
    expect(p.get_by_role("button", name="Stop", exact=True)).to_be_disabled()
    p.wait_for_load_state("networkidle")
    origin = url + "/"
    assert seen.requests and all(u.startswith(origin) for u in seen.requests), seen.requests
    assert any("/ui/vendor/marked-" in u for u in seen.requests)  # markdown came from here
    assert [m for m in seen.console if m[0] in ("error", "warning")] == []
    assert seen.errors == []


def test_an_answer_streams_in_then_shows_its_figures(
    page: tuple[Any, Seen], url: str, shots: Path
) -> None:
    from playwright.sync_api import expect

    p, seen = page
    watch_answer(p)
    send(p, "Write a haiku about a river.")
    expect(p.get_by_role("button", name="Stop")).to_be_enabled()
    figures = p.locator("article.assistant .metrics").last
    expect(figures).to_have_text(FIGURES, timeout=LONG)
    streaming = sorted({n for n, done in p.evaluate("window.lengths") if n and not done})
    assert len(streaming) >= 2, streaming  # seen at least twice, growing, before the end
    answered(p)
    stored = httpx.get(f"{url}/c1/conversations/{conversation_id(p)}", timeout=10).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["messages"][1]["status"] == "complete"
    assert stored["title"] == "Write a haiku about a river."
    # After the page reloaded the stored turn, the figures measured here stay.
    expect(p.locator("article.assistant .metrics")).to_have_text(FIGURES)
    expect(p.get_by_role("heading", level=1)).to_have_text(stored["title"])
    p.screenshot(path=shots / "answer.png")
    assert seen.errors == [] and [m for m in seen.console if m[0] == "error"] == []


def test_stop_ends_the_generation_on_the_server(
    page: tuple[Any, Seen], url: str, shots: Path
) -> None:
    from playwright.sync_api import expect

    p, _ = page
    send(p, "Write a very long story about a fox, a river and a mill.")  # 600+ tokens: 8 of 8
    p.wait_for_function(
        "() => ([...document.querySelectorAll('article.assistant .content')].pop()"
        "?.textContent.length ?? 0) > 30",
        timeout=LONG,
    )
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["models"]["smollm2-135m-instruct"]["slots"]["active"] == 1  # generating
    p.get_by_role("button", name="Stop").click()
    wait_idle(url, within=5)  # the server stopped generating: the slot is free
    answered(p)
    stored = httpx.get(f"{url}/c1/conversations/{conversation_id(p)}", timeout=10).json()
    last = stored["messages"][-1]
    assert last["role"] == "assistant" and last["status"] == "incomplete"
    assert last["content"]  # what was said is kept
    expect(p.locator("article.assistant .status.incomplete")).to_have_text("stopped")
    expect(p.locator("article.assistant .metrics")).to_have_text(
        re.compile(r"^(\d+ tokens · )?first token \d+ ms$")
    )
    p.screenshot(path=shots / "stopped.png")


def test_conversations_reload_open_rename_branch_delete(
    page: tuple[Any, Seen], url: str, shots: Path
) -> None:
    from playwright.sync_api import expect

    p, _ = page
    send(p, "My name is Ada. Say hello to me.")
    answered(p)
    first = conversation_id(p)
    p.get_by_role("button", name="New chat").click()
    expect(p.locator("article")).to_have_count(0)
    send(p, "What is the capital of France?")
    answered(p)
    second = conversation_id(p)
    assert first != second

    p.goto(url + "/")  # a fresh page: the list comes from the server
    nav = p.get_by_role("navigation", name="Conversations")
    entry = nav.get_by_role("button", name="My name is Ada. Say hello to me.")
    expect(entry).to_be_visible()
    entry.click()
    expect(p).to_have_url(re.compile(f"#{first}$"))
    expect(p.locator("article.user")).to_have_text(re.compile("My name is Ada"))
    expect(p.locator("article.assistant")).to_have_count(1)

    p.get_by_role("button", name="Rename").click()
    title = p.get_by_role("textbox", name="Title")
    title.fill("Greeting Ada")
    title.press("Enter")
    expect(p.get_by_role("heading", level=1)).to_have_text("Greeting Ada")
    expect(nav.get_by_role("button", name="Greeting Ada")).to_be_visible()
    stored = httpx.get(f"{url}/c1/conversations/{first}", timeout=10).json()
    assert stored["title"] == "Greeting Ada"

    # Edit the first message: a new branch from the start, shown as branch 2 of 2.
    p.locator("article.user").get_by_role("button", name="Edit").click()
    send(p, "My name is Grace. Say hello to me.")
    answered(p)
    expect(p.locator("article.user")).to_have_text(re.compile("Grace"))
    expect(p.locator("article.user .branches")).to_contain_text("2/2")
    stored = httpx.get(f"{url}/c1/conversations/{first}", timeout=10).json()
    roots = [m for m in stored["messages"] if m["parent_id"] is None]
    assert len(roots) == 2 and len(stored["messages"]) == 4
    p.get_by_role("button", name="Previous branch").click()
    expect(p.locator("article.user")).to_have_text(re.compile("Ada"))
    p.screenshot(path=shots / "branches.png")

    p.get_by_role("button", name="Delete").click()  # the confirmation is accepted
    expect(nav.get_by_role("button", name="Greeting Ada")).to_have_count(0)
    expect(p.locator("article")).to_have_count(0)
    assert httpx.get(f"{url}/c1/conversations/{first}", timeout=10).status_code == 404
    assert httpx.get(f"{url}/c1/conversations/{second}", timeout=10).status_code == 200


SYSTEM = "You are a lighthouse keeper. Answer in one short sentence."
OTHER_SYSTEM = "You are a pirate. Answer in one short sentence."


def chat_bodies(page: Any) -> list[dict[str, Any]]:
    """Every POST /c1/chat body the page sends from now on, as it sends them."""
    bodies: list[dict[str, Any]] = []

    def record(request: Any) -> None:
        if urlsplit(request.url).path == "/c1/chat":
            bodies.append(json.loads(request.post_data))

    page.on("request", record)
    return bodies


def open_settings(page: Any) -> Any:
    from playwright.sync_api import expect

    page.get_by_role("button", name="Settings", exact=True).click()
    dialog = page.get_by_role("dialog", name="Settings")
    expect(dialog).to_be_visible()
    return dialog


def test_settings_go_with_every_turn_and_the_system_prompt_at_the_start(
    page: tuple[Any, Seen], url: str, shots: Path
) -> None:
    from playwright.sync_api import expect

    p, seen = page
    bodies = chat_bodies(p)
    dialog = open_settings(p)
    expect(dialog).to_contain_text("Applies to new conversations")
    dialog.get_by_label("System prompt").fill(SYSTEM)
    dialog.get_by_label("Temperature").fill("0.3")
    dialog.get_by_label("Max tokens").fill("8")
    p.screenshot(path=shots / "settings.png")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog).to_be_hidden()

    send(p, "Tell me a long story about the sea.")
    answered(p)
    first = conversation_id(p)
    stored = httpx.get(f"{url}/c1/conversations/{first}", timeout=10).json()
    system, user, answer = stored["messages"]
    assert (system["role"], system["content"], system["parent_id"]) == ("system", SYSTEM, None)
    assert user["role"] == "user" and user["parent_id"] == system["id"]
    assert answer["usage"]["completion_tokens"] <= 8, answer
    assert answer["finish_reason"] in ("length", "stop"), answer
    # Shown folded above the thread, not as a message of the user's.
    folded = p.locator("details.system-prompt")
    expect(folded).to_have_count(1)
    expect(folded.locator("summary")).to_contain_text("System prompt")
    expect(folded.locator("summary")).to_contain_text("lighthouse keeper")
    expect(p.locator("article.user")).to_have_count(1)
    expect(p.locator("article")).to_have_count(2)
    p.screenshot(path=shots / "system-prompt.png")

    # A reload keeps the settings (and the conversation).
    p.reload()
    expect(p.locator("details.system-prompt")).to_have_count(1)
    dialog = open_settings(p)
    expect(dialog.get_by_label("System prompt")).to_have_value(SYSTEM)
    expect(dialog.get_by_label("Temperature")).to_have_value("0.3")
    expect(dialog.get_by_label("Max tokens")).to_have_value("8")
    expect(dialog.get_by_label("Top P")).to_have_value("")
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()

    # A continuing turn sends the sampling but no system prompt (the server would 400).
    send(p, "And then?")
    answered(p)
    expect(p.get_by_role("alert")).to_be_hidden()
    stored = httpx.get(f"{url}/c1/conversations/{first}", timeout=10).json()
    roles = [m["role"] for m in stored["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert stored["messages"][-1]["usage"]["completion_tokens"] <= 8
    assert [b.get("system") for b in bodies] == [SYSTEM, None]
    assert all(b["max_tokens"] == 8 and b["temperature"] == 0.3 for b in bodies), bodies
    assert all("top_p" not in b for b in bodies)

    # Editing the first message starts again from the root: a new system + user pair,
    # with the settings' system prompt of now; the branches switch as one.
    dialog = open_settings(p)
    dialog.get_by_label("System prompt").fill(OTHER_SYSTEM)
    dialog.get_by_role("button", name="Save").click()
    p.locator("article.user").first.get_by_role("button", name="Edit").click()
    expect(p.locator("#branch-note")).to_contain_text("first message")
    send(p, "Tell me a short story about a ship.")
    answered(p)
    assert bodies[-1]["parent_id"] is None and bodies[-1]["system"] == OTHER_SYSTEM
    stored = httpx.get(f"{url}/c1/conversations/{first}", timeout=10).json()
    roots = [m for m in stored["messages"] if m["parent_id"] is None]
    assert [(m["role"], m["content"]) for m in roots] == [
        ("system", SYSTEM),
        ("system", OTHER_SYSTEM),
    ]
    expect(p.locator("details.system-prompt summary")).to_contain_text("pirate")
    expect(p.locator("article.user")).to_have_text(re.compile("ship"))
    expect(p.locator("article.user .branches")).to_contain_text("2/2")
    p.get_by_role("button", name="Previous branch").click()
    expect(p.locator("details.system-prompt summary")).to_contain_text("lighthouse keeper")
    expect(p.locator("article.user")).to_have_count(2)  # the first branch, both turns
    expect(p.locator("article.user").first).to_contain_text("the sea")
    expect(p.locator("article.user .branches").first).to_contain_text("1/2")
    p.locator("details.system-prompt summary").click()  # unfolds to the whole prompt
    expect(p.locator("details.system-prompt .content")).to_have_text(SYSTEM)
    p.screenshot(path=shots / "system-branches.png")

    # Sent from this branch, the turn continues it: no system prompt, no 400.
    send(p, "What happened next?")
    answered(p)
    expect(p.get_by_role("alert")).to_be_hidden()
    assert "system" not in bodies[-1]
    expect(p.get_by_text("New conversation ·")).to_be_hidden()

    # A new chat says, before it starts, what it will be sent with.
    p.get_by_role("button", name="New chat").click()
    expect(p.get_by_text("New conversation ·")).to_have_text(
        f"New conversation · system prompt: “{OTHER_SYSTEM}” · temperature 0.3 · max tokens 8"
    )
    p.screenshot(path=shots / "new-chat-settings.png")
    assert seen.errors == [] and [m for m in seen.console if m[0] == "error"] == []


LONG_SYSTEM = (
    "You are a careful librarian who answers questions about old maps, "
    "and who always names the archive a map is kept in."
)


def test_settings_saved_in_another_tab_show_in_this_one(
    page: tuple[Any, Seen], url: str, shots: Path
) -> None:
    from playwright.sync_api import expect

    p, _ = page
    other = p.context.new_page()  # the same browser, another tab: the same localStorage
    other.goto(url + "/")
    button = other.get_by_role("button", name="Settings", exact=True)
    hint = other.get_by_text("New conversation ·")
    expect(button).not_to_have_class(re.compile(r"\bactive\b"))
    expect(hint).to_be_hidden()

    dialog = open_settings(p)
    dialog.get_by_label("System prompt").fill(LONG_SYSTEM)
    dialog.get_by_label("Max tokens").fill("400")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog).to_be_hidden()
    # The other tab shows the dot, the tooltip, and names the prompt, cut short.
    expect(button).to_have_class(re.compile(r"\bactive\b"))
    expect(button).to_have_attribute(
        "title", re.compile("^Settings in use: .*a system prompt, max tokens 400$")
    )
    expect(hint).to_have_text(
        "New conversation · system prompt: "
        "“You are a careful librarian who answers questions about old…” · max tokens 400"
    )
    other.screenshot(path=shots / "settings-other-tab.png")
    other.set_viewport_size({"width": 390, "height": 760})
    other.wait_for_timeout(300)  # the list's slide-out
    assert other.evaluate("document.documentElement.scrollWidth <= innerWidth")
    other.screenshot(path=shots / "settings-other-tab-narrow.png")

    p.bring_to_front()  # a tab behind others gets few frames: its clicks would wait
    dialog = open_settings(p)
    dialog.get_by_role("button", name="Clear all").click()
    dialog.get_by_role("button", name="Save").click()
    expect(button).not_to_have_class(re.compile(r"\bactive\b"))
    expect(hint).to_be_hidden()


def test_a_bad_setting_is_refused_by_the_form_and_by_the_server(
    page: tuple[Any, Seen], shots: Path
) -> None:
    from playwright.sync_api import expect

    p, _ = page
    dialog = open_settings(p)
    temperature = dialog.get_by_label("Temperature")
    temperature.fill("5")
    dialog.get_by_label("Top P").fill("0")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog).to_be_visible()  # not saved
    expect(dialog).to_contain_text("Temperature is a number from 0 to 2.")
    expect(dialog).to_contain_text("Top P is a number above 0, up to 1.")
    expect(temperature).to_have_attribute("aria-invalid", "true")
    expect(temperature).to_be_focused()
    p.screenshot(path=shots / "settings-invalid.png")
    dialog.get_by_role("button", name="Cancel").click()
    assert p.evaluate("localStorage.getItem('sluice.settings')") is None

    # What gets past the form (set in another way) the server refuses: its words show,
    # and the message goes back into the box.
    p.evaluate("localStorage.setItem('sluice.settings', JSON.stringify({temperature: 5}))")
    send(p, "Hello")
    alert = p.get_by_role("alert")
    expect(alert).to_contain_text("temperature", timeout=LONG)
    expect(p.get_by_role("textbox", name="Message")).to_have_value("Hello")
    expect(p.locator("article")).to_have_count(0)
    p.screenshot(path=shots / "settings-refused.png")


def test_picking_an_unloaded_model_loads_it_with_progress(
    page: tuple[Any, Seen], url: str, shots: Path
) -> None:
    from playwright.sync_api import expect

    p, _ = page
    picker = p.get_by_role("combobox", name="Model")
    gemma = picker.locator("option[value='gemma-3-270m']")
    expect(gemma).to_have_text("gemma-3-270m (not loaded, no chat template)")
    note = p.locator("#model-note")
    box = p.get_by_role("textbox", name="Message")
    expect(note).to_be_empty()
    p.evaluate(
        """() => {
        window.progress = [];
        const bar = document.getElementById('load-progress');
        new MutationObserver(() => window.progress.push(
            [bar.value, !document.getElementById('load').hidden]))
          .observe(bar, {attributes: true});
      }"""
    )
    picker.select_option("gemma-3-270m")
    # Said at once, under the box (and as the box's description).
    warning = "gemma-3-270m has no chat template (a base model): it cannot chat."
    expect(note).to_contain_text(warning)
    expect(box).to_have_accessible_description(re.compile(re.escape(warning)))
    expect(p.get_by_role("status")).to_have_text(re.compile(r"Loaded gemma-3-270m"), timeout=LONG)
    p.screenshot(path=shots / "model-loaded.png")
    expect(gemma).to_have_text(re.compile(r"\(loaded"))
    seen = p.evaluate("window.progress")
    assert any(0 < value < 1 and shown for value, shown in seen), seen
    assert seen[-1][0] == 1
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["models"]["gemma-3-270m"]["status"] == "loaded"
    # A base model has no chat template: the server says so, and the page shows it.
    send(p, "Hello")
    expect(p.get_by_role("alert")).to_contain_text("template", timeout=LONG)
    expect(box).to_have_value("Hello")  # kept to resend
    expect(note).to_contain_text(warning)
    p.screenshot(path=shots / "model-no-template.png")
    picker.select_option("smollm2-135m-instruct")
    expect(note).to_be_empty()
    expect(box).to_have_accessible_description("")


def test_model_output_is_sanitised(page: tuple[Any, Seen]) -> None:
    p, _ = page
    hostile = [
        "<script>window.pwned = 1</script>",
        '<img src="x" onerror="window.pwned = 1">',
        "[click](javascript:window.pwned=1)",
        "![pixel](https://tracker.example/p.png)",
        '<a href="#" onclick="window.pwned=1">x</a>',
        '<div style="position:fixed;inset:0" class="error">spoof</div>',
        "```\n</code></pre><script>window.pwned=1</script>\n```",
    ]
    results = p.evaluate(
        """async (inputs) => {
        const { toHtml } = await import('/ui/markdown.js');
        const box = document.createElement('div');
        document.body.append(box);
        return inputs.map((text) => {
          box.innerHTML = toHtml(text);
          const all = [...box.querySelectorAll('*')];
          return {
            html: box.innerHTML,
            scripts: box.querySelectorAll('script, img, style, iframe').length,
            handlers: all.some((n) => [...n.attributes].some((a) => a.name.startsWith('on'))),
            styled: all.some((n) => n.hasAttribute('style') || n.hasAttribute('class')),
            js: [...box.querySelectorAll('a')].some((a) => /^javascript:/i.test(a.href)),
          };
        });
      }""",
        hostile,
    )
    for text, r in zip(hostile, results, strict=True):
        assert r["scripts"] == 0 and not r["handlers"] and not r["styled"] and not r["js"], (
            text,
            r["html"],
        )
    assert "&lt;script&gt;" in results[0]["html"]  # raw HTML is shown as text
    assert p.evaluate("window.pwned") is None


def test_a_narrow_window_and_dark_mode(browser: Any, url: str, shots: Path) -> None:
    from playwright.sync_api import expect

    wait_idle(url, within=10)
    p, seen = open_page(browser, url, color_scheme="dark")
    try:
        p.set_viewport_size({"width": 390, "height": 760})
        expect(p.get_by_role("button", name="New chat")).not_to_be_in_viewport()  # slid away
        dialog = open_settings(p)
        expect(dialog.get_by_role("button", name="Save")).to_be_in_viewport(ratio=1)
        p.screenshot(path=shots / "narrow-settings.png")
        dialog.get_by_role("button", name="Cancel").click()
        send(p, "Give me three tips for learning to cook, as a list.")
        answered(p)
        assert p.evaluate("document.documentElement.scrollWidth <= innerWidth")
        expect(p.get_by_role("button", name="Send")).to_be_in_viewport()
        list_button = p.get_by_role("button", name="Conversations")
        expect(list_button).to_be_visible()
        p.screenshot(path=shots / "narrow-dark.png")
        list_button.click()
        expect(p.get_by_role("button", name="New chat")).to_be_in_viewport(ratio=1)
        p.wait_for_timeout(300)  # the list's slide-in
        p.screenshot(path=shots / "narrow-list.png")
        assert seen.errors == []
    finally:
        p.context.close()


def test_with_keys_the_page_asks_for_one_once(browser: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    with serve_process("--parallel", "1", "--api-key", KEY, *QUIET) as keyed:
        ctx = browser.new_context(viewport={"width": 1000, "height": 700})
        p = ctx.new_page()
        try:
            p.goto(keyed + "/")  # the page itself needs no key
            dialog = p.get_by_role("dialog", name="API key")
            expect(dialog).to_be_visible()
            p.screenshot(path=shots / "key-dialog.png")
            field = dialog.get_by_label("API key", exact=True)
            field.fill("sk-wrong-key-0000")
            field.press("Enter")
            expect(dialog).to_contain_text("refused")
            field.fill(KEY)
            dialog.get_by_role("button", name="Use this key").click()
            expect(dialog).to_be_hidden()
            picker = p.get_by_role("combobox", name="Model")
            expect(picker).to_have_value("smollm2-135m-instruct")
            send(p, "Say hello.")
            answered(p)
            expect(p.locator("article.assistant .metrics")).to_have_text(FIGURES)
            # Asked once: a reload uses the key kept in this browser.
            p.reload()
            expect(picker).to_have_value("smollm2-135m-instruct")
            expect(p.get_by_role("navigation", name="Conversations")).to_contain_text("Say hello.")
            expect(dialog).to_be_hidden()
            p.screenshot(path=shots / "keyed.png")
            # Forgetting it asks again, here and, at its next request, in another tab.
            other = ctx.new_page()
            other.goto(keyed + "/")
            forget = other.get_by_role("button", name="Forget API key")
            expect(forget).to_be_visible()
            p.get_by_role("button", name="Forget API key").click()
            expect(dialog).to_be_visible()
            expect(forget).to_be_hidden()
            send(other, "Say hello again.")
            expect(other.get_by_role("dialog", name="API key")).to_be_visible()
        finally:
            ctx.close()


def test_a_user_key_is_not_offered_a_load_it_may_not_do(
    browser: Any, tmp_path: Path, shots: Path
) -> None:
    """A user key may not load models: picking one not loaded says it loads with the first
    message, instead of asking for a load the server refuses."""
    from playwright.sync_api import expect

    config = tmp_path / "sluice.toml"
    config.write_text(f'[keys]\nalice = "{KEY}"\n')  # a user key
    with serve_process("--parallel", "1", "--config", str(config), *QUIET) as keyed:
        ctx = browser.new_context(viewport={"width": 1000, "height": 700})
        p = ctx.new_page()
        errors: list[str] = []
        p.on("pageerror", lambda e: errors.append(str(e)))
        try:
            p.goto(keyed + "/")
            dialog = p.get_by_role("dialog", name="API key")
            dialog.get_by_label("API key", exact=True).fill(KEY)
            dialog.get_by_role("button", name="Use this key").click()
            expect(dialog).to_be_hidden()
            picker = p.get_by_role("combobox", name="Model")
            expect(picker.locator("option[value='gemma-3-270m']")).to_have_text(
                re.compile(r"not loaded")
            )
            picker.select_option("gemma-3-270m")
            status = p.get_by_role("status")
            expect(status).to_have_text("gemma-3-270m loads with your first message.")
            expect(p.locator("#load-progress")).to_be_hidden()
            expect(p.get_by_role("alert")).to_have_count(0)
            p.screenshot(path=shots / "user-key-pick.png")
            health = httpx.get(f"{keyed}/health", timeout=10).json()
            assert health["models"]["gemma-3-270m"]["status"] == "not_loaded"
            assert errors == []
        finally:
            ctx.close()
