"""A model repository's listing: the projector a vision model's repo offers beside it.

A vision GGUF on Hugging Face (and its mirrors, which serve the same API) sits in a
repo with its projector, ``mmproj*.gguf`` in the same folder (``ggml-org/gemma-3-4b-it-GGUF``:
``gemma-3-4b-it-Q4_K_M.gguf`` and ``mmproj-model-f16.gguf``). LM Studio and Ollama fetch
both; so do sluice's downloads when the URL names a file in such a repo
(``https://<host>/<org>/<repo>/resolve/<revision>/<path>.gguf``): the repo's tree at
that folder (``/api/models/<org>/<repo>/tree/<revision>/<folder>``) says which
projectors there are, their sizes and their SHA-256 (the LFS object id).

Pure: the manager fetches the listing (:func:`listing_url`) under its download rules
and hands the JSON to :func:`pick_projector`.

Example::

    listing_url("https://huggingface.co/org/r/resolve/main/m-Q4_K_M.gguf")
    # -> "https://huggingface.co/api/models/org/r/tree/main"
    pick_projector(url, [{"type": "file", "path": "mmproj-f16.gguf", "size": 8, ...}])
    # -> Listed(url=".../resolve/main/mmproj-f16.gguf", name="mmproj-f16.gguf", ...)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import SplitResult, quote, unquote, urlsplit, urlunsplit

_FILE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>[^?#]+\.gguf)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Which projector of several: the precisions LM Studio and llama.cpp's docs use first.
_PREFERRED = ("f16", "bf16", "q8_0", "f32")
LISTING_MAX_BYTES = 4 << 20  # a folder of a few thousand files
LISTING_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Listed:
    """A file the listing offers: where to fetch it, its name, digest and size."""

    url: str
    name: str
    sha256: str | None
    size: int | None


def _parts(url: str) -> tuple[SplitResult, str, str, str] | None:
    """(split URL, repo, revision, path in the repo) of a repo file's URL, else None."""
    split = urlsplit(url)
    match = _FILE.match(split.path)
    if split.scheme not in ("http", "https") or match is None:
        return None
    return split, match["repo"], match["rev"], unquote(match["path"])


def listing_url(url: str) -> str | None:
    """The tree listing of the folder holding ``url``'s file; None for a URL that is
    not a repo file's (``.../resolve/<revision>/<path>.gguf``)."""
    parts = _parts(url)
    if parts is None:
        return None
    split, repo, rev, path = parts
    folder = str(PurePosixPath(path).parent)
    tail = "" if folder == "." else "/" + quote(folder)
    return urlunsplit((split.scheme, split.netloc, f"/api/models/{repo}/tree/{rev}{tail}", "", ""))


def pick_projector(url: str, listing: object) -> Listed | None:
    """The projector beside ``url``'s file in ``listing`` (the tree's JSON): one named
    ``mmproj*.gguf`` in the same folder; of several, those named after the model first,
    then by precision (F16, BF16, Q8_0, F32, then by name). None if there is none."""
    parts = _parts(url)
    if parts is None or not isinstance(listing, list):
        return None
    split, repo, rev, path = parts
    model = PurePosixPath(path)
    found: list[tuple[PurePosixPath, dict[str, Any]]] = []
    for entry in listing:
        if not isinstance(entry, dict) or entry.get("type") != "file":
            continue
        where = entry.get("path")
        if not isinstance(where, str):
            continue
        file = PurePosixPath(where)
        name = file.name.lower()
        if file.parent == model.parent and name.startswith("mmproj") and name.endswith(".gguf"):
            found.append((file, entry))
    if not found:
        return None
    stem = model.name.removesuffix(".gguf").lower()

    def rank(item: tuple[PurePosixPath, dict[str, Any]]) -> tuple[bool, int, str]:
        name = item[0].name.lower()
        precision = next((i for i, p in enumerate(_PREFERRED) if p in name), len(_PREFERRED))
        named_after = any(word in name for word in _words(stem))
        return (not named_after, precision, name)

    file, entry = min(found, key=rank)
    lfs = entry.get("lfs")
    oid = lfs.get("oid") if isinstance(lfs, dict) else None
    size = entry.get("size")
    return Listed(
        url=urlunsplit(
            (split.scheme, split.netloc, f"/{repo}/resolve/{rev}/{quote(str(file))}", "", "")
        ),
        name=file.name,
        sha256=oid.lower() if isinstance(oid, str) and _SHA256.match(oid.lower()) else None,
        size=size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None,
    )


def _words(stem: str) -> list[str]:
    """The model's name without its quantization (``gemma-3-4b-it-q4_k_m`` ->
    ``gemma-3-4b-it``), for a projector named after it."""
    base = re.split(r"[-.](?:i?q\d|f16|bf16|f32)", stem)[0]
    return [base] if len(base) >= 3 else []
