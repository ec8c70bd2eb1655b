"""Reading a request body within the size limit.

Example::

    raw = await read_body(request, limit=8 * 1024 * 1024)   # BodyTooLarge past the limit
"""

from __future__ import annotations

from starlette.requests import Request

from sluice.errors import BodyTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"The request body is {declared} bytes; the limit is {limit}.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"The request body is over the limit of {limit} bytes.")
    return bytes(body)
