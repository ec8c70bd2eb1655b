"""Which addresses a model download may reach (sluice.models.downloads, sluice.core.addresses).

No test sends traffic to any address but loopback: URLs that name loopback are
refused before a connection, and names are answered by a stubbed resolver
(:class:`FakeDNS`). Where a download must get through to a "public" host, its
connections go through an inner network backend that sends the one fake public
address to the loopback file server and fails the test on any other address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest

from sluice.core.errors import DownloadNotAllowed, InvalidRequest
from sluice.models.downloads import DownloadJob, DownloadManager, public_only_transport
from tests.support.servers import http_server
from tests.support.tls import certificates

BODY = b"GGUF" + bytes(4096)
PUBLIC = "93.184.215.14"  # what the fake DNS says a "public" name is; never connected to
FAST: dict[str, Any] = {"retries": 0, "backoff": 0.01, "timeout": httpx.Timeout(5.0)}


@dataclass
class Files:
    """A loopback server: ``/files/<name>`` is a GGUF, ``/redirect/<name>`` a 302 to
    ``location``. It records each request's path and Host header."""

    base: str = ""
    location: str = ""
    seen: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        self.seen.append((h.path, h.headers.get("Host")))
        if h.path.startswith("/redirect/"):
            h.send_response(302)
            h.send_header("Location", self.location)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(200)
        h.send_header("Content-Length", str(len(BODY)))
        h.end_headers()
        h.wfile.write(BODY)


@pytest.fixture
def files() -> Iterator[Files]:
    server = Files()
    with http_server(server.handle) as base:
        server.base = base
        yield server


class FakeDNS:
    """The running loop's getaddrinfo, answering the names of ``answers`` (a list of
    addresses, or a function of the number of earlier questions for that name).
    IP addresses and ``localhost`` go to the real one (no lookup leaves the machine);
    any other name fails."""

    def __init__(self, answers: dict[str, list[str] | Callable[[int], list[str]]]) -> None:
        self.loop = asyncio.get_running_loop()
        self.real = self.loop.getaddrinfo
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, host: Any, port: Any, **kwargs: Any) -> list[Any]:
        name = host.decode() if isinstance(host, bytes) else str(host)
        answer = self.answers.get(name)
        if answer is None:
            if name != "localhost" and not _is_ip(name):
                raise socket.gaierror(socket.EAI_NONAME, f"fake DNS: no {name!r}")
            return await self.real(host, port, **kwargs)
        self.asked.append(name)
        addresses = answer(self.asked.count(name) - 1) if callable(answer) else answer
        return [
            (
                socket.AF_INET6 if ":" in a else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (a, port, 0, 0) if ":" in a else (a, port),
            )
            for a in addresses
        ]


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return True


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeDNS]:
    def install(**answers: list[str] | Callable[[int], list[str]]) -> FakeDNS:
        fake = FakeDNS({name.replace("_", "."): a for name, a in answers.items()})
        monkeypatch.setattr(fake.loop, "getaddrinfo", fake)
        return fake

    return install


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every address httpcore's own backend is asked to connect to; none is connected."""
    seen: list[str] = []

    async def refuse(self: Any, host: str, port: int, **kwargs: Any) -> Any:
        seen.append(host)
        raise AssertionError(f"a connection to {host}:{port} was attempted")

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", refuse)
    return seen


