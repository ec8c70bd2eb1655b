"""GET /metrics: the app's Prometheus text exposition.

Example::

    Route("/metrics", metrics, methods=["GET"])
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from sluice.serving.metrics import Metrics


async def metrics(request: Request) -> Response:
    """The per-slot counters, gauges and histograms of this app's ``Metrics``."""
    app_metrics: Metrics = request.app.state.sluice.metrics
    body, content_type = app_metrics.render()
    return Response(body, media_type=content_type)
