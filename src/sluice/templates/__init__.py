"""Chat templates sluice ships: the model families' own, as llama.cpp's tests use them.

The files in ``chat/`` are llama.cpp's ``models/templates/`` at commit 0c1e570
(the llama.cpp that llama-cpp-python 0.3.36 vendors), each the template a
model's makers published (see ``chat/README.md``). They serve two purposes: a
config entry or ``--chat-template`` may name one instead of a path (a GGUF with
no template, or a replay model), and the tests check every family's format
against llama.cpp's own parser cases.

Example::

    bundled("Qwen3-Coder")        # the template's text (".jinja" optional)
    names()                       # ["Apertus-8B-Instruct", ...]
"""

from __future__ import annotations

from importlib import resources

_DIR = "chat"


def names() -> list[str]:
    """The bundled templates' names (file names without ``.jinja``)."""
    folder = resources.files(__name__).joinpath(_DIR)
    return sorted(
        p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja")
    )


def bundled(name: str) -> str | None:
    """The text of the bundled template ``name`` (with or without ``.jinja``), or None."""
    stem = name.removesuffix(".jinja")
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    path = resources.files(__name__).joinpath(_DIR, stem + ".jinja")
    return path.read_text(encoding="utf-8") if path.is_file() else None
