"""A TCP relay that records what the server behind it sends back, to check passthrough
byte for byte against what an upstream really said."""

from __future__ import annotations

import re
import socket
import threading
import time


class Relay:
    """A TCP relay to ``target`` that records, per connection, what the target sends."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.recorded: list[bytearray] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            record = bytearray()
            with self.lock:
                self.recorded.append(record)
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, record), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if record is not None:
                    with self.lock:
                        record.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def bodies(self) -> list[bytes]:
        """Every complete response body the target sent so far (dechunked)."""
        with self.lock:
            streams = [bytes(r) for r in self.recorded]
        out: list[bytes] = []
        for data in streams:
            out.extend(_responses(data))
        return out

    def sent(self, body: bytes, within: float = 5.0) -> bool:
        """Whether the target sent exactly ``body`` (waiting ``within`` seconds for it)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if body in self.bodies():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.server.close()


def _responses(data: bytes) -> list[bytes]:
    bodies = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        headers = head.decode("latin-1").lower()
        if "transfer-encoding: chunked" in headers:
            body = bytearray()
            while True:
                size_line, sep, rest = rest.partition(b"\r\n")
                if not sep:
                    return bodies
                size = int(size_line.split(b";")[0], 16)
                if len(rest) < size + 2:
                    return bodies
                body += rest[:size]
                rest = rest[size + 2 :]
                if size == 0:
                    break
            bodies.append(bytes(body))
        else:
            match = re.search(r"content-length: (\d+)", headers)
            size = int(match.group(1)) if match else 0
            if len(rest) < size:
                return bodies
            bodies.append(rest[:size])
            rest = rest[size:]
        data = rest
    return bodies
