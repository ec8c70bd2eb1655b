"""An incremental SSE decoder that keeps each event's bytes exactly as received.

A gateway forwards an upstream's events unchanged (byte-exact passthrough) while it reads
them for metrics and usage, so every message carries its ``raw`` bytes: the
``raw`` of consecutive messages concatenated is exactly the input consumed,
and :meth:`SSEDecoder.pending` is the rest.

Parsing follows the WHATWG rules (``text/event-stream``): lines end with
``\\n``, ``\\r\\n`` or ``\\r``; a blank line ends an event; ``field: value``
with one optional space after the colon; a line without a colon is a field
with an empty value; ``:`` starts a comment; a UTF-8 BOM at the very start is
ignored. Unlike a browser, every blank line yields a message, also one with
no data (a comment-only keep-alive, a stray blank line), because its bytes
must still be forwarded; such messages have ``data == ""`` and no ``event``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.core.errors import UpstreamMalformed

_BOM = b"\xef\xbb\xbf"
# One line terminator; a CR followed by LF is one terminator (CRLF), never two.
_EOL = rb"(?:\r\n|\r(?!\n)|\n)"
_EOL_RE = re.compile(_EOL)
# The end of an event: the end of a line followed by a blank line.
_END_RE = re.compile(_EOL + _EOL)
_LINES_RE = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class SSEMessage:
    """One event: its bytes as received and its decoded ``event`` and ``data`` fields.

    Example::

        SSEMessage(raw=b"data: hi\\n\\n", event=None, data="hi")
    """

    raw: bytes  # up to and including the terminating blank line
    event: str | None  # the ``event:`` field (the last one), None if absent or empty
    data: str  # the ``data:`` lines joined with "\n"; "" if none


class SSEDecoder:
    """Feed it the body's chunks as they arrive; get every event each chunk completes.

    Example::

        decoder = SSEDecoder()
        decoder.feed(b"data: {\\"a\\": 1}\\n\\ndata: [DO")  # [SSEMessage(data='{"a": 1}')]
        decoder.feed(b"NE]\\n\\n")  # [SSEMessage(data='[DONE]')]
        decoder.pending()  # b""

    An incomplete event held back beyond ``max_pending`` bytes raises
    :class:`~sluice.core.errors.UpstreamMalformed` (an upstream that never ends an
    event must not grow memory without bound).
    """

    __slots__ = ("_bom_checked", "_buf", "_cr_end", "_max", "_scan", "_skip")

    def __init__(self, max_pending: int = 16 * 2**20) -> None:
        self._buf = b""
        self._scan = 0  # where to resume looking for the event's end within _buf
        self._max = max_pending
        self._bom_checked = False
        self._skip = 0  # bytes at the start of _buf not parsed (the BOM)
        # The last event ended with a CR at the end of a chunk: an LF first in the
        # next chunk is the second half of that CRLF, not a blank line of its own.
        self._cr_end = False

    def pending(self) -> bytes:
        """The bytes of the incomplete event held back (not yet in any message)."""
        return self._buf

    def between_events(self) -> bool:
        """Nothing held back and nothing special pending (a BOM, half a CRLF): the next
        chunk starts a new event, so a caller may split plain ``data:`` events itself."""
        return not self._buf and self._bom_checked and not self._cr_end

    def feed(self, chunk: bytes) -> list[SSEMessage]:
        """Every event completed by ``chunk``, in order; the incomplete rest is kept."""
        out: list[SSEMessage] = []
        if not chunk:
            return out
        if self._cr_end:
            self._cr_end = False
            if chunk[0] == 0x0A:
                # Its bytes still have to go somewhere: a message with no fields.
                out.append(SSEMessage(b"\n", None, ""))
                chunk = chunk[1:]
                if not chunk:
                    return out
        old = len(self._buf)
        buf = self._buf + chunk if old else chunk
        if not self._bom_checked:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._buf = buf  # maybe a BOM: wait for its other bytes
                return out
            self._bom_checked = True
            if buf.startswith(_BOM):
                self._skip = len(_BOM)
        pos = 0  # start of the current event in buf
        # A pair of terminators is at most 4 bytes: resume 3 bytes before the new data.
        scan = max(self._scan, old - 3, 0)
        has_cr = b"\r" in buf
        while True:
            start = pos + self._skip
            if start >= len(buf):
                break
            end = self._event_end(buf, start, scan, has_cr)
            if end < 0:
                break
            raw = buf[pos:end]
            out.append(_message(raw, self._skip, has_cr))
            self._skip = 0
            pos = scan = end
        if pos:
            buf = buf[pos:]
            scan -= pos
        self._buf = buf
        self._scan = max(scan, 0)
        if out and not buf and out[-1].raw.endswith(b"\r"):
            self._cr_end = True
        if len(buf) > self._max:
            raise UpstreamMalformed(
                f"an SSE event grew over {self._max} bytes without its end (a blank line)"
            )
        return out

    @staticmethod
    def _event_end(buf: bytes, start: int, scan: int, has_cr: bool) -> int:
        """The end of the event starting at ``start`` (after its blank line), or -1."""
        if not has_cr:  # the common case: LF only, plain find
            if buf[start] == 0x0A:  # a blank line right away
                return start + 1
            i = buf.find(b"\n\n", max(scan, start))
            return -1 if i < 0 else i + 2
        m = _EOL_RE.match(buf, start)
        if m is not None:
            # A blank line right away. A lone CR at the very end is complete too (a
            # CR or the start of a CRLF, a blank line either way): feed remembers that
            # an LF may follow.
            return m.end()
        m = _END_RE.search(buf, max(scan, start))
        return -1 if m is None else m.end()


def _message(raw: bytes, skip: int, has_cr: bool) -> SSEMessage:
    """The fields of one complete event (``raw[skip:]``; ``skip`` passes over a BOM)."""
    body = raw[skip:] if skip else raw
    # Fast path: one `data: ...` line, the shape of nearly every token chunk.
    if (
        body.startswith(b"data: ")
        and body.endswith(b"\n\n")
        and body.count(b"\n") == 2
        and (not has_cr or b"\r" not in body)
    ):
        return SSEMessage(raw, None, body[6:-2].decode("utf-8", "replace"))
    text = body.decode("utf-8", "replace")
    lines = _LINES_RE.split(text) if has_cr else text.split("\n")
    event: str | None = None
    data: list[str] = []
    for line in lines:
        if not line or line[0] == ":":
            continue
        name, colon, value = line.partition(":")
        if colon:
            value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value or None
    return SSEMessage(raw, event, "\n".join(data))
