"""``GET /v1/requests`` and ``POST /v1/requests/{id}/cancel``: the requests in flight.

Each key sees its own requests; an admin key (role = "admin", or a key named ``admin``) sees and cancels
everyone's (without keys, every caller is the same anonymous caller and
sees all). The id is the response id the client already has
(``chatcmpl-...``, ``msg_...``, ``resp_...``), or ``req_...`` for answers
that carry none (Ollama's). Cancelling ends the generation on the server:
the client's stream ends with a ``request_cancelled`` error in its dialect
(a 499 if nothing was sent yet), and the slot frees at once.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import RequestNotFound
from sluice.server.auth import is_admin, key_name
from sluice.server.sse import json_response
from sluice.server.state import server_state


def _viewer(request: Request) -> str | None:
    """The key whose requests the caller may see; None: everyone's (an admin key's view,
    and a server without keys)."""
    key = key_name(request)
    return None if key == "" or is_admin(request) else key


async def list_requests(request: Request) -> Response:
    flights = server_state(request).dispatcher.flights
    return json_response({"object": "list", "data": flights.list(_viewer(request))})


async def cancel_request(request: Request) -> Response:
    flights = server_state(request).dispatcher.flights
    request_id = request.path_params["request_id"]
    flight = flights.get(request_id)
    viewer = _viewer(request)
    if flight is None or (viewer is not None and flight.caller.key != viewer):
        raise RequestNotFound(request_id)  # someone else's is not found either
    entry = flight.snapshot(flights.now())
    cancelled = flights.cancel(flight, by=key_name(request))
    return json_response(entry | {"state": "cancelled" if cancelled else "ended"})
