"""The address checks shared by the MCP client and model downloads (sluice.core.addresses).

Only literal addresses, loopback names and a stubbed resolver: no lookup leaves
the machine, no connection is made.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import pytest

from sluice.core.addresses import (
    NotPublic,
    PublicOnlyConnector,
    host_allowed,
    is_public,
    public_addresses,
    resolve,
)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.255.0.9",
        "::1",
        "0.0.0.0",
        "::",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # AWS, GCP, Azure metadata
        "fd00:ec2::254",  # AWS metadata over IPv6
        "100.100.100.200",  # Alibaba Cloud metadata (shared address space)
        "192.0.0.192",  # Oracle Cloud's legacy metadata (IETF protocol block)
        "fe80::1",
        "fc00::1",
        "224.0.0.1",
        "ff02::1",
        "240.0.0.1",
        "255.255.255.255",
        "198.18.0.1",  # benchmarking
        "192.0.2.1",  # documentation
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:169.254.169.254",
        "64:ff9b::7f00:1",  # 127.0.0.1 through NAT64
        "2002:a9fe:a9fe::1",  # 169.254.169.254 through 6to4
        "::127.0.0.1",  # IPv4-compatible (deprecated)
    ],
)
def test_not_public(address: str) -> None:
    assert not is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address",
    [
        "93.184.215.14",
        "8.8.8.8",
        "2606:4700::1111",
        "::ffff:93.184.215.14",
        "64:ff9b::5db8:d70e",  # a public IPv4 address through NAT64
        "2002:5db8:d70e::1",  # and through 6to4
    ],
)
def test_public(address: str) -> None:
    assert is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]", "::1"),
        ("0x7f000001", "127.0.0.1"),  # getaddrinfo reads the other IPv4 notations
        ("2130706433", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("localhost", None),
    ],
)
async def test_loopback_forms_are_refused(host: str, address: str | None) -> None:
    with pytest.raises(NotPublic) as info:
        await public_addresses(host, 80)
    assert info.value.host == host.strip("[]")
    if address is not None:
        assert info.value.address == address
    assert "is not a public address" in str(info.value)


async def test_resolve_asks_the_loop_for_names_only(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []

    async def getaddrinfo(host: Any, port: Any, **kwargs: Any) -> list[Any]:
        asked.append(host)
        if host != "models.test":
            raise socket.gaierror(socket.EAI_NONAME, "no such name")
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port))
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2606:4700::1111", port, 0, 0))
        return [v4, v6, v4]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    assert await resolve("93.184.215.14", 443) == ["93.184.215.14"]
    assert await resolve("[2606:4700::1111]", 443) == ["2606:4700::1111"]
    assert asked == []
    assert await public_addresses("models.test", 443) == ["93.184.215.14", "2606:4700::1111"]
    with pytest.raises(OSError):
        await public_addresses("nowhere.test", 443)
    assert asked == ["models.test", "nowhere.test"]


def test_host_allowed() -> None:
    assert host_allowed("example.com", 443, "example.com")
    assert host_allowed("Example.COM.", 80, " a.org , EXAMPLE.com. ")
    assert host_allowed("example.com", 443, "a.org,example.com:443")
    assert not host_allowed("example.com", 8443, "example.com:443")
    assert host_allowed("::1", 8080, "[::1]:8080")
    assert host_allowed("[::1]", 9, "[::1]")
    assert not host_allowed("::1", 9, "[::1]:8080")
    assert not host_allowed("evil.com", 443, "example.com")
    assert not host_allowed("example.com.evil.com", 443, "example.com")
    assert not host_allowed("example.com", 443, "")


class Refused(Exception):
    pass


class TimedOut(Exception):
    pass


class Inner:
    """A network backend that records what it is asked and fails on ``failing``."""

    def __init__(self, *failing: str) -> None:
        self.failing = failing
        self.asked: list[str] = []

    async def connect_tcp(self, host: str, port: int, **kwargs: Any) -> str:
        self.asked.append(host)
        if host in self.failing:
            raise Refused(host)
        return f"stream to {host}:{port}"


@pytest.fixture
async def names(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {
        "two.test": ["93.184.215.14", "2606:4700::1111"],
        "metadata.test": ["169.254.169.254"],
    }

    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: Any, port: Any, **kwargs: Any) -> list[Any]:
        if not host.endswith(".test"):  # 0x7f000001: read locally, no lookup
            return await real(host, port, **kwargs)
        if host == "slow.test":
            await asyncio.sleep(10)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in table[host]]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)


def connector(inner: Inner, **kwargs: Any) -> PublicOnlyConnector:
    return PublicOnlyConnector(inner, connect_error=Refused, connect_timeout=TimedOut, **kwargs)


@pytest.mark.usefixtures("names")
async def test_the_connector_connects_to_checked_addresses_in_turn() -> None:
    inner = Inner("93.184.215.14")
    assert await connector(inner).connect_tcp("two.test", 443) == "stream to 2606:4700::1111:443"
    assert inner.asked == ["93.184.215.14", "2606:4700::1111"]
    inner = Inner("93.184.215.14", "2606:4700::1111")
    with pytest.raises(Refused, match="2606:4700::1111"):  # the last failure
        await connector(inner).connect_tcp("two.test", 443)


@pytest.mark.usefixtures("names")
async def test_the_connector_refuses_before_connecting() -> None:
    inner = Inner()
    with pytest.raises(NotPublic, match="'metadata.test' resolves to 169.254.169.254"):
        await connector(inner).connect_tcp("metadata.test", 80)
    with pytest.raises(NotPublic, match="'0x7f000001' resolves to 127.0.0.1"):
        await connector(inner).connect_tcp("0x7f000001", 80)
    made = connector(inner, refused=lambda exc: Refused(f"no: {exc}"))
    with pytest.raises(Refused, match="no: '::1' resolves to ::1"):
        await made.connect_tcp("::1", 80)
    with pytest.raises(Refused, match="cannot resolve 'nowhere.test'"):
        await connector(inner).connect_tcp("nowhere.test", 80)
    with pytest.raises(TimedOut, match="resolving 'slow.test' timed out"):
        await connector(inner).connect_tcp("slow.test", 80, timeout=0.05)
    assert inner.asked == []
