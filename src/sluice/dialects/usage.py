"""``GET /v1/usage``: requests and tokens per API key, model and day (UTC).

An admin key sees every key's (``?key=`` picks one); a user key sees its own, and asking
for another's is a 403. ``?model=`` picks a model, ``?since=`` and ``?until=`` bound the
days (``YYYY-MM-DD``, inclusive). Each row counts the requests that reached the model,
the ``usage`` they were answered with (prompt, cached and completion tokens) and those
that ended in an error; ``totals`` sums the rows.

Example::

    GET /v1/usage?since=2026-11-01
    {"object": "list", "data": [{"object": "usage", "key": "ci", "model": "qwen",
      "date": "2026-11-29", "requests": 3, "prompt_tokens": 120, "cached_tokens": 64,
      "completion_tokens": 30, "total_tokens": 150, "errors": 0}],
     "totals": {"requests": 3, ...}}
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import InvalidRequest, PermissionDenied
from sluice.server.auth import is_admin, key_name
from sluice.server.sse import json_response
from sluice.server.state import server_state
from sluice.store import UsageRow

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")


def _day(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    if value is not None and not _DAY.fullmatch(value):
        raise InvalidRequest(f"'{name}' must be a day as YYYY-MM-DD, not {value!r}", param=name)
    return value


def _row(row: UsageRow) -> dict[str, Any]:
    return {
        "object": "usage",
        "key": row.key,
        "model": row.model,
        "date": row.day,
        **{field: getattr(row, field) for field in _COUNTS},
        "total_tokens": row.prompt_tokens + row.completion_tokens,
    }


async def usage(request: Request) -> Response:
    state = server_state(request)
    caller = key_name(request)
    asked = request.query_params.get("key")
    if is_admin(request):
        key = asked
    elif asked is not None and asked != caller:
        raise PermissionDenied(f"The key '{caller}' may see only its own usage.")
    else:
        key = caller
    since, until = _day(request, "since"), _day(request, "until")
    model = request.query_params.get("model")
    assert state.usage is not None, "the ledger opens with the store, before any request"
    rows = await state.usage.rows(key=key, since=since, until=until)
    data = [_row(r) for r in rows if model is None or r.model == model]
    totals = {field: sum(r[field] for r in data) for field in (*_COUNTS, "total_tokens")}
    return json_response({"object": "list", "data": data, "totals": totals})
