"""LM Studio's model management (``/api/v1/models...``) on a real server and real models.

One server for the module (``--ctx 512 --parallel 1``, one llama.cpp thread)
over its own models folder, and one local HTTP file server that serves the
real SmolLM2 GGUF with ``Range`` support and drops the connection once
mid-file, so a download through the endpoint must resume to finish (the server
has ``--download-allow-private``: the file server is on loopback).
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.models.catalog import resolve_model
from sluice.models.gguf import read_gguf_info
from tests.support.projector import colour_projector, solid_png
from tests.support.real_server import QUIET
from tests.support.servers import http_server, serve_process

pytestmark = pytest.mark.integration

SMOLLM2 = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"
MIRROR = "mirror-smollm2"  # the downloaded copy's model key: its file stem
SEEING = "seeing-smollm2"  # downloaded from a repo that offers its projector
DROP_AFTER = 8 << 20  # the first response of the mirror file breaks off here


class FileServer:
    """Serves files by path with ``Range``; the first GET of ``/drop/...`` is cut short."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.listing: list[dict[str, Any]] = []  # a repo's tree, at /api/models/...
        self.ranges: dict[str, list[str | None]] = {name: [] for name in files}
        self.dropped = False
        self.base = ""

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        if h.path.startswith("/api/models/"):
            body = json.dumps(self.listing).encode()
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        name = h.path.rsplit("/", 1)[-1]
        path = self.files.get(name)
        if path is None:
            h.send_error(404)
            return
        want = h.headers.get("Range")
        self.ranges[name].append(want)
        size = path.stat().st_size
        start = int(want.removeprefix("bytes=").removesuffix("-")) if want else 0
        h.send_response(206 if want else 200)
        if want:
            h.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        h.send_header("Content-Length", str(size - start))
        h.send_header("ETag", '"v1"')
        h.end_headers()
        drop = h.path.startswith("/drop/") and not self.dropped
        self.dropped = self.dropped or drop
        self._send(h, path, start, DROP_AFTER if drop else None)

    def _send(self, h: BaseHTTPRequestHandler, path: Path, start: int, limit: int | None) -> None:
        sent = 0
        try:
            with path.open("rb") as f:
                f.seek(start)
                while piece := f.read(1 << 20):
                    if limit is not None and sent + len(piece) > limit:
                        h.wfile.write(piece[: limit - sent])
                        h.wfile.flush()
                        h.close_connection = True
                        h.connection.shutdown(socket.SHUT_RDWR)  # the fault: a dropped link
                        return
                    h.wfile.write(piece)
                    sent += len(piece)
        except OSError:
            pass  # the client went away

    def url(self, name: str, *, drop: bool = False) -> str:
        return f"{self.base}/{'drop' if drop else 'files'}/{name}"


@pytest.fixture(scope="module")
def source() -> Path:
    return resolve_model("smollm2").path


@pytest.fixture(scope="module")
def files(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileServer]:
    short = tmp_path_factory.mktemp("served") / "short.gguf"
    with source.open("rb") as f:
        short.write_bytes(f.read(1 << 20))  # a GGUF head: enough to fail its checksum
    projector = colour_projector("smollm2")
    server = FileServer(
        {
            f"{MIRROR}.gguf": source,
            "short.gguf": short,
            f"{SEEING}.gguf": source,
            "mmproj-seeing-f16.gguf": projector,
        }
    )
    server.listing = [  # what the repo's tree says of its folder
        {"type": "file", "path": name, "size": server.files[name].stat().st_size}
        for name in (f"{SEEING}.gguf", "mmproj-seeing-f16.gguf")
    ]
    with http_server(server.handle) as base:
        server.base = base
        yield server


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def base(models_dir: Path) -> Iterator[str]:
    # The file server is on loopback, which downloads refuse without the flag.
    args = ("--ctx", "512", "--parallel", "1", "--download-allow-private", *QUIET)
    with serve_process(*args, env={"SLUICE_MODELS_DIR": str(models_dir)}) as url:
        yield url


