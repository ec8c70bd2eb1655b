"""Chat templates: the GGUF's own Jinja template, rendered in a sandbox.

Templates render as their makers wrote them for Hugging Face's and llama.cpp's
renderers: ``{% break %}``/``{% continue %}``, ``{% generation %}`` blocks,
``namespace``, list ``append`` and dict ``update``, ``tojson`` with its options,
``raise_exception`` and ``strftime_now``; an undefined value concatenates as
empty text, as llama.cpp's engine does. Every render sees ``enable_thinking``
(true unless the request says otherwise), ``datetime`` and ``date_string``, as
llama.cpp passes them; a request that sets ``enable_thinking`` sets ``thinking``
too, the name Kimi K3, DeepSeek V3.1 and Granite 3.3 read.

Example::

    template = ChatTemplate(source, bos_token="", eos_token="<|im_end|>")
    prompt = template.render([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import SandboxedEnvironment

from sluice.core.errors import MissingChatTemplate, ModelLoadFailed, TemplateError
from sluice.templates import bundled


def read_template(value: str) -> str:
    """A chat template override: a file's text, else the bundled template of that name
    (``"Qwen3-Coder"``: see :mod:`sluice.templates`); :class:`ModelLoadFailed` if neither."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    found = bundled(path.name)
    if found is None:
        raise ModelLoadFailed(
            f"No chat template at '{value}', and no bundled template named '{path.name}' "
            "(sluice ships the families' templates of llama.cpp's models/templates/)."
        )
    return found


class _TemplateRaised(Exception):
    """The template itself called raise_exception(...)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _plain(value: Any) -> Any:
    """A template value as JSON data: generators (``map``, ``select``) become lists,
    undefined becomes null."""
    if isinstance(value, jinja2.Undefined):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or hasattr(value, "__next__"):
        return [_plain(v) for v in value]
    return value


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: Any = None,
    sort_keys: bool = False,
    **_: Any,
) -> str:
    # Templates (HF convention) expect unescaped non-ASCII and no HTML escaping.
    return json.dumps(
        _plain(value),
        indent=indent,
        ensure_ascii=ensure_ascii,
        separators=tuple(separators) if separators else None,
        sort_keys=sort_keys,
    )


class _Lenient(jinja2.ChainableUndefined):
    """An undefined value that reads as empty text in concatenation, as in llama.cpp's
    engine (Jinja2 would raise on ``'x' + undefined``)."""

    __slots__ = ()

    def __add__(self, other: Any) -> Any:
        return other if isinstance(other, str) else ""

    def __radd__(self, other: Any) -> Any:
        return other if isinstance(other, str) else ""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's marker of the
    assistant's tokens, for training masks): renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - Jinja2's own declaration is a set

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def environment() -> SandboxedEnvironment:
    """The sandbox every chat template renders in."""
    env = SandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=_Lenient,
        extensions=[jinja2.ext.loopcontrols, jinja2.ext.do, _Generation],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


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
            try:
                self._template = environment().from_string(source)
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
        now = datetime.datetime.now()
        extra = dict(extra or {})
        if "enable_thinking" in extra:
            # The same switch under the name other families read (Kimi K3, DeepSeek
            # V3.1, Granite 3.3: ``thinking``), set only when a request set it:
            # Granite's default is off, K3's on.
            extra.setdefault("thinking", extra["enable_thinking"])
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "enable_thinking": True,
            "datetime": now.strftime("%b %d %Y"),
            "date_string": now.strftime("%d %b %Y"),
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        return self._template.render(**context)

    def render_probe(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]
    ) -> str:
        """Render for template analysis (``sluice.parsers.analysis.Render``)."""
        return self.render(messages, add_generation_prompt=add_generation_prompt, extra=extra)

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
