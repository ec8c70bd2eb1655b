"""Model downloads: one GGUF file from an http(s) URL into the models folder, as a background job.

Behind LM Studio's ``POST /api/v1/models/download`` and
``GET /api/v1/models/download/status/{job_id}``. A transfer writes to
``<name>.part`` and the final ``<name>`` appears only when every byte is there
and (if a SHA-256 was given) the digest matches: an atomic ``os.replace``, so
the model list never sees half a file. A dropped connection is resumed with a
``Range`` request; a job started for a file whose ``.part`` is already on disk
(after a restart, or after :meth:`DownloadManager.close`) resumes from it.

A client picks the URL, so the server must not become its way into the local
network: unless the manager allows private addresses, a URL whose host resolves
to a loopback, private, link-local (cloud metadata), reserved, multicast or
unspecified address is refused before a job starts (:class:`DownloadNotAllowed`,
a 400 naming the field), and every connection the transfer makes, to a redirect
target too, resolves the host again and connects only to the addresses it
checked (:func:`public_only_transport`), so a DNS answer that changes in between
reaches nothing unchecked. ``allowed_hosts`` narrows the URLs further, for every
request the transfer makes (a redirect to another host is refused too). Through a
proxy (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``, honoured as httpx honours them)
the proxy makes the connection, so the address rule is applied to the target host,
resolved here before each request (the proxy's own lookup is the proxy's).

A URL of a file in a Hugging Face-style repo (``.../<org>/<repo>/resolve/<rev>/x.gguf``)
whose folder also holds a projector (``mmproj*.gguf``, a vision model's second file,
found through the repo's tree listing: :mod:`sluice.models.hub`) brings the projector
too, as LM Studio and Ollama do: both land in a folder of their own,
``<models>/<x>/x.gguf`` and ``<models>/<x>/mmproj-....gguf``, where the catalog finds the
projector beside its model (and a projector never sits beside another model). The
job's progress counts both files; the projector comes first (it is the smaller), and
its failure fails the job. A listing that cannot be had is no projector, not an error.

File writes and hashing run on worker threads one chunk at a time (about
1 MiB), so the event loop never waits on the disk for long. They are short,
unlike the calls :mod:`sluice.local.offload` runs, so ``asyncio.to_thread``
(which the interpreter joins at exit) is fine here.

Example::

    downloads = DownloadManager(Path("~/models").expanduser())
    job = await downloads.start("https://host/org/repo/resolve/main/tiny.Q4_0.gguf")
    downloads.get(job.id).status_dict()
    # -> {"job_id": "job_1f2e3d4c5b", "status": "downloading", "model": "tiny.Q4_0",
    #     "downloaded_bytes": 1048576, "total_size_bytes": 96000000, ...}
    await job.wait()
    await downloads.close()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import os
import re
import secrets
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal, TypeVar
from urllib.parse import urlsplit

import httpx
import orjson

from sluice.core import addresses
from sluice.core.errors import (
    DownloadFailed,
    DownloadNotAllowed,
    JobNotFound,
    ShuttingDown,
)
from sluice.models import hub
from sluice.models.download_checks import (
    check_sha256,
    check_url,
    file_name,
    on_allowed_hosts,
    public_only_transport,
)

log = logging.getLogger("sluice.downloads")

T = TypeVar("T")

JobStatus = Literal["downloading", "paused", "completed", "failed", "already_downloaded"]

GGUF_MAGIC = b"GGUF"
# Worth another try: the server or a proxy in front of it is briefly unwell.
_TRANSIENT_STATUSES = frozenset({408, 429, 502, 503, 504})
# A stalled server must end the attempt, not hang the job; the read timeout is
# per socket read, so a slow but moving transfer is never cut.
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
_RATE_WINDOW_S = 5.0
_MAX_BACKOFF_S = 10.0


class DownloadJob:
    """One download: its progress, its outcome, and the LM Studio status object."""

    def __init__(
        self, job_id: str, url: str, path: Path, sha256: str | None, status: JobStatus
    ) -> None:
        self.id = job_id
        self.url = url
        self.display_url = _redact(url)  # for logs and messages: no query, no credentials
        self.path = path  # the final file
        self.part_path = path.with_name(path.name + ".part")
        self.sha256 = sha256  # expected digest, lowercase hex
        self.status: JobStatus = status
        self.downloaded_bytes = 0
        self.total_size_bytes: int | None = None
        self.started_at = _utcnow()
        self.completed_at: datetime | None = None
        self.error: DownloadFailed | None = None
        self._validator: str | None = None  # the file's ETag or Last-Modified, for If-Range
        self.projector: DownloadJob | None = None  # a vision model's projector, fetched first
        self._rate = _Rate()
        self._done = asyncio.Event()

    @property
    def model(self) -> str:
        """The model key the file will be listed under: its name without ``.gguf``."""
        return self.path.name.removesuffix(".gguf")

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> None:
        """Until the job ends: completed, failed, paused (manager closed) or already there."""
        await self._done.wait()

    def bytes_per_second(self) -> float | None:
        """The transfer rate over the last few seconds (of the file in transfer); None
        before there is one."""
        rate = self._rate.per_second(time.monotonic())
        if rate is None and self.projector is not None:
            return self.projector.bytes_per_second()
        return rate

    def progress(self) -> tuple[int, int | None]:
        """Bytes downloaded and the total (None until known), the projector's included."""
        done, total = self.downloaded_bytes, self.total_size_bytes
        extra = self.projector
        if extra is not None:
            done += extra.downloaded_bytes
            more = extra.total_size_bytes
            total = None if total is None or more is None else total + more
        return done, total

    def status_dict(self) -> dict[str, Any]:
        """LM Studio's download status object; fields not known (yet) are left out."""
        out: dict[str, Any] = {"job_id": self.id, "status": self.status, "model": self.model}
        done, total = self.progress()
        if total is not None:
            out["total_size_bytes"] = total
        out["downloaded_bytes"] = done
        if self.status == "already_downloaded":
            return out  # nothing was transferred: no times, no rate
        out["started_at"] = _iso(self.started_at)
        if self.status == "downloading":
            rate = self.bytes_per_second()
            if rate is not None:
                out["bytes_per_second"] = round(rate, 1)
                left = (total or 0) - done
                if rate > 0 and total is not None and left >= 0:
                    out["estimated_completion"] = _iso(_utcnow() + timedelta(seconds=left / rate))
        if self.completed_at is not None:
            out["completed_at"] = _iso(self.completed_at)
        if self.error is not None:
            out["error"] = self.error.message
        return out

    # -- updated by the manager -----------------------------------------------------------

    def _restart_rate(self) -> None:
        self._rate.reset(time.monotonic(), self.downloaded_bytes)

    def _advance(self, n: int) -> None:
        self.downloaded_bytes += n
        self._rate.add(time.monotonic(), self.downloaded_bytes)

    def _end(self, status: JobStatus, error: DownloadFailed | None = None) -> None:
        self.status = status
        self.error = error
        if status == "completed":
            self.completed_at = _utcnow()
        self._done.set()


