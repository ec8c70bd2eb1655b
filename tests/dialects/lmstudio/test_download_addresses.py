"""``POST /api/v1/models/download`` refuses URLs whose host is not public, and hosts
off ``--download-allowed-hosts``: a 400 in LM Studio's error shape naming
``model``, before any job or connection. Only loopback URLs: nothing leaves the
machine (the real app on a scripted runner).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.support.fakes import ScriptedRunner
from tests.support.helpers import scripted_server

LOOPBACK_URLS = [
    "http://127.0.0.1:9/x.gguf",
    "http://[::1]:9/x.gguf",
    "http://0x7f000001:9/x.gguf",
    "http://2130706433:9/x.gguf",
    "http://localhost:9/x.gguf",
]


def download(base: str, url: str) -> httpx.Response:
    return httpx.post(f"{base}/api/v1/models/download", json={"model": url}, timeout=30)


def lms_error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["code"] == "download_not_allowed"
    assert error["param"] == "model"
    return error


def test_private_hosts_are_refused_by_default(tmp_path: Path) -> None:
    with scripted_server(ScriptedRunner(), models_dir=str(tmp_path)) as base:
        for url in LOOPBACK_URLS:
            message = lms_error(download(base, url))["message"]
            assert message.startswith("Invalid 'model': The download host"), message
            assert "is not a public address" in message
        jobs = httpx.get(f"{base}/api/v1/models/download/status/job_0000000000", timeout=10)
        assert jobs.status_code == 404
    assert list(tmp_path.iterdir()) == []


def test_allowed_hosts_are_checked_first(tmp_path: Path) -> None:
    settings = {"models_dir": str(tmp_path), "download_allowed_hosts": "huggingface.co"}
    with scripted_server(ScriptedRunner(), **settings) as base:
        message = lms_error(download(base, "http://127.0.0.1:9/x.gguf"))["message"]
    assert "'127.0.0.1' is not on this server's allowed hosts" in message


def test_the_flag_lets_a_loopback_url_start_a_job(tmp_path: Path) -> None:
    settings = {"models_dir": str(tmp_path), "download_allow_private": True}
    with scripted_server(ScriptedRunner(), **settings) as base:
        r = download(base, "http://127.0.0.1:9/x.gguf")  # the discard port: nothing listens
    assert r.status_code == 200, r.text
    assert r.json()["job_id"].startswith("job_")
