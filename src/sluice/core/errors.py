"""The exception tree and the one table that maps it to the wire.

Errors are raised at their source as typed exceptions and translated at the
boundaries (HTTP status before the first byte, an in-band ``event: error``
frame after it). Nothing matches on message text.

Example::

    raise ContextOverflow(prompt_tokens=5000, n_ctx=4096)
    # -> 400, type "invalid_request_error", code "context_length_exceeded"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class SluiceError(Exception):
    """Base of every error sluice reports to a client."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        """Extra response headers this error carries (e.g. ``Retry-After``)."""
        return {}


class InvalidRequest(SluiceError):
    """The request is malformed or asks for something impossible."""


class UnsupportedParameter(InvalidRequest):
    """A known OpenAI field that sluice does not implement (yet)."""

    def __init__(self, param: str, why: str = "is not supported by this server") -> None:
        super().__init__(f"'{param}' {why}", param=param)


class ContextOverflow(InvalidRequest):
    """The prompt does not fit the model's context window."""

    def __init__(self, prompt_tokens: int, n_ctx: int, param: str = "messages") -> None:
        super().__init__(
            f"This model's maximum context length is {n_ctx} tokens, "
            f"but the prompt is {prompt_tokens} tokens. Shorten the prompt.",
            param=param,
        )
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


class TemplateError(InvalidRequest):
    """The chat template failed to render these messages."""


class MissingChatTemplate(InvalidRequest):
    """Chat was asked of a model that has no chat template."""


class BodyTooLarge(SluiceError):
    """The request body is over the configured limit.

    ``close``: the body was not read to its end, so the connection cannot
    carry another request; the 413 says ``Connection: close``.
    """

    def __init__(self, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.close = close

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"} if self.close else {}


class AuthenticationFailed(SluiceError):
    """Missing or wrong API key."""


class PermissionDenied(SluiceError):
    """The caller's key may not do this: managing models needs an admin key."""


class ModelNotFound(SluiceError):
    """The requested model is not served here."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model '{model}' does not exist or is not served here.", param="model"
        )


class NotFound(SluiceError):
    """No such route or resource."""


class JobNotFound(NotFound):
    """No download job with this id."""


class ConversationNotFound(NotFound):
    """No conversation with this id for this caller (another key's is not found either)."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"No conversation '{conversation_id}' was found.", param="conversation_id")


class RequestNotFound(NotFound):
    """No request with this id is in flight for this caller."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"No request '{request_id}' is in flight.", param="request_id")


class ServerBusy(SluiceError):
    """All slots and the queue are full: retry later."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class RateLimited(SluiceError):
    """A key's limit is reached (``[keys]``: rpm, max_streams): retry after ``retry_after``
    seconds. ``limit_headers`` are the rate-limit headers the dialect's clients read."""

    def __init__(
        self,
        message: str,
        retry_after: float | None,
        limit_headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.limit_headers = limit_headers or {}

    def headers(self) -> dict[str, str]:
        headers = dict(self.limit_headers)
        if self.retry_after is not None:
            # Whole seconds, rounded up (the header's unit); -ms for the SDKs that read it.
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after * 1000)))
        return headers


class TokensLimited(RateLimited):
    """A key's tokens-a-minute limit (``tpm``) is reached."""


class BudgetSpent(RateLimited):
    """A key's token budget for its period is spent (``token_budget``)."""


class ShuttingDown(SluiceError):
    """The server is stopping; in-flight work is ended."""


class EngineFailure(SluiceError):
    """The inference engine failed (decode error, model load error)."""


class ModelUnloaded(SluiceError):
    """The model was unloaded (on request) while this request was using it."""


class RequestCancelled(SluiceError):
    """Stopped from outside its connection (``POST /v1/requests/{id}/cancel``)."""


class ModelLoadFailed(EngineFailure):
    """llama.cpp could not load a model (bad file, unsupported architecture, ...)."""


class InsufficientMemory(ServerBusy):
    """Loading the model needs memory that models in use hold now: retry later."""


class ModelTooLarge(InvalidRequest):
    """The model would not fit the memory budget even with every other model unloaded."""


class DownloadFailed(SluiceError):
    """A model download failed (network, HTTP status, checksum, disk)."""


