"""The one error table: each error's status, type and code, and the bodies made from it."""

from __future__ import annotations

import pytest

from sluice.core.errors import (
    AuthenticationFailed,
    BodyTooLarge,
    ContextOverflow,
    DownloadNotAllowed,
    EngineFailure,
    InvalidRequest,
    MissingChatTemplate,
    ModelNotFound,
    ServerBusy,
    ShuttingDown,
    TemplateError,
    UnsupportedParameter,
    error_body,
    error_frame_payload,
    spec_for,
)


@pytest.mark.parametrize(
    ("error", "status", "type_", "code"),
    [
        (InvalidRequest("x"), 400, "invalid_request_error", "invalid_request"),
        (UnsupportedParameter("tools"), 400, "invalid_request_error", "unsupported_parameter"),
        (ContextOverflow(10, 5), 400, "invalid_request_error", "context_length_exceeded"),
        (TemplateError("x"), 400, "invalid_request_error", "template_error"),
        (MissingChatTemplate("x"), 400, "invalid_request_error", "missing_chat_template"),
        (BodyTooLarge("x"), 413, "invalid_request_error", "request_too_large"),
        (AuthenticationFailed("x"), 401, "authentication_error", "invalid_api_key"),
        (ModelNotFound("m"), 404, "invalid_request_error", "model_not_found"),
        (ServerBusy("x"), 503, "server_error", "server_busy"),
        (ShuttingDown("x"), 503, "server_error", "shutting_down"),
        (EngineFailure("x"), 500, "server_error", "engine_error"),
        (DownloadNotAllowed("x"), 400, "invalid_request_error", "download_not_allowed"),
    ],
)
def test_error_table(error: Exception, status: int, type_: str, code: str) -> None:
    spec = spec_for(error)  # type: ignore[arg-type]
    assert (spec.status, spec.type, spec.code) == (status, type_, code)
    body = error_body(error)  # type: ignore[arg-type]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    frame = error_frame_payload(error)  # type: ignore[arg-type]
    assert frame["message"] == body["error"]["message"] and frame["type"] == type_
    assert frame["error"] == body["error"]


def test_error_details() -> None:
    err = ContextOverflow(5000, 4096, param="prompt")
    assert "5000" in err.message and "4096" in err.message and err.param == "prompt"
    assert UnsupportedParameter("tools").param == "tools"
    assert ServerBusy("x", retry_after=3).headers() == {"Retry-After": "3"}
    assert InvalidRequest("x").headers() == {}