class ToLoopback(httpcore.AnyIOBackend):
    """An inner backend: :data:`PUBLIC` goes to the loopback file server, nothing else."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.asked: list[tuple[str, int]] = []

    async def connect_tcp(self, host: str, port: int, **kwargs: Any) -> Any:
        self.asked.append((host, port))
        assert (host, port) == (PUBLIC, self.port), f"connection to {host}:{port}"
        return await super().connect_tcp("127.0.0.1", port, **kwargs)


Make = Callable[..., DownloadManager]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    """``make(**kwargs)``: a manager into ``tmp_path/<models>`` (default ``models``),
    closed after the test; by default private addresses are refused and it has its
    own checking client."""
    made: list[DownloadManager] = []

    def make(models: str = "models", **kwargs: Any) -> DownloadManager:
        made.append(DownloadManager(tmp_path / models, **{**FAST, **kwargs}))
        return made[-1]

    yield make
    for downloads in made:
        await downloads.close()


@pytest.fixture
def downloads(make: Make) -> DownloadManager:
    return make()


async def finish(job: DownloadJob) -> DownloadJob:
    await asyncio.wait_for(job.wait(), 10)
    return job


async def through_public(
    make: Make, files: Files, url: str, **transport: Any
) -> tuple[DownloadJob, ToLoopback]:
    """Download ``url`` through the checking transport, with :class:`ToLoopback` to
    connect: the job when it ended, and the connections asked for."""
    inner = ToLoopback(files.port)
    client = httpx.AsyncClient(
        transport=public_only_transport(inner, **transport), follow_redirects=True
    )
    async with client:
        return await finish(await make(client=client).start(url)), inner


async def refused(downloads: DownloadManager, url: str) -> str:
    """The message of the refusal to download ``url``; no job was started."""
    before = downloads.jobs()
    with pytest.raises(DownloadNotAllowed) as info:
        await downloads.start(url)
    assert info.value.param == "url"
    assert downloads.jobs() == before
    return str(info.value.message)


# -- at request time ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "[::1]",
        "0x7f000001",
        "2130706433",
        "127.1",
        "localhost",
        "LocalHost",
        "[::ffff:127.0.0.1]",
        "0.0.0.0",
        "[::]",
    ],
)
async def test_loopback_urls_are_refused_before_a_job(
    downloads: DownloadManager, files: Files, connects: list[str], host: str
) -> None:
    message = await refused(downloads, f"http://{host}:{files.port}/files/x.gguf")
    assert "not a public address" in message and "resolves to" in message
    assert files.seen == [] and connects == []


@pytest.mark.parametrize(
    ("name", "address"),
    [
        ("metadata.google.internal", "169.254.169.254"),
        ("metadata.aws.test", "fd00:ec2::254"),
        ("intranet.test", "10.1.2.3"),
        ("router.test", "192.168.1.1"),
        ("cgnat.test", "100.100.100.200"),
        ("oracle.test", "192.0.0.192"),
        ("linklocal6.test", "fe80::1"),
        ("multicast.test", "224.0.0.251"),
        ("mapped.test", "::ffff:10.0.0.1"),
        ("nat64.test", "64:ff9b::a9fe:a9fe"),  # 169.254.169.254 behind NAT64
    ],
)
async def test_names_resolving_to_private_addresses_are_refused_before_connecting(
    downloads: DownloadManager,
    dns: Callable[..., FakeDNS],
    connects: list[str],
    name: str,
    address: str,
) -> None:
    fake = dns(**{name: [address]})
    message = await refused(downloads, f"http://{name}/models/x.gguf")
    assert f"{name!r} resolves to {address}" in message
    assert fake.asked == [name] and connects == []


async def test_one_private_address_among_public_ones_is_enough_to_refuse(
    downloads: DownloadManager, dns: Callable[..., FakeDNS], connects: list[str]
) -> None:
    dns(mixed_test=[PUBLIC, "2606:4700::1111", "127.0.0.1"])
    assert "resolves to 127.0.0.1" in await refused(downloads, "https://mixed.test/x.gguf")
    assert connects == []


async def test_bad_urls_are_refused_before_any_lookup(
    downloads: DownloadManager, dns: Callable[..., FakeDNS]
) -> None:
    fake = dns(page_test=[PUBLIC])
    with pytest.raises(InvalidRequest) as info:
        await downloads.start("https://page.test/org/repo")  # not a .gguf
    assert not isinstance(info.value, DownloadNotAllowed) and info.value.param == "url"
    with pytest.raises(InvalidRequest) as info:
        await downloads.start("https://page.test/x.gguf", sha256="abc")
    assert info.value.param == "sha256"
    assert fake.asked == []


# -- at connect time ----------------------------------------------------------------------


async def test_a_changed_dns_answer_is_refused_at_connect_time(
    downloads: DownloadManager, dns: Callable[..., FakeDNS], connects: list[str]
) -> None:
    """DNS rebinding: public when the request is checked, loopback when connecting."""
    fake = dns(rebind_test=lambda n: [PUBLIC] if n == 0 else ["127.0.0.1"])
    job = await finish(await downloads.start("http://rebind.test:8080/x.gguf"))
    assert job.status == "failed"
    assert job.error is not None
    assert "'rebind.test' resolves to 127.0.0.1" in job.error.message
    assert "redirect, or a DNS answer that changed" in job.error.message
    assert fake.asked == ["rebind.test", "rebind.test"]  # asked again, then no retry
    assert connects == []


async def test_a_name_that_does_not_resolve_yet_is_left_to_the_job(
    downloads: DownloadManager, dns: Callable[..., FakeDNS], connects: list[str]
) -> None:
    dns()  # every name fails
    job = await finish(await downloads.start("http://nowhere.test/x.gguf"))
    assert job.status == "failed"
    assert job.error is not None and "cannot resolve 'nowhere.test'" in job.error.message
    assert connects == []


@pytest.mark.parametrize("target", ["127.0.0.1", "localhost", "[::1]", "internal.test"])
async def test_a_redirect_to_a_private_address_is_refused(
    tmp_path: Path, make: Make, files: Files, dns: Callable[..., FakeDNS], target: str
) -> None:
    """The first server passes as public (fake DNS; its connection goes to loopback
    through :class:`ToLoopback`); its redirect target is checked and refused before
    a connection, so nothing but that one loopback connection is made."""
    dns(files_test=[PUBLIC], internal_test=["10.0.0.7"])
    files.location = f"http://{target}:{files.port}/files/x.gguf"
    job, inner = await through_public(
        make, files, f"http://files.test:{files.port}/redirect/x.gguf"
    )
    assert job.status == "failed"
    assert job.error is not None and "not a public address" in job.error.message
    assert files.seen == [("/redirect/x.gguf", f"files.test:{files.port}")]  # no retry
    assert inner.asked == [(PUBLIC, files.port)]
    assert not (tmp_path / "models" / "x.gguf").exists()


async def test_a_redirect_to_a_public_address_is_followed(
    tmp_path: Path, make: Make, files: Files, dns: Callable[..., FakeDNS]
) -> None:
    """The control for the test above: the checking transport downloads, each
    request's Host header names the host of its URL (not the address connected)."""
    dns(files_test=[PUBLIC], cdn_test=[PUBLIC])
    files.location = f"http://cdn.test:{files.port}/files/x.gguf"
    job, inner = await through_public(
        make, files, f"http://files.test:{files.port}/redirect/x.gguf"
    )
    assert job.status == "completed", job.error
    assert (tmp_path / "models" / "x.gguf").read_bytes() == BODY
    assert files.seen == [
        ("/redirect/x.gguf", f"files.test:{files.port}"),
        ("/files/x.gguf", f"cdn.test:{files.port}"),
    ]
    assert inner.asked == [(PUBLIC, files.port)] * 2