class DownloadNotAllowed(InvalidRequest):
    """A download URL this server may not fetch: its host resolves to a loopback,
    private or link-local address, or is not on the allowed hosts."""


class InternalError(SluiceError):
    """Something unexpected inside the server (a bug): still answered in the dialect's shape."""


class UpstreamFailed(SluiceError):
    """An upstream server failed: refused the connection, reset it, answered 5xx,
    dropped a stream, or sent what is not OpenAI SSE (502, as the gateway API says)."""


class UpstreamTimeout(UpstreamFailed):
    """An upstream server sent nothing within its slot's timeout."""


class UpstreamMalformed(UpstreamFailed):
    """An upstream server's answer is not the OpenAI shape it should be."""


class UpstreamUnavailable(ServerBusy):
    """Every replica of an upstream slot is known to be down: retry after the next check."""


class UpstreamRejected(SluiceError):
    """An upstream server refused the request (a 4xx): its status and error, as it said them.

    Only for dialects that decode an upstream's answer; an OpenAI request to an
    OpenAI upstream gets the upstream's bytes themselves.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: str | None = None,
    ) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.type = type
        self.code = code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": self.retry_after} if self.retry_after else {}


class ResponseNotFound(NotFound):
    """LM Studio's ``previous_response_id`` names no stored response of this caller."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"No stored response '{response_id}'.", param="previous_response_id")
        self.response_id = response_id


class ReasoningUnsupported(InvalidRequest):
    """LM Studio's ``reasoning`` asks for a setting the model cannot honour."""


class IntegrationNotAllowed(SluiceError):
    """Server-side tools (MCP plugins or ephemeral servers) asked for, but not enabled,
    or an ephemeral server's host is not on the allowlist."""


class McpConnectionError(SluiceError):
    """An MCP server could not be started, reached, or listed its tools."""


class ToolRoundsExceeded(SluiceError):
    """The model still called tools after the last round the limit allows."""


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    status: int
    type: str
    code: str | None


# The one table: the most specific class in an error's MRO wins.
_TABLE: dict[type[SluiceError], ErrorSpec] = {
    SluiceError: ErrorSpec(500, "server_error", "internal_error"),
    InvalidRequest: ErrorSpec(400, "invalid_request_error", "invalid_request"),
    UnsupportedParameter: ErrorSpec(400, "invalid_request_error", "unsupported_parameter"),
    ContextOverflow: ErrorSpec(400, "invalid_request_error", "context_length_exceeded"),
    TemplateError: ErrorSpec(400, "invalid_request_error", "template_error"),
    MissingChatTemplate: ErrorSpec(400, "invalid_request_error", "missing_chat_template"),
    BodyTooLarge: ErrorSpec(413, "invalid_request_error", "request_too_large"),
    AuthenticationFailed: ErrorSpec(401, "authentication_error", "invalid_api_key"),
    PermissionDenied: ErrorSpec(403, "permission_error", "admin_key_required"),
    ModelNotFound: ErrorSpec(404, "invalid_request_error", "model_not_found"),
    NotFound: ErrorSpec(404, "invalid_request_error", "not_found"),
    JobNotFound: ErrorSpec(404, "invalid_request_error", "job_not_found"),
    ConversationNotFound: ErrorSpec(404, "invalid_request_error", "conversation_not_found"),
    RequestNotFound: ErrorSpec(404, "invalid_request_error", "request_not_found"),
    ServerBusy: ErrorSpec(503, "server_error", "server_busy"),
    ShuttingDown: ErrorSpec(503, "server_error", "shutting_down"),
    # OpenAI's shapes: its 429s say which limit ("requests", "tokens") in ``type``.
    RateLimited: ErrorSpec(429, "requests", "rate_limit_exceeded"),
    TokensLimited: ErrorSpec(429, "tokens", "rate_limit_exceeded"),
    BudgetSpent: ErrorSpec(429, "insufficient_quota", "insufficient_quota"),
    EngineFailure: ErrorSpec(500, "server_error", "engine_error"),
    ModelUnloaded: ErrorSpec(503, "server_error", "model_unloaded"),
    ModelLoadFailed: ErrorSpec(500, "server_error", "model_load_failed"),
    # 499 as nginx's "closed request": not retried by the SDKs (they retry 409 and 5xx).
    RequestCancelled: ErrorSpec(499, "server_error", "request_cancelled"),
    InsufficientMemory: ErrorSpec(503, "server_error", "insufficient_memory"),
    ModelTooLarge: ErrorSpec(400, "invalid_request_error", "model_too_large"),
    DownloadFailed: ErrorSpec(502, "server_error", "download_failed"),
    DownloadNotAllowed: ErrorSpec(400, "invalid_request_error", "download_not_allowed"),
    InternalError: ErrorSpec(500, "server_error", "internal_error"),
    UpstreamFailed: ErrorSpec(502, "server_error", "upstream_error"),
    UpstreamTimeout: ErrorSpec(502, "server_error", "upstream_timeout"),
    UpstreamMalformed: ErrorSpec(502, "server_error", "upstream_malformed"),
    UpstreamUnavailable: ErrorSpec(503, "server_error", "upstream_unavailable"),
    ResponseNotFound: ErrorSpec(404, "invalid_request_error", "response_not_found"),
    ReasoningUnsupported: ErrorSpec(400, "invalid_request_error", "reasoning_not_supported"),
    IntegrationNotAllowed: ErrorSpec(403, "permission_error", "integration_not_allowed"),
    McpConnectionError: ErrorSpec(502, "server_error", "mcp_connection_error"),
    ToolRoundsExceeded: ErrorSpec(400, "invalid_request_error", "tool_rounds_exceeded"),
    # UpstreamRejected: the upstream's own status, type and code (see spec_for)
}


