"""Which network addresses a request may make the server connect to.

The check behind every outbound connection a client chooses the address of: the
MCP client's ephemeral servers (:mod:`sluice.tools.mcp_servers`) and model
downloads (:mod:`sluice.models.downloads`). A host is public when every address
it resolves to is: not loopback, private, link-local (cloud metadata services
live there), reserved, multicast or unspecified. Each caller checks twice: when
the request comes (a clear error naming the field) and when it connects
(:class:`PublicOnlyConnector`, to the checked addresses only, so a DNS answer
that changes in between, or a redirect, cannot reach an address never checked).

Example::

    addresses = await public_addresses("example.com", 443)   # NotPublic, OSError
    host_allowed("Example.com", 443, "example.com,models.lan:8080")   # True
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterable
from typing import Any

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Refused whatever this Python's ipaddress thinks of them (its tables change between
# releases): the IETF block 192.0.0.0/24 (Oracle Cloud's legacy metadata service is
# 192.0.0.192) and the shared space 100.64.0.0/10 (Alibaba Cloud's is 100.100.100.200).
_NOT_PUBLIC = (ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("100.64.0.0/10"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # an IPv4 address behind a NAT64 gateway

_WHAT_IS_NOT_PUBLIC = "loopback, private, link-local, reserved, multicast or unspecified"


class NotPublic(Exception):
    """``host`` resolves to ``address``, which is not a public address."""

    def __init__(self, host: str, address: str) -> None:
        super().__init__(
            f"{host!r} resolves to {address}, which is not a public address ({_WHAT_IS_NOT_PUBLIC})"
        )
        self.host = host
        self.address = address


def is_public(ip: IPAddress) -> bool:
    """Whether ``ip`` is a globally reachable unicast address. An IPv6 address that
    carries an IPv4 one (mapped, 6to4, NAT64) is judged as that IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64:
            return is_public(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.ipv4_mapped is not None:
            return is_public(ip.ipv4_mapped)
        if ip.sixtofour is not None and not is_public(ip.sixtofour):
            return False
    elif any(ip in net for net in _NOT_PUBLIC):
        return False
    return ip.is_global and not (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_reserved
        or ip.is_multicast
        or ip.is_unspecified
    )


async def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` stands for: itself when it is an IP address, else the
    loop's getaddrinfo (which also reads forms like ``0x7f000001`` and ``127.1``).
    ``OSError`` when the name does not resolve."""
    host = host.strip("[]")
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def public_addresses(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, all of them public.

    Raises :class:`NotPublic` naming the first address that is not; ``OSError``
    when the name does not resolve.
    """
    addresses = await resolve(host, port)
    for address in addresses:
        if not is_public(ipaddress.ip_address(address.split("%", 1)[0])):
            raise NotPublic(host.strip("[]"), address)
    return addresses


class PublicOnlyConnector:
    """A network backend for an httpcore connection pool that connects to public
    addresses only: it resolves the host itself, checks every address, and asks
    ``inner`` (the library's own backend) to connect to a checked address by number.
    The address connected is the address checked, for every connection the pool
    opens (a redirect's too); TLS still names and verifies the URL's host, which
    httpcore takes from the request, not from the socket.

    No HTTP library is imported here: httpcore and its fork httpcore2 (the MCP
    SDK's) have the same interface, and their errors are given. A caller mixes
    this into the library's base class to install it::

        class Backend(PublicOnlyConnector, httpcore.AsyncNetworkBackend): ...
        pool._network_backend = Backend(httpcore.AnyIOBackend(), connect_error=...,
                                        connect_timeout=...)

    A refused address raises :class:`NotPublic` out of the request, or what
    ``refused`` makes of it; a name that does not resolve (in ``timeout``, the
    pool's connect timeout) is a ``connect_error`` (``connect_timeout``).
    """

    def __init__(
        self,
        inner: Any,
        *,
        connect_error: type[Exception],
        connect_timeout: type[Exception],
        refused: Callable[[NotPublic], Exception] | None = None,
    ) -> None:
        self._inner = inner
        self._connect_error = connect_error
        self._connect_timeout = connect_timeout
        self._refused = refused

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> Any:
        try:
            async with asyncio.timeout(timeout):
                checked = await public_addresses(host, port)
        except NotPublic as exc:
            if self._refused is None:
                raise
            raise self._refused(exc) from exc
        except TimeoutError as exc:
            raise self._connect_timeout(f"resolving {host!r} timed out") from exc
        except OSError as exc:
            raise self._connect_error(f"cannot resolve {host!r}: {exc}") from exc
        error: Exception = self._connect_error(f"no address for {host!r}")
        for address in checked:
            try:
                return await self._inner.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (self._connect_error, self._connect_timeout) as exc:
                error = exc
        raise error

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def host_allowed(host: str, port: int, allowed_hosts: str) -> bool:
    """Whether ``host`` (on ``port``) is on ``"host,host:port,[v6]:port,*.domain,..."``;
    an entry without a port allows any, ``*.domain`` any name below ``domain`` (not the
    domain itself). Names compare without case or a final dot."""
    host = host.strip("[]").rstrip(".").lower()
    for entry in (e.strip().lower() for e in allowed_hosts.split(",")):
        if not entry:
            continue
        if entry.startswith("["):  # [v6] or [v6]:port
            name, _, rest = entry[1:].partition("]")
            entry_port = rest[1:] if rest.startswith(":") else ""
        elif entry.count(":") == 1:
            name, _, entry_port = entry.partition(":")
        else:
            name, entry_port = entry, ""
        name = name.rstrip(".")
        if name.startswith("*."):
            matches = host.endswith(name[1:]) and len(host) > len(name) - 1
        else:
            matches = name == host
        if matches and entry_port in ("", str(port)):
            return True
    return False
