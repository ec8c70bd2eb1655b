"""Key roles: only an admin key manages models (load, unload, download, pull, delete),
refused with a 403 in the dialect's own shape before anything else; a server without
keys beyond loopback refuses management unless told; user keys chat as before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.config import Settings
from sluice.server.app import OLLAMA_PATHS, create_app, is_loopback, management
from sluice.server.auth import ADMIN, USER, ApiKeys
from tests.support.fakes import ScriptedRunner
from tests.support.servers import serve_app

ALICE = "sk-alice-0001"  # user
BOB = "sk-bob-000002"  # admin, by role
ROOT = "sk-root-00003"  # a key named admin
OPERATOR = "sk-operator-4"  # --api-key


def test_roles_from_every_source(tmp_path: Path) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text(
        "[keys]\n"
        f'alice = "{ALICE}"\n'
        f'bob = {{ key = "{BOB}", role = "admin" }}\n'
        'carol = { env = "CAROL_KEY", role = "user" }\n'
        'dave = { env = "DAVE_KEY", role = "admin" }\n'
    )
    settings = Settings(config=str(config), api_key=OPERATOR, api_keys=f"admin:{ROOT}")
    keys = ApiKeys.from_settings(
        settings, env={"CAROL_KEY": "sk-carol-0003", "DAVE_KEY": "sk-dave-00004"}
    )
    roles = {name: keys.role(name) for name in keys.names}
    assert roles == {
        "default": ADMIN,  # the one key the operator starts the server with
        "admin": ADMIN,  # a key named admin has always been one
        "alice": USER,
        "bob": ADMIN,
        "carol": USER,
        "dave": ADMIN,
    }
    assert ApiKeys({"alice": ALICE}).role("alice") == USER
    assert ApiKeys({"alice": ALICE}, admins=["alice"]).role("alice") == ADMIN


def test_what_is_management() -> None:
    assert management("POST", "/api/v1/models/load") is not None
    assert management("POST", "/api/v1/models/unload") is not None
    assert management("POST", "/api/v1/models/download") is not None
    assert management("GET", "/api/v1/models/download/status/job_1") is not None
    assert management("POST", "/api/pull") is not None
    assert management("DELETE", "/api/delete") is not None
    assert management("POST", "/api/create") is not None
    for method, path in (
        ("POST", "/v1/chat/completions"),
        ("POST", "/api/chat"),
        ("GET", "/api/v1/models"),
        ("POST", "/api/show"),
        ("GET", "/v1/requests"),
    ):
        assert management(method, path) is None, path
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")


# What each management route is sent: enough to get past the role check (then a 4xx of
# its own, or a real action that cannot hurt: nothing to delete, a refused pull).
MANAGED: list[tuple[str, str, Any]] = [
    ("POST", "/api/v1/models/load", {"model": "nope"}),
    ("POST", "/api/v1/models/unload", {"instance_id": "nope"}),
    ("POST", "/api/v1/models/download", {"model": "not a url"}),
    ("GET", "/api/v1/models/download/status/job_nope", None),
    ("POST", "/api/pull", {"model": "not a url"}),
    ("DELETE", "/api/delete", {"model": "nope"}),
    ("POST", "/api/create", {"model": "x"}),
    ("POST", "/api/chat", {"model": "scripted", "messages": [], "keep_alive": 0}),
]


def _call(base: str, method: str, path: str, body: Any, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, base + path, json=body, headers=headers, timeout=30)


def _refused(r: httpx.Response, path: str, words: str) -> None:
    assert r.status_code == 403, (path, r.status_code, r.text)
    if path in OLLAMA_PATHS:  # Ollama's shape: a string
        message = r.json()["error"]
    elif path.startswith("/api/v1/"):  # LM Studio's: {"error": {"type", "message"}}
        message = r.json()["error"]["message"]
    else:
        message = r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "permission_error"
    assert "admin key" in message and words in message, message


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("roles")
    config = folder / "sluice.toml"
    config.write_text(f'[keys]\nalice = "{ALICE}"\nbob = {{ key = "{BOB}", role = "admin" }}\n')
    app = create_app(
        Settings(model="scripted", config=str(config), models_dir=str(folder)),
        runner_factory=lambda s: ScriptedRunner(),
    )
    with serve_app(app) as base:
        yield base


@pytest.mark.parametrize(("method", "path", "body"), MANAGED, ids=[m[1] for m in MANAGED])
def test_a_user_key_may_not_manage_models(keyed: str, method: str, path: str, body: Any) -> None:
    _refused(_call(keyed, method, path, body, ALICE), path, "'alice' is a user key")
    admin = _call(keyed, method, path, body, BOB)
    assert admin.status_code != 403, (path, admin.text)  # the route's own answer


def test_a_user_key_chats_and_sees_only_its_requests(keyed: str) -> None:
    chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    r = _call(keyed, "POST", "/v1/chat/completions", chat, ALICE)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    ollama = _call(keyed, "POST", "/api/chat", {**chat, "stream": False}, ALICE)
    assert ollama.status_code == 200, ollama.text  # a just-in-time load is normal use
    assert _call(keyed, "GET", "/api/v1/models", None, ALICE).status_code == 200
    assert _call(keyed, "POST", "/api/show", {"model": "scripted"}, ALICE).status_code == 200


def test_only_an_admin_keys_keep_alive_sets_the_models_ttl(keyed: str) -> None:
    """keep_alive on a chat is the model's idle TTL for everyone: a user key's is
    ignored (the chat is answered), an admin key's applies."""

    def expires() -> str:
        r = _call(keyed, "GET", "/api/ps", None, BOB)
        return str(next(m["expires_at"] for m in r.json()["models"]))

    chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    assert _call(keyed, "POST", "/api/chat", chat, BOB).status_code == 200
    default = expires()
    r = _call(keyed, "POST", "/api/chat", {**chat, "keep_alive": -1}, ALICE)
    assert r.status_code == 200 and r.json()["message"]["content"], r.text
    assert expires()[:4] == default[:4]  # still the server's TTL, this year
    assert _call(keyed, "POST", "/api/chat", {**chat, "keep_alive": -1}, BOB).status_code == 200
    assert int(expires()[:4]) >= int(default[:4]) + 9  # kept loaded: ten years ahead
    _call(keyed, "POST", "/api/chat", {**chat, "keep_alive": "1h"}, BOB)  # as it was


