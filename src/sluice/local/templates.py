"""Chat templates: the GGUF's own Jinja template, rendered in a sandbox.

Example::

    template = ChatTemplate(source, bos_token="", eos_token="<|im_end|>")
    prompt = template.render([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.core.errors import MissingChatTemplate, TemplateError


class _TemplateRaised(Exception):
    """The template itself called raise_exception(...)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    # Templates (HF convention) expect unescaped non-ASCII and no HTML escaping.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. Errors at compile or render time are 400s."""

    def __init__(
        self, source: str | None, *, bos_token: str, eos_token: str, model_id: str
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.model_id = model_id
        self._template: jinja2.Template | None = None
        self._compile_error: str | None = None
        self._system: bool | None = None  # whether it takes a system message (probed)
        if source:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template = env.from_string(source)
            except jinja2.TemplateError as exc:
                self._compile_error = str(exc)

    @property
    def available(self) -> bool:
        return self._template is not None

    @property
    def supports_system(self) -> bool:
        """Whether the template takes a system message (Gemma's raise an exception on
        one). Probed once with a system and a user message."""
        if self._system is None:
            probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
            try:
                self._render(probe, True, None)
                self._system = True
            except _TemplateRaised:
                self._system = False
            except Exception:  # noqa: BLE001 - a template failing otherwise: not this
                self._system = True
        return self._system

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: Any
    ) -> str:
        assert self._template is not None
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **(extra or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        return self._template.render(**context)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            if self._compile_error is not None:
                raise TemplateError(
                    f"The chat template of '{self.model_id}' does not compile: {self._compile_error}"
                )
            raise MissingChatTemplate(
                f"The model '{self.model_id}' has no chat template "
                "(tokenizer.chat_template is not in its GGUF), so /v1/chat/completions cannot "
                "format messages for it. Use /v1/completions, or set a template with "
                "--chat-template / SLUICE_CHAT_TEMPLATE.",
                param="model",
            )
        if any(m.get("role") == "system" for m in messages) and not self.supports_system:
            messages = _system_into_user(messages)
        try:
            return self._render(messages, add_generation_prompt, extra)
        except _TemplateRaised as exc:
            raise TemplateError(f"The chat template rejected the messages: {exc}") from exc
        except Exception as exc:  # the model's template on the request's messages
            raise TemplateError(
                f"The chat template failed to render these messages: {type(exc).__name__}: {exc}"
            ) from exc


def _system_into_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages' text put at the start of the first user message (a system
    message of their own when there is none), as llama.cpp does for templates without
    a system role."""
    system = "\n\n".join(
        m["content"] if isinstance(m.get("content"), str) else _text_of(m.get("content"))
        for m in messages
        if m.get("role") == "system"
    )
    rest = [m for m in messages if m.get("role") != "system"]
    for i, m in enumerate(rest):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                merged: Any = [{"type": "text", "text": system + "\n\n"}, *content]
            else:
                merged = f"{system}\n\n{content or ''}"
            return [*rest[:i], {**m, "content": merged}, *rest[i + 1 :]]
    return [{"role": "user", "content": system}, *rest]


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