def listing(base: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{base}/api/v1/models", timeout=60)
    assert r.status_code == 200, r.text
    return {m["key"]: m for m in r.json()["models"]}


def post(base: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{base}/api/v1/models/{path}", json=body, timeout=120)


def lms_error(r: httpx.Response, status: int, type_: str, param: str | None) -> str:
    """The message of an LM Studio error body, after checking its status, type and param."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_, err
    assert err.get("param") == param, err
    assert isinstance(err["message"], str) and err["message"]
    return str(err["message"])


def wait_job(base: str, job_id: str, within: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        r = httpx.get(f"{base}/api/v1/models/download/status/{job_id}", timeout=10)
        assert r.status_code == 200, r.text
        status: dict[str, Any] = r.json()
        if status["status"] not in ("downloading", "paused"):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


# -- listing ------------------------------------------------------------------------------


def test_listing_shows_both_packaged_models(base: str, source: Path) -> None:
    models = listing(base)
    smol, gemma = models[SMOLLM2], models[GEMMA]
    assert smol["type"] == gemma["type"] == "llm"
    assert smol["format"] == gemma["format"] == "gguf"

    info = read_gguf_info(source)
    assert smol["publisher"] == "HuggingFaceTB"  # its general.organization
    assert smol["architecture"] == "llama"
    assert smol["quantization"] == {"name": "Q4_1", "bits_per_weight": info.bits_per_weight}
    assert smol["size_bytes"] == source.stat().st_size
    assert smol["params_string"] == "135M"
    assert smol["max_context_length"] == 8192  # trained, not the server's 512
    # Its ChatML template has no tools section and no reasoning markers.
    assert smol["capabilities"] == {"vision": False, "trained_for_tool_use": info.supports_tools}
    [instance] = smol["loaded_instances"]  # the default model loads at start
    assert instance["id"] == SMOLLM2
    assert instance["config"]["context_length"] == 512
    assert instance["config"]["parallel"] == 1

    assert gemma["publisher"] == "local"  # no general.organization
    assert gemma["architecture"] == "gemma3"
    assert gemma["quantization"]["name"] == "Q4_K_M"
    assert gemma["params_string"] == "270M"
    assert gemma["max_context_length"] == 32768
    assert gemma["capabilities"]["trained_for_tool_use"] is False
    assert gemma["loaded_instances"] == []


# -- load and unload ----------------------------------------------------------------------


def test_load_with_context_length_then_unload(base: str) -> None:
    body = {"model": GEMMA, "context_length": 1024, "echo_load_config": True}
    r = post(base, "load", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["type"] == "llm" and out["status"] == "loaded"
    assert out["instance_id"] == GEMMA
    assert out["load_time_seconds"] > 0
    assert out["load_config"]["context_length"] == 1024

    [instance] = listing(base)[GEMMA]["loaded_instances"]
    assert instance == {"id": GEMMA, "config": out["load_config"]}

    text = {"model": GEMMA, "prompt": "The capital of France is", "max_tokens": 4}
    r = httpx.post(f"{base}/v1/completions", json={**text, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == GEMMA and r.json()["choices"][0]["text"]

    # Loading again with no settings keeps the instance: nothing to load.
    again = post(base, "load", {"model": "gemma3-270m"}).json()  # by its alias
    assert again["instance_id"] == GEMMA and again["load_time_seconds"] == 0
    assert "load_config" not in again

    r = post(base, "unload", {"instance_id": GEMMA})
    assert r.status_code == 200, r.text
    assert r.json() == {"instance_id": GEMMA}
    assert listing(base)[GEMMA]["loaded_instances"] == []
    message = lms_error(
        post(base, "unload", {"instance_id": GEMMA}), 404, "model_not_found", "instance_id"
    )
    assert GEMMA in message


def test_load_accepts_options_it_cannot_set_per_model(base: str) -> None:
    # LM Studio tools send llama.cpp options sluice sets per server: still a load.
    body = {
        "model": SMOLLM2,
        "flash_attention": True,
        "eval_batch_size": 64,
        "echo_load_config": True,
    }
    r = post(base, "load", body)
    assert r.status_code == 200, r.text
    assert r.json()["load_config"]["eval_batch_size"] == 512  # what applies: --batch
    assert r.json()["load_config"]["context_length"] == 512  # the loaded instance, kept


def test_load_and_unload_errors_are_lm_studio_errors(base: str) -> None:
    message = lms_error(
        post(base, "load", {"model": "no-such-model"}), 404, "model_not_found", "model"
    )
    assert "no-such-model" in message
    lms_error(post(base, "load", {"context_length": 1024}), 400, "invalid_request", "model")
    small = post(base, "load", {"model": GEMMA, "context_length": 16})
    assert "64" in lms_error(small, 400, "invalid_request", "context_length")
    big = post(base, "load", {"model": GEMMA, "context_length": 1 << 20})
    assert "32768" in lms_error(big, 400, "invalid_request", "context_length")
    typed = post(base, "load", {"model": GEMMA, "context_length": "long"})
    lms_error(typed, 400, "invalid_request", "context_length")
    bad_json = httpx.post(f"{base}/api/v1/models/load", content=b'{"model": ', timeout=10)
    assert "JSON" in lms_error(bad_json, 400, "invalid_request", None)
    assert listing(base)[GEMMA]["loaded_instances"] == []  # no failed load left one behind

    lms_error(
        post(base, "unload", {"instance_id": "no-such-model"}),
        404,
        "model_not_found",
        "instance_id",
    )
    lms_error(post(base, "unload", {}), 400, "invalid_request", "instance_id")


# -- downloads ----------------------------------------------------------------------------


def test_download_resumes_and_the_model_is_served(
    base: str, files: FileServer, models_dir: Path, source: Path
) -> None:
    url = files.url(f"{MIRROR}.gguf", drop=True)
    r = post(base, "download", {"model": url})
    assert r.status_code == 200, r.text
    started = r.json()
    assert started["job_id"].startswith("job_") and started["status"] == "downloading"
    assert "started_at" in started

    done = wait_job(base, started["job_id"])
    size = source.stat().st_size
    assert done["status"] == "completed", done
    assert done["downloaded_bytes"] == done["total_size_bytes"] == size
    assert done["completed_at"] >= done["started_at"]
    # Cut off at DROP_AFTER, then resumed from where the file on disk ended.
    ranges = files.ranges[f"{MIRROR}.gguf"]
    assert ranges[0] is None and len(ranges) >= 2, ranges
    assert all(rng is not None and int(rng[6:-1]) >= DROP_AFTER for rng in ranges[1:]), ranges
    assert (models_dir / f"{MIRROR}.gguf").stat().st_size == size
    assert not list(models_dir.glob("*.part"))

    entry = listing(base)[MIRROR]
    assert entry["architecture"] == "llama" and entry["size_bytes"] == size
    assert entry["loaded_instances"] == []
    ids = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]]
    assert MIRROR in ids

    chat = {"model": MIRROR, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MIRROR
    assert r.json()["choices"][0]["message"]["content"]

    # The same file again: LM Studio's answer for a model on disk, without a job.
    again = post(base, "download", {"model": files.url(f"{MIRROR}.gguf")})
    assert again.status_code == 200, again.text
    assert again.json() == {"status": "already_downloaded", "model": MIRROR}


def test_a_download_brings_the_projector_its_repo_offers(
    base: str, files: FileServer, models_dir: Path
) -> None:
    url = f"{files.base}/org/seeing-GGUF/resolve/main/{SEEING}.gguf"
    r = post(base, "download", {"model": url})
    assert r.status_code == 200, r.text
    done = wait_job(base, r.json()["job_id"])
    assert done["status"] == "completed", done
    assert sorted(p.name for p in (models_dir / SEEING).iterdir()) == [
        "mmproj-seeing-f16.gguf",
        f"{SEEING}.gguf",
    ]
    assert listing(base)[SEEING]["capabilities"]["vision"] is True
    assert listing(base)[MIRROR]["capabilities"]["vision"] is False
    show = httpx.post(f"{base}/api/show", json={"model": SEEING}, timeout=30).json()
    assert "vision" in show["capabilities"]
    png = base64.b64encode(solid_png((230, 20, 20))).decode()
    ask = "Name the colour of this image in one word."
    content = [
        {"type": "text", "text": ask},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
    ]
    chat = {
        "model": SEEING,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 12,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert "red" in r.json()["choices"][0]["message"]["content"].lower()
    post(base, "unload", {"instance_id": SEEING})


def test_download_checksum_mismatch_fails_and_leaves_no_file(
    base: str, files: FileServer, models_dir: Path
) -> None:
    body = {"model": files.url("short.gguf"), "sha256": "0" * 64, "filename": "bad-sum.gguf"}
    r = post(base, "download", body)
    assert r.status_code == 200, r.text
    done = wait_job(base, r.json()["job_id"])
    assert done["status"] == "failed", done
    assert "SHA-256" in done["error"]
    assert not (models_dir / "bad-sum.gguf").exists()
    assert not (models_dir / "bad-sum.gguf.part").exists()
    assert "bad-sum" not in listing(base)


def test_download_errors_are_lm_studio_errors(base: str, files: FileServer) -> None:
    r = httpx.get(f"{base}/api/v1/models/download/status/job_0123456789", timeout=10)
    lms_error(r, 404, "job_not_found", "job_id")
    catalog_id = post(base, "download", {"model": "qwen/qwen3-4b-2507"})
    assert "URL" in lms_error(catalog_id, 400, "invalid_request", "model")
    repo_page = post(base, "download", {"model": "https://huggingface.co/org/repo-GGUF"})
    assert ".gguf" in lms_error(repo_page, 400, "invalid_request", "model")
    bad_sum = post(base, "download", {"model": files.url("short.gguf"), "sha256": "abc"})
    lms_error(bad_sum, 400, "invalid_request", "sha256")
