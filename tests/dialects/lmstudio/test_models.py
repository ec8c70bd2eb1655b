"""LM Studio model management, the parts without a server: request schemas, listing
entries from real GGUF files, capabilities from chat templates, and error responses."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from sluice.config import Settings
from sluice.core.errors import (
    BodyTooLarge,
    InsufficientMemory,
    InvalidRequest,
    ModelLoadFailed,
    ModelTooLarge,
)
from sluice.dialects.lmstudio.routes import (
    _lms_error_response,
    model_entry,
    read_model_file,
)
from sluice.dialects.lmstudio.schema import (
    DownloadModelRequest,
    LoadModelRequest,
    UnloadModelRequest,
    parse,
)
from sluice.models.catalog import ModelSpec
from sluice.models.entries import ModelStatus
from sluice.models.files import reasoning_capability

SMOLLM2 = ModelSpec("smollm2-135m-instruct", "smollm2", "packaged", aliases=("smollm2",))
THINKING = (
    "{% if enable_thinking %}<think>\n{% endif %}{% for m in messages %}{{ m.content }}"
    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
)


def status(name: str, config: dict[str, Any] | None) -> ModelStatus:
    state = "loaded" if config is not None else "not_loaded"
    return ModelStatus(name, state, 0, None, None, None, config)


# -- request schemas ----------------------------------------------------------------------


def test_load_request_fields() -> None:
    body = parse({"model": "m", "context_length": 2048, "echo_load_config": True}, LoadModelRequest)
    assert (body.model, body.context_length, body.echo_load_config) == ("m", 2048, True)
    assert parse({"model": "m"}, LoadModelRequest).echo_load_config is False


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({}, "model"),
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"model": "m", "context_length": 63}, "context_length"),
        ({"model": "m", "context_length": "long"}, "context_length"),
        ({"model": "m", "parallel": 0}, "parallel"),
        ({"model": "m", "eval_batch_size": 0}, "eval_batch_size"),
        ({"model": "m", "flash_attention": "maybe"}, "flash_attention"),
    ],
)
def test_load_request_errors_name_the_field(data: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse(data, LoadModelRequest)
    assert exc.value.param == param
    assert f"'{param}'" in exc.value.message


def test_unknown_fields_are_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sluice.api"):
        body = parse({"instance_id": "m", "force": True}, UnloadModelRequest)
    assert body.instance_id == "m"
    assert "force" in caplog.text


def test_download_request_needs_a_model() -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse({"sha256": "0" * 64}, DownloadModelRequest)
    assert exc.value.param == "model"


# -- capabilities -------------------------------------------------------------------------


def test_reasoning_capability_follows_the_template() -> None:
    assert reasoning_capability(None) is None
    assert reasoning_capability("{{ messages }}") is None
    # Markers but no switch: the model always thinks.
    always = reasoning_capability("<think>{{ messages }}")
    assert always == {"allowed_options": ["on"], "default": "on"}
    assert reasoning_capability(THINKING) == {"allowed_options": ["off", "on"], "default": "on"}


# -- listing entries from real files ------------------------------------------------------


def test_entry_of_a_loaded_packaged_model() -> None:
    file = read_model_file(SMOLLM2, Settings())
    config = {"context_length": 512, "eval_batch_size": 512, "parallel": 1, "num_threads": None}
    entry = model_entry(SMOLLM2, status(SMOLLM2.name, config), file)
    assert list(entry) == [
        "type",
        "publisher",
        "key",
        "display_name",
        "architecture",
        "quantization",
        "size_bytes",
        "params_string",
        "loaded_instances",
        "max_context_length",
        "format",
        "capabilities",
        "description",
    ]
    assert entry["publisher"] == "HuggingFaceTB"
    assert entry["key"] == SMOLLM2.name
    assert (entry["architecture"], entry["quantization"]["name"]) == ("llama", "Q4_1")
    assert entry["max_context_length"] == 8192
    assert "reasoning" not in entry["capabilities"]
    # Settings that do not apply are left out, as LM Studio leaves them out.
    config.pop("num_threads")
    assert entry["loaded_instances"] == [{"id": SMOLLM2.name, "config": config}]
    assert model_entry(SMOLLM2, status(SMOLLM2.name, None), file)["loaded_instances"] == []


def test_a_template_override_decides_the_capabilities(tmp_path: Path) -> None:
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING, encoding="utf-8")
    spec = ModelSpec("think", "smollm2", "config", chat_template=str(template))
    file = read_model_file(spec, Settings())
    assert file.template == THINKING
    caps = model_entry(spec, status("think", None), file)["capabilities"]
    assert caps["trained_for_tool_use"] is True
    assert caps["reasoning"] == {"allowed_options": ["off", "on"], "default": "on"}
    # The server-wide --chat-template counts too, when the model has none of its own.
    server_wide = read_model_file(SMOLLM2, Settings(chat_template=str(template)))
    assert server_wide.supports_tools is True


def test_an_unreadable_model_file(tmp_path: Path) -> None:
    missing = ModelSpec("gone", str(tmp_path / "gone.gguf"), "models_dir")
    with pytest.raises(ModelLoadFailed):
        read_model_file(missing, Settings())
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"<html>not a model</html>")
    with pytest.raises(ModelLoadFailed, match="junk"):
        read_model_file(ModelSpec("junk", str(not_gguf), "models_dir"), Settings())
    # Listed anyway, with what is known: one broken file must not hide it.
    entry = model_entry(missing, status("gone", None), None)
    assert entry["key"] == "gone" and entry["architecture"] is None
    assert entry["quantization"] is None and entry["capabilities"]["vision"] is False


# -- errors -------------------------------------------------------------------------------


def test_memory_errors_in_lm_studio_shape() -> None:
    too_large = _lms_error_response(ModelTooLarge("needs 9 GiB", param="model"))
    assert too_large.status_code == 400
    assert json.loads(too_large.body)["error"] == {
        "type": "invalid_request",
        "message": "needs 9 GiB",
        "code": "model_too_large",
        "param": "model",
    }
    busy = _lms_error_response(InsufficientMemory("retry later", retry_after=5))
    assert busy.status_code == 503
    assert busy.headers["retry-after"] == "5"
    assert json.loads(busy.body)["error"]["code"] == "insufficient_memory"


def test_error_headers_carry_over() -> None:
    r = _lms_error_response(BodyTooLarge("too big \ud800", close=True))
    assert r.status_code == 413
    assert r.headers["connection"] == "close"
    assert b"\\ud800" in bytes(r.body)  # escaped: a lone surrogate still encodes


def test_reasoning_capability_knows_every_family_s_markers() -> None:
    from sluice.templates import bundled

    for name in ("ByteDance-Seed-OSS", "openai-gpt-oss-120b", "Cohere2MoE"):
        assert reasoning_capability(bundled(name)) == {"allowed_options": ["on"], "default": "on"}
    assert reasoning_capability(bundled("Qwen-Qwen2.5-7B-Instruct")) is None
    # Kimi K3 is switched off by ``thinking``, not ``enable_thinking``.
    k3 = reasoning_capability(bundled("Kimi-K3"))
    assert k3 == {"allowed_options": ["off", "on"], "default": "on"}
