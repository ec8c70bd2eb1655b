"""``sluice chat``: a terminal chat with a running server, its history kept on the server.

Each turn goes to ``POST /c1/chat`` (streamed) with the conversation's id, so the
server keeps the history (``/c1`` conversations, in its SQLite store) and a turn
sends only the new message. Tokens print as they come; reasoning prints dimmed.

Keys and commands:

* Enter sends the line; a line ending in ``\\`` goes on on the next one, and a
  line of ``\"\"\"`` starts or ends a block of several lines.
* Ctrl-C while an answer streams stops it (the server stops generating and keeps
  what was said); Ctrl-C at the prompt clears the line; Ctrl-D or ``/exit`` quits.
* ``/model [NAME]`` shows or switches the model (a new conversation starts),
  ``/reset`` starts a new conversation, ``/image PATH`` attaches an image file to the
  next message (an OpenAI ``image_url`` part, a ``data:`` URI; the model needs its
  projector: docs/vision.md), ``/help`` lists the commands.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import httpx

from sluice.clients.models import add_server_args, auth_headers, error_text
from sluice.core.media import FORMATS, MAX_IMAGE_BYTES, sniff

DIM, RESET, RED = "\x1b[2m", "\x1b[0m", "\x1b[31m"
HELP = (
    "commands: /model [NAME] (show or switch the model), /reset (new conversation), "
    "/image PATH (attach an image to the next message), "
    '/exit; a line ending in \\ goes on, """ starts or ends a block; '
    "Ctrl-C stops an answer"
)
MEDIA_TYPES = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a running server in the terminal",
        description="Chat with a running sluice server; the conversation is kept on the "
        "server (/c1). Ctrl-C stops an answer, Ctrl-D or /exit quits, /help lists the "
        "commands.",
    )
    add_server_args(p)
    p.add_argument("--model", help="the model (default: the server's default model)")
    p.add_argument("--max-tokens", type=int, help="tokens an answer may have")
    p.add_argument("--system", help="a system prompt for each new conversation")