# -- the switches -------------------------------------------------------------------------


async def test_allow_private_downloads_from_loopback(make: Make, files: Files) -> None:
    job = await finish(await make(allow_private=True).start(f"{files.base}/files/x.gguf"))
    assert job.status == "completed", job.error
    assert files.seen == [("/files/x.gguf", f"127.0.0.1:{files.port}")]


async def test_allowed_hosts(make: Make, files: Files, dns: Callable[..., FakeDNS]) -> None:
    dns()  # no name resolves: a refusal that came too late would not look anything up
    port = files.port
    allowed = f"models.example, 127.0.0.1:{port}"
    downloads = make("a", allow_private=True, allowed_hosts=allowed)
    job = await finish(await downloads.start(f"http://127.0.0.1:{port}/files/x.gguf"))
    assert job.status == "completed", job.error
    for url in (
        f"http://localhost:{port}/files/y.gguf",  # the same server, another name
        f"http://127.0.0.1:{port + 1}/files/y.gguf",  # another port
        "https://evil.example/models.example/y.gguf",
        "https://models.example.evil.example/y.gguf",
    ):
        assert "not on this server's allowed hosts" in await refused(downloads, url)
    assert len(files.seen) == 1
    # On the list is not enough: the address must still be public.
    message = await refused(make("b", allowed_hosts=allowed), f"http://127.0.0.1:{port}/x.gguf")
    assert "not a public address" in message
    assert len(files.seen) == 1


async def test_a_redirect_to_a_host_off_the_list_is_refused(make: Make, files: Files) -> None:
    """Every hop is checked against --download-allowed-hosts, not only the first URL:
    the redirect's own request never leaves (the loopback server sees only the first)."""
    port = files.port
    downloads = make(allow_private=True, allowed_hosts=f"127.0.0.1:{port}")
    files.location = f"http://localhost:{port}/files/x.gguf"  # the same server, another name
    job = await finish(await downloads.start(f"http://127.0.0.1:{port}/redirect/x.gguf"))
    assert job.status == "failed"
    assert job.error is not None and "'localhost'" in job.error.message
    assert "not on this server's allowed hosts" in job.error.message
    assert files.seen == [("/redirect/x.gguf", f"127.0.0.1:{port}")]
    files.location = f"http://127.0.0.1:{port}/files/x.gguf"  # the control: on the list
    job = await finish(await downloads.start(f"http://127.0.0.1:{port}/redirect/x.gguf"))
    assert job.status == "completed", job.error


