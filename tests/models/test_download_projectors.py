"""A vision model's projector comes with its download (sluice.models.downloads, .hub),
against a real local HTTP server shaped like a Hugging Face repo: files under
``/<org>/<repo>/resolve/main/...`` and the repo's tree listing under
``/api/models/<org>/<repo>/tree/main[/<folder>]``."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.core.model import ModelSpec
from sluice.models.catalog import delete_from_models_dir, find_projector, scan_models_dir
from sluice.models.downloads import DownloadManager
from sluice.models.hub import listing_url, pick_projector
from tests.support.servers import http_server

REPO = "org/vision-GGUF"
MODEL = b"GGUF" + bytes(range(256)) * 40
F16 = b"GGUF" + b"\x16" * 3000
F32 = b"GGUF" + b"\x32" * 6000
FAST: dict[str, Any] = {
    "backoff": 0.01,
    "retries": 1,
    "timeout": httpx.Timeout(5.0, read=1.0),
    "allow_private": True,  # the file server is on loopback
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Repo:
    """A repo's files by path, its tree listing, and every path asked for."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.asked: list[tuple[str, str | None]] = []  # (path, Accept)
        self.listing_status = 200
        self.oid: dict[str, str] = {}  # path -> the lfs oid to list (else the file's sha)
        self.base = ""

    def url(self, path: str) -> str:
        return f"{self.base}/{REPO}/resolve/main/{path}"

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        self.asked.append((h.path, h.headers.get("Accept")))
        tree = f"/api/models/{REPO}/tree/main"
        if h.path == tree or h.path.startswith(tree + "/"):
            folder = h.path.removeprefix(tree).strip("/")
            entries = [
                {
                    "type": "file",
                    "path": path,
                    "size": len(data),
                    "lfs": {"oid": self.oid.get(path, sha(data)), "size": len(data)},
                }
                for path, data in self.files.items()
                if str(Path(path).parent).strip(".") == folder
            ]
            self._send(h, self.listing_status, json.dumps(entries).encode())
            return
        path = h.path.removeprefix(f"/{REPO}/resolve/main/").removeprefix("/files/")
        data = self.files.get(path)
        self._send(h, 404 if data is None else 200, data or b"")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


@pytest.fixture
def repo() -> Iterator[Repo]:
    files = {
        "vision-Q4_K_M.gguf": MODEL,
        "mmproj-vision-f32.gguf": F32,
        "mmproj-vision-f16.gguf": F16,
        "README.md": b"# a vision model\n",
        "sub/mmproj-other-f16.gguf": F16,
    }
    served = Repo(files)
    with http_server(served.handle) as base:
        served.base = base
        yield served


async def download(models: Path, url: str, **kwargs: Any) -> Any:
    downloads = DownloadManager(models, **FAST)
    try:
        job = await downloads.start(url, **kwargs)
        await asyncio.wait_for(job.wait(), 10)
        return job
    finally:
        await downloads.close()


async def test_the_projector_beside_the_model_comes_with_it(repo: Repo, tmp_path: Path) -> None:
    models = tmp_path / "models"
    job = await download(models, repo.url("vision-Q4_K_M.gguf"))
    assert job.status == "completed", job.error
    folder = models / "vision-Q4_K_M"
    assert (folder / "vision-Q4_K_M.gguf").read_bytes() == MODEL
    # F16 of the two; the other folder's and the F32 are not fetched.
    assert sorted(p.name for p in folder.iterdir()) == [
        "mmproj-vision-f16.gguf",
        "vision-Q4_K_M.gguf",
    ]
    assert (folder / "mmproj-vision-f16.gguf").read_bytes() == F16
    asked = [path for path, _ in repo.asked]
    assert asked == [
        f"/api/models/{REPO}/tree/main",
        f"/{REPO}/resolve/main/mmproj-vision-f16.gguf",
        f"/{REPO}/resolve/main/vision-Q4_K_M.gguf",
    ]
    assert repo.asked[0][1] == "application/json"
    info = job.status_dict()
    assert info["model"] == "vision-Q4_K_M"
    assert info["downloaded_bytes"] == info["total_size_bytes"] == len(MODEL) + len(F16)

    # The catalog lists the model (not the projector) and finds its projector.
    [spec] = scan_models_dir(models)
    assert spec.name == "vision-Q4_K_M"
    assert find_projector(spec) == str(folder / "mmproj-vision-f16.gguf")

    # Deleting the model takes its projector and the folder with it.
    assert delete_from_models_dir(spec, models) == len(MODEL) + len(F16)
    assert list(models.iterdir()) == []


async def test_a_model_in_a_subfolder_gets_that_folder_s_projector(
    repo: Repo, tmp_path: Path
) -> None:
    repo.files["sub/other-Q8_0.gguf"] = MODEL
    job = await download(tmp_path, repo.url("sub/other-Q8_0.gguf"))
    assert job.status == "completed", job.error
    assert repo.asked[0][0] == f"/api/models/{REPO}/tree/main/sub"
    assert sorted(p.name for p in (tmp_path / "other-Q8_0").iterdir()) == [
        "mmproj-other-f16.gguf",
        "other-Q8_0.gguf",
    ]