class DownloadManager:
    """Starts, tracks and resumes model downloads into ``models_dir``.

    ``retries`` bounds the attempts in a row that gain no bytes (a drop after
    progress resets the count, so a flaky link still finishes a large file);
    ``backoff`` is the first wait between attempts, doubled each time up to 10 s.
    ``allow_private`` lets URLs reach loopback, private and link-local addresses;
    ``allowed_hosts`` (``"host,host:port,..."``) lists the only hosts a URL may name.
    A ``client`` given here must do its own connect-time check (made with
    :func:`public_only_transport`, unless ``allow_private``).
    """

    def __init__(
        self,
        models_dir: Path,
        *,
        client: httpx.AsyncClient | None = None,
        retries: int = 5,
        chunk_bytes: int = 1 << 20,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        backoff: float = 0.5,
        allow_private: bool = False,
        allowed_hosts: str | None = None,
    ) -> None:
        self.models_dir = Path(models_dir)
        self._allow_private = allow_private
        self._allowed_hosts = allowed_hosts
        self._own_client = client is None
        # Through a proxy (HTTP(S)_PROXY), the proxy connects: the address rule is then
        # applied to the target host, resolved here before each request and redirect.
        self._via_proxy = client is None and not allow_private and _proxied()
        if client is None:
            # Without the check, or through a proxy, the default transport (which honours
            # HTTP(S)_PROXY); with the check, connections go straight to checked addresses.
            direct = allow_private or self._via_proxy
            transport = None if direct else public_only_transport()
            client = httpx.AsyncClient(timeout=timeout, follow_redirects=True, transport=transport)
        # Every request, each redirect's included, goes to an allowed host.
        client.event_hooks["request"] = [*client.event_hooks["request"], self._check_hop]
        self._client = client
        self._retries = max(0, retries)
        self._chunk_bytes = max(1, chunk_bytes)
        self._timeout = timeout
        self._backoff = backoff
        self._jobs: dict[str, DownloadJob] = {}
        self._running: dict[Path, DownloadJob] = {}  # final path -> its transfer
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    async def start(
        self, url: str, *, sha256: str | None = None, filename: str | None = None
    ) -> DownloadJob:
        """Start downloading ``url`` (returns at once; the transfer runs as a task).

        The file is named ``filename`` or after the URL's last path segment and
        must be a ``.gguf``; with a projector offered beside it (:mod:`sluice.models.hub`)
        both go into a folder named after the file. A file already in the folder gives a
        job with status ``already_downloaded``; a file being downloaded gives the
        running job.
        Raises :class:`InvalidRequest` (``param`` ``"url"``, ``"filename"`` or
        ``"sha256"``), :class:`DownloadNotAllowed` for a host this manager may not
        download from.
        """
        self._check_open()
        check_url(url)
        name = file_name(url, filename)
        expected = check_sha256(sha256)
        await self._check_host(url)
        flat = self.models_dir / name
        projector = None if flat.exists() else await self._projector(url, name)
        # No await from here until the job is registered: two calls for one file cannot race.
        self._check_open()
        folder = self.models_dir / name.removesuffix(".gguf") if projector else self.models_dir
        path = folder / name
        running = self._running.get(path)
        if running is not None:
            return running
        there = next((p for p in (flat, path) if p.exists()), None)
        if there is not None:
            job = DownloadJob(self._new_id(), url, there, expected, "already_downloaded")
            job.downloaded_bytes = job.total_size_bytes = there.stat().st_size
            self._jobs[job.id] = job
            job._done.set()
            return job
        job = DownloadJob(self._new_id(), url, path, expected, "downloading")
        if projector is not None:
            extra = DownloadJob(
                f"{job.id}-mmproj",
                projector.url,
                folder / projector.name,
                projector.sha256,
                "downloading",
            )
            extra.total_size_bytes = projector.size
            job.projector = extra
        self._jobs[job.id] = job
        self._running[path] = job
        task = asyncio.create_task(self._run(job), name=f"sluice-download-{job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(functools.partial(self._task_done, job))
        return job

    async def _projector(self, url: str, name: str) -> hub.Listed | None:
        """The projector the URL's repo offers beside its file, from the repo's listing
        (fetched under the same rules as the file); None if none, or no listing."""
        listing = hub.listing_url(url)
        if listing is None:
            return None
        try:
            async with asyncio.timeout(hub.LISTING_SECONDS):
                body = await self._listing(listing)
            found = None if body is None else hub.pick_projector(url, orjson.loads(body))
        except (httpx.HTTPError, addresses.NotPublic, DownloadFailed, TimeoutError) as exc:
            log.info("download: no listing at %s (%s)", _redact(listing), exc)
            return None
        except orjson.JSONDecodeError:
            log.info("download: the listing at %s is not JSON", _redact(listing))
            return None
        if found is None or found.name == name:
            return None
        log.info("download: %s comes with its projector %s", name, found.name)
        return found

    async def _listing(self, url: str) -> bytes | None:
        """A listing's body (at most :data:`hub.LISTING_MAX_BYTES`); None if not a 200."""
        headers = {"Accept": "application/json"}
        async with self._client.stream("GET", url, headers=headers) as response:
            if response.status_code != 200:
                log.info("download: no listing at %s (HTTP %d)", _redact(url), response.status_code)
                return None
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > hub.LISTING_MAX_BYTES:
                    return None
            return bytes(body)

    def _check_open(self) -> None:
        if self._closed:
            raise ShuttingDown("The download manager is closed.")

    async def _check_host(self, url: str) -> None:
        """The URL's host is allowed, and (unless private addresses are) public."""
        parsed = httpx.URL(url)
        host = parsed.raw_host.decode("ascii")  # the name connected: IDNA, no brackets
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        if not on_allowed_hosts(parsed, self._allowed_hosts):
            raise DownloadNotAllowed(
                f"The download host {parsed.host!r} is not on this server's allowed hosts.",
                param="url",
            )
        if self._allow_private:
            return
        try:
            async with asyncio.timeout(self._timeout.connect):
                await addresses.public_addresses(host, port)
        except addresses.NotPublic as exc:
            raise DownloadNotAllowed(
                f"The download host {exc}; this server does not download from such addresses.",
                param="url",
            ) from exc
        except (OSError, TimeoutError):
            pass  # no answer now: each attempt of the job resolves and checks again

    async def _check_hop(self, request: httpx.Request) -> None:
        """Before each request, a redirect's too: its host is on ``allowed_hosts``, and
        through a proxy, resolves to public addresses (else :class:`DownloadFailed`)."""
        url = request.url
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        if not on_allowed_hosts(url, self._allowed_hosts):
            raise DownloadFailed(
                f"The download was sent to {url.host!r}, which is not on this server's "
                "allowed hosts (--download-allowed-hosts)."
            )
        if self._via_proxy:
            try:
                await addresses.public_addresses(host, port)
            except addresses.NotPublic as exc:
                raise DownloadFailed(
                    f"The download host {exc}; this server does not download from such "
                    "addresses (through its proxy either)."
                ) from exc

    def get(self, job_id: str) -> DownloadJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"No download job '{job_id}'.", param="job_id")
        return job

    def jobs(self) -> list[DownloadJob]:
        return list(self._jobs.values())

    async def close(self) -> None:
        """Stop every transfer (status ``paused``), keeping its ``.part`` for a later resume."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._own_client and not self._client.is_closed:
            await self._client.aclose()

    # -- the transfer ---------------------------------------------------------------------

    def _new_id(self) -> str:
        while True:  # LM Studio's shape: "job_" and 10 hex digits
            job_id = f"job_{secrets.token_hex(5)}"
            if job_id not in self._jobs:
                return job_id

    def _task_done(self, job: DownloadJob, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(job.id, None)
        if self._running.get(job.path) is job:
            del self._running[job.path]
        if not job.finished:  # cancelled before its first step: _run never ran
            job._end("paused")

    async def _run(self, job: DownloadJob) -> None:
        """The task: never lets an exception escape, always ends the job."""
        log.info("download %s: %s -> %s", job.id, job.display_url, job.path)
        try:
            extra = job.projector
            if extra is not None and not extra.path.exists():
                await self._transfer(extra)
            await self._transfer(job)
        except asyncio.CancelledError:
            log.info("download %s paused at %d bytes", job.id, job.downloaded_bytes)
            job._end("paused")
            raise
        except DownloadFailed as exc:
            log.error("download %s failed: %s", job.id, exc.message)
            job._end("failed", exc)
        except Exception as exc:  # a bug: still a failed job, never a lost task exception
            log.exception("download %s failed unexpectedly", job.id)
            job._end("failed", DownloadFailed(f"Download failed: {type(exc).__name__}: {exc}"))
        else:
            log.info("download %s complete: %s", job.id, job.path)
            job._end("completed")

    async def _transfer(self, job: DownloadJob) -> None:
        try:
            part = await _in_thread(lambda: _PartFile.open(job.part_path, job.sha256 is not None))
        except OSError as exc:
            raise DownloadFailed(f"Cannot write {job.part_path}: {exc}") from exc
        try:
            job.downloaded_bytes = part.size
            if part.size:
                log.info("download %s resumes %s at %d bytes", job.id, part.path, part.size)
            # Hash what is on disk before appending, in batches, so the final
            # digest covers the whole file and close() is never held up long.
            hash_batch = functools.partial(part.hash_some, 16 * self._chunk_bytes)
            while await _in_thread(hash_batch):
                pass
            await self._attempts(job, part)
            digest = await _in_thread(part.finish)
            if job.sha256 is not None and digest != job.sha256:
                await _in_thread(lambda: job.part_path.unlink(missing_ok=True))
                raise DownloadFailed(
                    f"SHA-256 mismatch for {job.path.name}: expected {job.sha256}, got {digest}; "
                    "the partial file was removed."
                )
            await _in_thread(lambda: os.replace(job.part_path, job.path))
        except OSError as exc:
            raise DownloadFailed(f"Cannot write {job.part_path}: {exc}") from exc
        finally:
            # A .part holding no byte is not worth resuming: do not leave it behind.
            await _in_thread(part.close_and_drop_if_empty)

    async def _attempts(self, job: DownloadJob, part: _PartFile) -> None:
        """Requests until the whole body is in ``part``; bounded retries with backoff."""
        failures = 0
        while True:
            before = job.downloaded_bytes
            job._restart_rate()
            try:
                await self._attempt(job, part)
                return
            except _Retry as exc:
                if job.downloaded_bytes > before:
                    failures = 0  # progress: a drop every few MiB must still finish
                failures += 1
                if failures > self._retries:
                    raise DownloadFailed(
                        f"Download of {job.display_url} failed after {failures} attempts: {exc}"
                    ) from exc
                delay = min(self._backoff * 2 ** (failures - 1), _MAX_BACKOFF_S)
                log.warning(
                    "download %s: %s; retrying in %.2fs at %d bytes",
                    job.id,
                    exc,
                    delay,
                    job.downloaded_bytes,
                )
                await asyncio.sleep(delay)

    async def _attempt(self, job: DownloadJob, part: _PartFile) -> None:
        """One request. Raises :class:`_Retry` for what another request may fix."""
        have = job.downloaded_bytes
        # identity: Range offsets count the bytes on disk, not a compressed stream.
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
            if job._validator is not None:
                # If the file changed since the last attempt, the server sends
                # all of it (200) instead of a tail that would not fit the head.
                headers["If-Range"] = job._validator
        try:
            async with self._client.stream(
                "GET", job.url, headers=headers, follow_redirects=True, timeout=self._timeout
            ) as response:
                status = response.status_code
                if status == 416 and have:
                    total = _content_range(response.headers.get("content-range"))[2]
                    if total == have:  # the .part already holds the whole file
                        job.total_size_bytes = total
                        return
                    await self._truncate(job, part)
                    raise _Retry(f"the server refused the range from byte {have}; restarting")
                if status in _TRANSIENT_STATUSES:
                    raise _Retry(f"HTTP {status} {response.reason_phrase}")
                if status not in (200, 206):
                    raise DownloadFailed(
                        f"Download of {job.display_url} failed: HTTP {status} {response.reason_phrase}."
                    )
                if status == 206:
                    start, _end, total = _content_range(response.headers.get("content-range"))
                    if start != have:
                        raise DownloadFailed(
                            f"The server sent bytes from {start}, asked for bytes from {have}."
                        )
                else:  # 200: the whole file, whatever we asked for
                    if have:
                        log.info("download %s: the server ignored Range; restarting", job.id)
                        await self._truncate(job, part)
                    total = _int_header(response.headers.get("content-length"))
                    job.total_size_bytes = total  # this response is the whole file
                if total is not None:
                    job.total_size_bytes = total
                job._validator = _validator(response) or job._validator
                await self._receive(job, part, response)
        except addresses.NotPublic as exc:  # from the transport: never worth a retry
            raise DownloadFailed(
                f"Download of {job.display_url} stopped: host {exc} (a redirect, or a DNS "
                "answer that changed since the request); this server does not download "
                "from such addresses."
            ) from exc
        except httpx.UnsupportedProtocol as exc:  # e.g. a redirect to ftp://
            raise DownloadFailed(f"Download of {job.display_url} failed: {exc}") from exc
        except httpx.TransportError as exc:  # dropped, timed out, refused: try again
            raise _Retry(_describe(exc)) from exc
        except httpx.HTTPError as exc:  # too many redirects and the like
            raise DownloadFailed(f"Download of {job.display_url} failed: {_describe(exc)}") from exc
        total = job.total_size_bytes
        if total is not None and job.downloaded_bytes < total:
            raise _Retry(f"the body ended at {job.downloaded_bytes} of {total} bytes")
        if total is not None and job.downloaded_bytes > total:
            raise DownloadFailed(
                f"Received {job.downloaded_bytes} bytes, more than the {total} announced."
            )

    async def _receive(self, job: DownloadJob, part: _PartFile, response: httpx.Response) -> None:
        # From byte 0 the first bytes are held back until the GGUF magic is
        # checked: an HTML error page fails at once and never reaches the disk.
        head: bytes | None = b"" if job.downloaded_bytes == 0 else None
        async for chunk in response.aiter_bytes(self._chunk_bytes):
            if head is not None:
                head += chunk
                if len(head) < len(GGUF_MAGIC):
                    continue
                _check_magic(job, head, response)
                chunk, head = head, None
            await _in_thread(functools.partial(part.append, chunk))
            job._advance(len(chunk))
        if head is not None:
            _check_magic(job, head, response)

    async def _truncate(self, job: DownloadJob, part: _PartFile) -> None:
        await _in_thread(part.truncate)
        job.downloaded_bytes = 0
        job._restart_rate()


class _Retry(Exception):
    """An attempt ended in a way another attempt may fix (drop, timeout, 503)."""


class _PartFile:
    """The ``.part`` file and the SHA-256 of its bytes. Every method blocks: call it in a thread."""

    def __init__(self, path: Path, file: IO[bytes], hashing: bool) -> None:
        self.path = path
        self._file = file
        self._hash = hashlib.sha256() if hashing else None
        self._hashed = 0  # bytes of the file the digest covers
        self.size = file.seek(0, os.SEEK_END)

    @classmethod
    def open(cls, path: Path, hashing: bool) -> _PartFile:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Append mode: every write lands at the end, which is where the next byte goes.
        part = cls(path, open(path, "a+b"), hashing)  # noqa: SIM115 - kept open across calls
        if part.size and part._head() != GGUF_MAGIC:
            part.truncate()  # not the start of a GGUF: nothing here is worth resuming
        return part

    def _head(self) -> bytes:
        self._file.seek(0)
        return self._file.read(len(GGUF_MAGIC))

    def hash_some(self, limit: int) -> int:
        """Hash up to ``limit`` more bytes already on disk; 0 once the digest covers them all."""
        if self._hash is None or self._hashed >= self.size:
            return 0
        self._file.seek(self._hashed)
        data = self._file.read(min(limit, self.size - self._hashed))
        self._hash.update(data)
        self._hashed += len(data)
        return len(data)

    def append(self, data: bytes) -> None:
        self._file.write(data)
        self.size += len(data)
        if self._hash is not None:
            self._hash.update(data)
            self._hashed += len(data)

    def truncate(self) -> None:
        self._file.truncate(0)
        self._file.seek(0)
        self.size = self._hashed = 0
        if self._hash is not None:
            self._hash = hashlib.sha256()

    def finish(self) -> str | None:
        """Flush to the disk (the rename must not publish a file the OS still buffers)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._hash.hexdigest() if self._hash is not None else None

    def close_and_drop_if_empty(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.size == 0:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class _Rate:
    """Bytes per second over the last few seconds, from (time, total bytes) samples."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def reset(self, now: float, total: int) -> None:
        self._samples.clear()
        self._samples.append((now, total))

    def add(self, now: float, total: int) -> None:
        self._samples.append((now, total))
        # Keep one sample at or before the window's start, so the window is full.
        while len(self._samples) > 2 and self._samples[1][0] <= now - _RATE_WINDOW_S:
            self._samples.popleft()

    def per_second(self, now: float) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, n0), (_t1, n1) = self._samples[0], self._samples[-1]
        # Up to now, not to the last sample: a stalled transfer shows its rate falling.
        elapsed = now - t0
        return (n1 - n0) / elapsed if elapsed > 0 else None


async def _in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a worker thread. A cancelled caller still waits for it to
    return, so the file it is writing is never closed under it."""
    future = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved: no "exception never retrieved" warning
        raise


# -- small helpers ------------------------------------------------------------------------


def _check_magic(job: DownloadJob, head: bytes, response: httpx.Response) -> None:
    if head[: len(GGUF_MAGIC)] == GGUF_MAGIC:
        return
    kind = response.headers.get("content-type", "unknown")
    raise DownloadFailed(
        f"{job.display_url} is not a GGUF file: it starts with {head[:16]!r} (Content-Type {kind}). "
        "Is the URL a web page instead of the file itself?"
    )


def _content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    """``bytes 100-199/1000`` -> (100, 199, 1000); ``bytes */1000`` -> (None, None, 1000)."""
    match = re.fullmatch(r"\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*", value or "")
    if match is None:
        raise DownloadFailed(f"The server sent a malformed Content-Range: {value!r}.")
    start, end, total = match.groups()
    return (
        int(start) if start is not None else None,
        int(end) if end is not None else None,
        int(total) if total not in (None, "*") else None,
    )


def _validator(response: httpx.Response) -> str | None:
    """A strong ETag, else Last-Modified: what ``If-Range`` accepts."""
    etag: str | None = response.headers.get("etag")
    if etag and not etag.startswith("W/"):
        return etag
    modified: str | None = response.headers.get("last-modified")
    return modified


def _redact(url: str) -> str:
    """``url`` without user info, query or fragment (a signed URL's token stays out of logs)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _int_header(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _describe(exc: httpx.HTTPError) -> str:
    text = str(exc) or "no details"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__}: {text})"
    return f"{type(exc).__name__}: {text}"


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _iso(moment: datetime) -> str:
    """ISO 8601 in UTC with milliseconds, as LM Studio writes it: ``2025-10-03T15:33:23.496Z``."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _proxied() -> bool:
    """Whether the environment names a proxy for http or https (HTTP_PROXY, HTTPS_PROXY,
    ALL_PROXY, as httpx reads them)."""
    proxies = urllib.request.getproxies_environment()
    return any(proxies.get(scheme) for scheme in ("http", "https", "all"))
