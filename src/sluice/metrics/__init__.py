"""Live per-slot metrics, measured on the streaming path (local and upstream alike).

One :class:`Metrics` per app owns a private Prometheus registry and one
:class:`SlotMetrics` per slot. Each request through a slot gets a
:class:`RequestMeter`; :func:`metered` drives one from a backend's event stream
and :class:`OpenAIChunkTap` drives one from an OpenAI upstream's passthrough
chunks. Everything here runs on the event loop (no locks on the token path).

Example::

    metrics = Metrics()
    stream = metered(await backend.open(request), metrics.slot("qwen", "local").request())
    async for event in stream:
        ...
    body, content_type = metrics.render()    # GET /metrics
    metrics.snapshot()["qwen"]["tokens_per_second"]

Decisions worth knowing:

* ``tokens_per_second`` is the output tokens of the last ``window`` seconds
  (whole one-second buckets: the current partial second plus ``ceil(window) - 1``
  full ones) divided by the time they cover: from the later of that window's
  first bucket and the start of the current burst of activity (the first token
  after at least ``window`` seconds without any) up to now, but at least one
  second. So an idle slot reads 0, a one-second burst right after start reads
  its own rate (not a tenth of it), and the first token alone does not read as
  thousands per second.
* TTFT ``p50``/``p95`` are nearest-rank percentiles over the TTFTs observed in
  the last ``window`` seconds (at most :data:`TTFT_SAMPLES` of them); ``last``
  is the newest of those. All three are ``None`` when there are none.
* ``tokens_out`` is live (per streamed token) and corrected to the exact usage
  count when a request finishes. The JSON figure follows the correction both
  ways; the Prometheus counter must never go down, so a downward correction
  holds it flat until the true total catches up.
* A client disconnect (``aclose`` before the end) is not a slot error; an
  ``ErrorEvent``, an exception from the backend or an upstream ``error`` object is.
"""

from sluice.metrics.slots import (
    CONTENT_TYPE,
    DURATION_BUCKETS,
    TTFT_BUCKETS,
    TTFT_SAMPLES,
    Metrics,
    RequestMeter,
    SlotKind,
    SlotMetrics,
)
from sluice.metrics.stream import MeteredStream, metered
from sluice.metrics.taps import (
    AnthropicEventTap,
    GeminiRecordTap,
    OpenAIChunkTap,
    ResponsesEventTap,
)

__all__ = [
    "CONTENT_TYPE",
    "DURATION_BUCKETS",
    "TTFT_BUCKETS",
    "TTFT_SAMPLES",
    "AnthropicEventTap",
    "GeminiRecordTap",
    "MeteredStream",
    "Metrics",
    "OpenAIChunkTap",
    "RequestMeter",
    "ResponsesEventTap",
    "SlotKind",
    "SlotMetrics",
    "metered",
]