def test_a_domain_entry_allows_the_names_below_it() -> None:
    from sluice.core.addresses import host_allowed

    assert host_allowed("cas-bridge.xethub.hf.co", 443, "huggingface.co,*.hf.co")
    assert host_allowed("CDN.HF.CO.", 443, "*.hf.co:443")
    assert not host_allowed("hf.co", 443, "*.hf.co")  # below the domain only
    assert not host_allowed("evilhf.co", 443, "*.hf.co")
    assert not host_allowed("x.hf.co", 80, "*.hf.co:443")


@dataclass
class Proxy:
    """A loopback HTTP proxy that answers every absolute-form request itself with the
    GGUF (it never connects anywhere): it records the URLs it was asked for."""

    base: str = ""
    asked: list[str] = field(default_factory=list)

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        self.asked.append(h.path)
        h.send_response(200)
        h.send_header("Content-Length", str(len(BODY)))
        h.end_headers()
        h.wfile.write(BODY)


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxy]:
    server = Proxy()
    with http_server(server.handle) as base:
        server.base = base
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
            monkeypatch.delenv(var, raising=False)
            monkeypatch.delenv(var.lower(), raising=False)
        monkeypatch.setenv("HTTP_PROXY", base)
        yield server


async def test_a_proxy_is_honoured_with_the_rule_on_the_target(
    tmp_path: Path, make: Make, proxy: Proxy, dns: Callable[..., FakeDNS]
) -> None:
    """HTTP_PROXY: the proxy (on loopback) makes the connection; the target host must
    still resolve to public addresses, checked here before the proxy is asked."""
    dns(models_test=[PUBLIC], intranet_test=["10.1.2.3"])
    downloads = make()
    job = await finish(await downloads.start("http://models.test/files/x.gguf"))
    assert job.status == "completed", job.error
    assert (tmp_path / "models" / "x.gguf").read_bytes() == BODY
    assert proxy.asked == ["http://models.test/files/x.gguf"]
    message = await refused(downloads, "http://intranet.test/files/y.gguf")
    assert "not a public address" in message
    assert proxy.asked == ["http://models.test/files/x.gguf"]  # never asked for it


async def test_allowed_hosts_names_ignore_case_and_a_final_dot(
    make: Make, dns: Callable[..., FakeDNS], connects: list[str]
) -> None:
    dns(models_example=["10.0.0.1"])
    message = await refused(make(allowed_hosts="Models.Example."), "https://MODELS.example/x.gguf")
    assert "resolves to 10.0.0.1" in message  # passed the list, then the address check


# -- TLS ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("certified", "completes"), [("files.test", True), ("other.test", False)])
async def test_tls_checks_the_url_host_though_the_connection_is_by_address(
    tmp_path: Path, make: Make, dns: Callable[..., FakeDNS], certified: str, completes: bool
) -> None:
    """The checking transport connects to the checked address by number; TLS still
    sends the URL's host as SNI and verifies the certificate against it."""
    ca, cert, key = certificates(tmp_path, certified)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    sni: list[str | None] = []

    def note_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        sni.append(name)

    server_tls.sni_callback = note_sni
    files = Files()
    with http_server(files.handle, tls=server_tls) as base:
        files.base = base
        dns(files_test=[PUBLIC])
        verify = ssl.create_default_context(cafile=str(ca))
        url = f"https://files.test:{files.port}/files/x.gguf"
        job, inner = await through_public(make, files, url, verify=verify)
    assert sni and set(sni) == {"files.test"}
    assert inner.asked and set(inner.asked) == {(PUBLIC, files.port)}
    if completes:
        assert job.status == "completed", job.error
        assert files.seen == [("/files/x.gguf", f"files.test:{files.port}")]
    else:
        assert job.status == "failed"
        assert job.error is not None and "CERTIFICATE_VERIFY_FAILED" in job.error.message
        assert files.seen == []