@pytest.mark.parametrize(
    ("host", "allow", "refused"),
    [("127.0.0.1", False, False), ("0.0.0.0", False, True), ("0.0.0.0", True, False)],
)
def test_a_server_without_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, host: str, allow: bool, refused: bool
) -> None:
    """Beyond loopback with no keys, anyone could reach it: management is refused unless
    --allow-unauthenticated-admin says so (the server itself is bound on loopback here;
    only the setting it decides by changes)."""
    settings = Settings(
        model="scripted", host=host, allow_unauthenticated_admin=allow, models_dir=str(tmp_path)
    )
    with caplog.at_level("WARNING", logger="sluice"):
        app = create_app(settings, runner_factory=lambda s: ScriptedRunner())
    assert ("management" in caplog.text) == refused
    with serve_app(app) as base:
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
        assert _call(base, "POST", "/v1/chat/completions", chat, None).status_code == 200
        for method, path, body in MANAGED:
            r = _call(base, method, path, body, None)
            if refused:
                _refused(r, path, "no keys")
            else:
                assert r.status_code != 403, (path, r.text)


def test_sluice_models_shows_the_refusal(keyed: str) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "sluice", "models", "--url", keyed, "--api-key", ALICE]
    done = subprocess.run(
        [*cmd, "load", "scripted"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "needs an admin key; the key 'alice' is a user key" in done.stdout, done.stdout
    listed = subprocess.run([*cmd, "list"], capture_output=True, text=True, timeout=60, check=False)
    assert listed.returncode == 0 and "scripted" in listed.stdout  # listing is for everyone


def test_info_says_who_is_asking(keyed: str) -> None:
    user = _call(keyed, "GET", "/v1/info", None, ALICE).json()["caller"]
    admin = _call(keyed, "GET", "/v1/info", None, BOB).json()["caller"]
    assert user == {"key": "alice", "role": "user"}
    assert admin == {"key": "bob", "role": "admin"}


def test_an_admin_key_by_role_sees_and_cancels_every_keys_requests(tmp_path: Path) -> None:
    import threading

    from tests.support.fakes import EOS

    config = tmp_path / "sluice.toml"
    config.write_text(
        f'[keys]\nalice = "{ALICE}"\ncarol = "sk-carol-0003"\n'
        f'bob = {{ key = "{BOB}", role = "admin" }}\n'
    )
    runner = ScriptedRunner(default=[b"w"] * 1000 + [EOS], step_delay=0.01)
    app = create_app(
        Settings(model="scripted", config=str(config), models_dir=str(tmp_path)),
        runner_factory=lambda s: runner,
    )
    with serve_app(app) as base:
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}

        def ask() -> None:
            _call(base, "POST", "/v1/chat/completions", chat, ALICE)

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        listed: list[Any] = []
        for _ in range(100):
            listed = _call(base, "GET", "/v1/requests", None, BOB).json()["data"]
            if listed:
                break
            time.sleep(0.05)
        assert [r["key"] for r in listed] == ["alice"], listed
        assert _call(base, "GET", "/v1/requests", None, "sk-carol-0003").json()["data"] == []
        flight = listed[0]["id"]
        refused = _call(base, "POST", f"/v1/requests/{flight}/cancel", None, "sk-carol-0003")
        assert refused.status_code == 404  # another user's: not found, as before
        done = _call(base, "POST", f"/v1/requests/{flight}/cancel", None, BOB)
        assert done.status_code == 200 and done.json()["state"] == "cancelled"
        thread.join(10)
        assert not thread.is_alive()