# LM Studio's error ``type`` per class, found the same way; the status is
# the table's above.
_LMSTUDIO_TYPES: dict[type[SluiceError], str] = {
    SluiceError: "internal_error",
    InvalidRequest: "invalid_request",
    BodyTooLarge: "invalid_request",
    AuthenticationFailed: "invalid_request",
    PermissionDenied: "invalid_request",
    ModelNotFound: "model_not_found",
    UpstreamRejected: "invalid_request",
    JobNotFound: "job_not_found",
    NotFound: "invalid_request",
    ServerBusy: "unknown",
    ShuttingDown: "unknown",
    RateLimited: "rate_limit_exceeded",
    ModelUnloaded: "unknown",
    RequestCancelled: "unknown",
    DownloadFailed: "unknown",
    UpstreamFailed: "unknown",
    IntegrationNotAllowed: "invalid_request",
    McpConnectionError: "mcp_connection_error",
    ToolRoundsExceeded: "invalid_request",
}


def lmstudio_error_body(error: SluiceError) -> dict[str, Any]:
    """LM Studio's error JSON, ``{"error": {"type", "message", "code", "param"?}}``."""
    lms_type = next(_LMSTUDIO_TYPES[c] for c in type(error).__mro__ if c in _LMSTUDIO_TYPES)
    inner: dict[str, Any] = {"type": lms_type, "message": error.message}
    code = spec_for(error).code
    if code is not None:
        inner["code"] = code
    if error.param is not None:
        inner["param"] = error.param
    return {"error": inner}


def as_sluice_error(error: BaseException) -> SluiceError:
    """``error`` itself if typed, else an :class:`EngineFailure` naming it."""
    if isinstance(error, SluiceError):
        return error
    return EngineFailure(f"{type(error).__name__}: {error}")


def spec_for(error: SluiceError) -> ErrorSpec:
    if isinstance(error, UpstreamRejected):  # the one error whose status is not ours
        return ErrorSpec(error.status, error.type, error.code)
    for cls in type(error).__mro__:
        spec = _TABLE.get(cls)
        if spec is not None:
            return spec
    raise AssertionError("unreachable: SluiceError is in the table")


def error_body(error: SluiceError) -> dict[str, Any]:
    """The OpenAI error JSON, ``{"error": {...}}``, for an HTTP error response."""
    spec = spec_for(error)
    return {
        "error": {
            "message": error.message,
            "type": spec.type,
            "param": error.param,
            "code": spec.code,
        }
    }


def error_frame_payload(error: SluiceError) -> dict[str, Any]:
    """The JSON of an in-stream ``event: error`` frame.

    Carries both shapes at once: top-level ``message``/``type`` (llama.cpp's server)
    and an ``error`` object (what the official SDKs look for).
    """
    body = error_body(error)
    inner = body["error"]
    return {"message": inner["message"], "type": inner["type"], "code": inner["code"], **body}