class Chat:
    """One terminal session: the model, the conversation, and the output."""

    def __init__(
        self,
        client: httpx.Client,
        model: str | None,
        out: TextIO,
        *,
        max_tokens: int | None = None,
        system: str | None = None,
        color: bool = True,
    ) -> None:
        self.client = client
        self.model = model
        self.out = out
        self.max_tokens = max_tokens
        self.system = system
        self.color = color
        self.conversation: str | None = None
        self.images: list[str] = []  # data: URIs for the next message
        self._sent = 0.0  # when the current turn was sent (time.monotonic)

    def _style(self, text: str, style: str) -> str:
        return f"{style}{text}{RESET}" if self.color else text

    def say(self, text: str, style: str = "") -> None:
        self.out.write((self._style(text, style) if style else text) + "\n")
        self.out.flush()

    def command(self, line: str) -> bool:
        """A ``/`` command; False to quit."""
        verb, _, arg = line[1:].strip().partition(" ")
        match verb:
            case "exit" | "quit":
                return False
            case "reset":
                self.conversation = None
                self.say("(new conversation)", DIM)
            case "image":
                self.attach(arg.strip())
            case "model" if arg.strip():
                self.model, self.conversation = arg.strip(), None
                self.say(f"(model {self.model}, new conversation)", DIM)
            case "model":
                try:
                    names = [m.get("id") for m in self._models()]
                except (httpx.HTTPError, ValueError) as exc:
                    self.say(f"error: cannot list the models: {exc}", RED)
                    return True
                current = self.model or "(the server's default)"
                self.say(f"model: {current}; the server has: {', '.join(map(str, names))}")
            case _:
                self.say(HELP)
        return True

    def attach(self, arg: str) -> None:
        """``/image PATH``: the file, checked to be an image, goes with the next message."""
        if len(arg) > 1 and arg[0] == arg[-1] and arg[0] in "'\"":
            arg = arg[1:-1]  # a quoted path (one with spaces, pasted from a file manager)
        if not arg:
            self.say(f"usage: /image PATH ({FORMATS}); attached now: {len(self.images)}")
            return
        path = Path(arg).expanduser()
        try:
            with path.open("rb") as file:
                data = file.read(MAX_IMAGE_BYTES + 1)
        except OSError as exc:
            self.say(f"error: cannot read {path}: {exc.strerror or exc}", RED)
            return
        kind = sniff(data)
        if kind is None:
            self.say(f"error: {path} is not an image ({FORMATS})", RED)
            return
        if len(data) > MAX_IMAGE_BYTES:
            self.say(f"error: {path} is over {MAX_IMAGE_BYTES // 2**20} MiB", RED)
            return
        encoded = base64.b64encode(data).decode("ascii")
        self.images.append(f"data:{MEDIA_TYPES[kind]};base64,{encoded}")
        n = len(self.images)
        goes = "it goes" if n == 1 else f"{n} images go"
        self.say(
            f"(attached {path.name}: {kind}, {len(data):,} bytes; {goes} with the next message)",
            DIM,
        )

    def _models(self) -> list[dict[str, Any]]:
        r = self.client.get("/v1/models")
        return list(r.json().get("data") or []) if r.is_success else []

    def turn(self, message: str) -> None:
        """Send ``message`` (with the images attached, which it takes) and print the
        answer as it streams (Ctrl-C stops it)."""
        content: Any = message
        if self.images:
            images = [{"type": "image_url", "image_url": {"url": url}} for url in self.images]
            content = [{"type": "text", "text": message}, *images]
            self.images = []
        body: dict[str, Any] = {
            "message": content,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        if self.conversation:
            body["conversation_id"] = self.conversation
        elif self.system:
            body["system"] = self.system  # where a conversation starts (/c1)
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        timeout = httpx.Timeout(30, read=None)
        self._sent = time.monotonic()
        try:
            with self.client.stream("POST", "/c1/chat", json=body, timeout=timeout) as r:
                if r.status_code >= 400:
                    self.say(f"error: {error_text(r.status_code, r.read())}", RED)
                    return
                self.conversation = r.headers.get("x-conversation-id", self.conversation)
                self._print_stream(_data_lines(r.iter_lines()))
        except KeyboardInterrupt:
            self.say(self._style(" [stopped]", DIM))
        except httpx.HTTPError as exc:
            self.say(f"error: {exc}", RED)

    def _print_stream(self, chunks: Iterator[dict[str, Any]]) -> None:
        thinking = False
        first: float | None = None
        usage: dict[str, Any] = {}
        for chunk in chunks:
            usage = chunk.get("usage") or usage
            if first is None and chunk.get("choices"):
                first = time.monotonic()
            if "error" in chunk and not chunk.get("choices"):
                error = chunk["error"]
                message = error.get("message") if isinstance(error, dict) else error
                self.say(f"\nerror: {message}", RED)
                return
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning_content")
                if reasoning:
                    self.out.write(self._style(reasoning, DIM))
                    thinking = True
                text = delta.get("content")
                if text:
                    if thinking:
                        self.out.write("\n")
                        thinking = False
                    self.out.write(text)
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    self.out.write(self._style(f"[tool call {fn.get('name', '')}]", DIM))
                self.out.flush()
        self.out.write("\n")
        tokens = usage.get("completion_tokens")
        if first is not None and tokens:
            spent = time.monotonic() - first
            rate = f", {(tokens - 1) / spent:.1f} tok/s" if tokens > 1 and spent > 0 else ""
            ttft = (first - self._sent) * 1000
            self.out.write(self._style(f"({tokens} tokens{rate}, first token {ttft:.0f} ms)", DIM))
            self.out.write("\n")
        self.out.flush()


def _data_lines(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                yield json.loads(line[6:])
            except ValueError:  # not a frame of ours: skipped
                continue


def read_message(prompt: Callable[[str], str]) -> str | None:
    """One message from the terminal: a line, lines joined by a trailing ``\\``, or a
    ``\"\"\"`` block; None at end of input."""
    try:
        line = prompt(">>> ")
    except EOFError:
        return None
    if line.strip() == '"""':
        lines: list[str] = []
        while True:
            try:
                more = prompt("... ")
            except EOFError:
                break
            if more.strip() == '"""':
                break
            lines.append(more)
        return "\n".join(lines)
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(prompt("... "))
        except EOFError:
            break
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    headers = auth_headers(args.api_key)
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    try:  # line editing and history where the platform has it
        import readline  # noqa: F401
    except ImportError:
        pass
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as client:
        chat = Chat(
            client,
            args.model,
            sys.stdout,
            max_tokens=args.max_tokens,
            system=args.system,
            color=color,
        )
        try:
            client.get("/health").raise_for_status()
        except httpx.HTTPError as exc:
            chat.say(f"error: cannot reach {args.url}: {exc}", RED)
            return 1
        chat.say(f"sluice chat on {args.url}; /help for the commands, Ctrl-D to quit", DIM)
        while True:
            try:
                message = read_message(input)
            except KeyboardInterrupt:
                chat.out.write("\n")
                continue
            if message is None:
                chat.out.write("\n")
                return 0
            if not message.strip():
                continue
            if message.startswith("/"):
                if not chat.command(message):
                    return 0
                continue
            chat.turn(message)