@pytest.mark.parametrize("status", [404, 401, 500])
async def test_no_listing_is_no_projector(repo: Repo, tmp_path: Path, status: int) -> None:
    repo.listing_status = status
    job = await download(tmp_path, repo.url("vision-Q4_K_M.gguf"))
    assert job.status == "completed", job.error
    assert [p.name for p in tmp_path.iterdir()] == ["vision-Q4_K_M.gguf"]  # flat, as before
    assert job.status_dict()["total_size_bytes"] == len(MODEL)


async def test_a_projector_that_fails_its_checksum_fails_the_job(
    repo: Repo, tmp_path: Path
) -> None:
    repo.oid["mmproj-vision-f16.gguf"] = "0" * 64
    job = await download(tmp_path, repo.url("vision-Q4_K_M.gguf"))
    assert job.status == "failed"
    assert "SHA-256" in job.error.message and "mmproj-vision-f16.gguf" in job.error.message
    assert not list(tmp_path.rglob("*.gguf"))  # the model was not fetched either


async def test_a_model_already_there_asks_for_no_listing(repo: Repo, tmp_path: Path) -> None:
    (tmp_path / "vision-Q4_K_M.gguf").write_bytes(MODEL)
    job = await download(tmp_path, repo.url("vision-Q4_K_M.gguf"))
    assert job.status == "already_downloaded"
    assert repo.asked == []
    folder = tmp_path / "vision-Q4_K_M"  # in its own folder, from an earlier download
    folder.mkdir()
    (tmp_path / "vision-Q4_K_M.gguf").rename(folder / "vision-Q4_K_M.gguf")
    job = await download(tmp_path, repo.url("vision-Q4_K_M.gguf"))
    assert job.status == "already_downloaded"
    assert job.path == folder / "vision-Q4_K_M.gguf"


async def test_a_url_outside_a_repo_is_not_listed(repo: Repo, tmp_path: Path) -> None:
    repo.files["plain.gguf"] = MODEL
    job = await download(tmp_path, f"{repo.base}/files/plain.gguf")
    assert job.status == "completed", job.error
    assert [path for path, _ in repo.asked] == ["/files/plain.gguf"]
    assert [p.name for p in tmp_path.iterdir()] == ["plain.gguf"]


def listed(*paths: str) -> list[dict[str, Any]]:
    return [{"type": "file", "path": p, "size": 10, "lfs": {"oid": "A" * 64}} for p in paths]


@pytest.mark.parametrize(
    ("model", "files", "chosen"),
    [
        ("m-Q4_K_M.gguf", ["mmproj-F32.gguf", "mmproj-BF16.gguf"], "mmproj-BF16.gguf"),
        ("m-Q4_K_M.gguf", ["mmproj-Q8_0.gguf", "mmproj-F16.gguf"], "mmproj-F16.gguf"),
        (
            "gemma-3-4b-it-Q4_K_M.gguf",
            ["mmproj-gemma-3-12b-it-f16.gguf", "mmproj-gemma-3-4b-it-f32.gguf"],
            "mmproj-gemma-3-4b-it-f32.gguf",
        ),
        ("m.gguf", ["other/mmproj-f16.gguf", "m.gguf"], None),
        ("m.gguf", ["mmproj-f16.bin", "projector.gguf"], None),
    ],
)
def test_which_projector_of_a_listing(model: str, files: list[str], chosen: str | None) -> None:
    url = f"https://hf.example/org/r/resolve/main/{model}"
    found = pick_projector(url, listed(*files))
    assert (found.name if found else None) == chosen
    if found is not None:
        assert found.url == f"https://hf.example/org/r/resolve/main/{chosen}"
        assert found.sha256 == "a" * 64 and found.size == 10


def test_listing_urls() -> None:
    assert listing_url("https://h/o/r/resolve/main/x.gguf?download=true") == (
        "https://h/api/models/o/r/tree/main"
    )
    assert (
        listing_url("https://h/o/r/resolve/v1.0/q/x.gguf") == "https://h/api/models/o/r/tree/v1.0/q"
    )
    assert listing_url("https://h/files/x.gguf") is None
    assert listing_url("https://h/o/r/blob/main/x.gguf") is None
    assert pick_projector("https://h/files/x.gguf", listed("mmproj.gguf")) is None
    assert pick_projector("https://h/o/r/resolve/main/x.gguf", {"not": "a list"}) is None


def test_deleting_one_of_two_models_keeps_their_projector(tmp_path: Path) -> None:
    folder = tmp_path / "org" / "repo"
    folder.mkdir(parents=True)
    for name in ("a-Q4.gguf", "a-Q8.gguf", "mmproj-a-f16.gguf"):
        (folder / name).write_bytes(b"GGUF" + b"\0" * 10)
    spec = ModelSpec("a-Q4", str(folder / "a-Q4.gguf"), "models_dir")
    assert delete_from_models_dir(spec, tmp_path) == 14
    assert sorted(p.name for p in folder.iterdir()) == ["a-Q8.gguf", "mmproj-a-f16.gguf"]
