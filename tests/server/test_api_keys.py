"""API keys: every source and error, and every route behind the key check."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from sluice.cli import main
from sluice.config import Settings
from sluice.models.catalog import ConfigError, load_config
from sluice.server.app import OLLAMA_PATHS, create_app
from sluice.server.auth import ApiKeys, BearerAuth, key_name, parse_env_keys
from sluice.server.sse import RawSend
from tests.support.fakes import ScriptedRunner
from tests.support.helpers import scripted_server
from tests.support.servers import serve_app

ALICE = "sk-alice-0001"
BOB = "sk-bob-000002"
CAROL = "sk-carol-0003"


def keys_of(
    tmp_path: Path, toml: str = "", env: dict[str, str] | None = None, **kw: Any
) -> ApiKeys:
    if toml:
        config = tmp_path / "sluice.toml"
        config.write_text(toml)
        kw["config"] = str(config)
    return ApiKeys.from_settings(Settings(**kw), env=env or {})


def config_error(
    tmp_path: Path, toml: str = "", env: dict[str, str] | None = None, **kw: Any
) -> str:
    with pytest.raises(ConfigError) as info:
        keys_of(tmp_path, toml, env, **kw)
    message = str(info.value)
    for secret in (ALICE, BOB, CAROL, "sk-shrt", "sk-with space"):
        assert secret not in message, "an error message shows a key"
    return message


# -- parsing -------------------------------------------------------------------------


def test_no_keys_is_an_open_server(tmp_path: Path) -> None:
    keys = keys_of(tmp_path)
    assert not keys and len(keys) == 0 and keys.names == ()
    assert keys.lookup("anything") is None
    assert not keys_of(tmp_path, "[[models]]\nname = 'm'\nsource = 'm.gguf'\n")


def test_every_source_merged(tmp_path: Path) -> None:
    toml = f'[keys]\ncarol = "{CAROL}"\ndave = {{ env = "DAVE_KEY" }}\n'
    keys = keys_of(
        tmp_path,
        toml,
        env={"DAVE_KEY": "sk-dave-00004"},
        api_key="sk-default-0",
        api_keys=f" alice:{ALICE} , bob:{BOB},",  # spaces and a trailing comma are fine
    )
    assert keys.names == ("default", "alice", "bob", "carol", "dave")
    assert keys.lookup("sk-default-0") == "default"
    assert keys.lookup(ALICE) == "alice"
    assert keys.lookup(BOB) == "bob"
    assert keys.lookup(CAROL) == "carol"
    assert keys.lookup("sk-dave-00004") == "dave"
    for wrong in ("", ALICE[:-1], ALICE + "x", f" {ALICE}", "sk-ålice-0001", "\udcff"):
        assert keys.lookup(wrong) is None
    assert ALICE not in repr(keys) and "alice" in repr(keys)


def test_environment_variable_in_settings() -> None:
    settings = Settings.from_env({"SLUICE_API_KEYS": f"alice:{ALICE}", "SLUICE_API_KEY": BOB})
    keys = ApiKeys.from_settings(settings)
    assert keys.names == ("default", "alice")


def test_a_key_may_hold_a_colon() -> None:
    assert parse_env_keys("alice:sk:with:colons") == {"alice": "sk:with:colons"}


def test_the_old_short_api_key_still_works_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "sluice.api"):
        keys = keys_of(tmp_path, api_key="sekret")
    assert keys.lookup("sekret") == "default"
    assert "shorter than 8" in caplog.text and "sekret" not in caplog.text


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (ALICE, "entry 1 is not 'name:key'"),  # a bare key: the message must not echo it
        (f"alice:{ALICE},{BOB}", "entry 2 is not 'name:key'"),
        (f":{ALICE}", "key name '' must be"),
        (f"al ice:{ALICE}", "key name 'al ice' must be"),
        (f"al/ice:{ALICE}", "key name 'al/ice' must be"),
        (f"{'a' * 65}:{ALICE}", "must be 1-64 characters"),
        ("alice:", "key 'alice' is empty"),
        ("alice:sk-shrt", "key 'alice' is shorter than 8 characters"),
        ("alice:sk-with space", "key 'alice' must be printable ASCII without spaces"),
        ("alice:sk-ålice-0001", "key 'alice' must be printable ASCII"),
        (f"alice:{ALICE},alice:{BOB}", "key name 'alice' is given twice"),
        (f"alice:{ALICE},bob:{ALICE}", "key 'bob' is the same key as 'alice'"),
    ],
)
def test_environment_errors(tmp_path: Path, raw: str, words: str) -> None:
    message = config_error(tmp_path, api_keys=raw)
    assert message.startswith("SLUICE_API_KEYS: ") and words in message, message


@pytest.mark.parametrize(
    ("toml", "env", "words"),
    [
        ("keys = 3\n", {}, "'keys' must be a table ([keys]), not an integer"),
        ("[[keys]]\nalice = 1\n", {}, "'keys' must be a table ([keys]), not a list"),
        ("[keys]\nalice = 3\n", {}, "'alice' must be a string, { key = \"...\" } or { env"),
        ('[keys]\nalice = { var = "A" }\n', {}, "'alice' must be a string, { key"),
        ('[keys]\nalice = { env = "A", x = 1 }\n', {}, "'alice' must be a string, { key"),
        ("[keys]\nalice = { env = 3 }\n", {}, "'alice' must be a string, { key"),
        ("[keys]\nalice = { key = 3 }\n", {}, "'alice' must be a string, { key"),
        (f'[keys]\nalice = {{ key = "{ALICE}", role = "root" }}\n', {}, "role 'root'"),
        (
            '[keys]\nalice = { env = "ALICE_KEY" }\n',
            {},
            "'alice' reads $ALICE_KEY, which is not set",
        ),
        (
            '[keys]\nalice = { env = "ALICE_KEY" }\n',
            {"ALICE_KEY": ""},
            "'alice' reads $ALICE_KEY, which is empty",
        ),
        (
            '[keys]\nalice = { env = "ALICE_KEY" }\n',
            {"ALICE_KEY": "sk-shrt"},
            "('alice' from $ALICE_KEY): key 'alice' is shorter than 8",
        ),
        ('[keys]\n"al ice" = "sk-alice-0001"\n', {}, "key name 'al ice' must be"),
        ('[keys]\nalice = ""\n', {}, "key 'alice' is empty"),
        ('[keys]\nalice = "sk-shrt"\n', {}, "key 'alice' is shorter than 8 characters"),
        (f'[keys]\nalice = "{ALICE}"\nbob = "{ALICE}"\n', {}, "'bob' is the same key as 'alice'"),
    ],
)
def test_config_file_errors(tmp_path: Path, toml: str, env: dict[str, str], words: str) -> None:
    message = config_error(tmp_path, toml, env)
    file = tmp_path / "sluice.toml"
    assert message.startswith((f"{file} [keys]", f"{file}: 'keys'")), message
    assert words in message, message


def test_a_missing_variable_names_file_key_and_variable(tmp_path: Path) -> None:
    message = config_error(tmp_path, '[keys]\nalice = { env = "ALICE_KEY" }\n')
    assert str(tmp_path / "sluice.toml") in message
    assert "'alice'" in message and "$ALICE_KEY" in message


def test_conflicts_across_sources(tmp_path: Path) -> None:
    toml = f'[keys]\nalice = "{ALICE}"\n'
    message = config_error(tmp_path, toml, api_keys=f"alice:{BOB}")
    assert "key name 'alice' is also given in SLUICE_API_KEYS" in message
    message = config_error(tmp_path, toml, api_keys=f"bob:{ALICE}")
    assert "'alice' is the same key as 'bob' (SLUICE_API_KEYS)" in message
    message = config_error(tmp_path, api_key=ALICE, api_keys=f"alice:{ALICE}")
    assert "the same key as 'default' (--api-key/SLUICE_API_KEY)" in message
    message = config_error(tmp_path, api_key=ALICE, api_keys=f"default:{BOB}")
    assert "key name 'default' is also given in --api-key" in message
    # A non-ASCII --api-key could never match a header: refused at start, not a 500 per request.
    assert "printable ASCII" in config_error(tmp_path, api_key="sk-ålice-0001")


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    message = config_error(tmp_path, config=str(tmp_path / "nope.toml"))
    assert "no such config file" in message


def test_the_models_loader_still_accepts_the_keys_table(tmp_path: Path) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text(f'[keys]\nalice = "{ALICE}"\n\n[[models]]\nname = "m"\nsource = "m.gguf"\n')
    assert [s.name for s in load_config(config)] == ["m"]


def test_direct_construction() -> None:
    keys = ApiKeys({"alice": ALICE, "bob": BOB})
    assert keys.lookup(BOB) == "bob" and len(keys) == 2
    with pytest.raises(ConfigError, match="same key"):
        ApiKeys({"alice": ALICE, "bob": ALICE})


def test_cli_reports_a_bad_key_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLUICE_API_KEYS", "alice:sk-shrt")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("sluice: SLUICE_API_KEYS: key 'alice' is shorter") and "sk-shrt" not in err
    )


# -- every route behind the check -----------------------------------------------------


def paths_and_methods(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Every (path, method) of the app, path parameters filled with a dummy."""
    for route in routes:
        if isinstance(route, Mount):
            yield from paths_and_methods(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            path = re.sub(r"\{[^}]*\}", "dummy", prefix + route.path)
            for method in sorted(route.methods or {"GET"}):
                yield path, method
        else:
            raise TypeError(f"a route of an unexpected kind: {route!r}")


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """A scripted server with three keys, and every (path, method) of its app."""
    app = create_app(
        Settings(model="scripted", api_key=CAROL, api_keys=f"alice:{ALICE},bob:{BOB}"),
        runner_factory=lambda s: ScriptedRunner(),
    )
    assert isinstance(app, RawSend) and isinstance(app.app, BearerAuth)
    routes = list(paths_and_methods(app.app.app.routes))
    with serve_app(app) as base:
        yield base, routes


PUBLIC = ("/health", "/")  # and the web page's files (tests/web/test_page.py)


def test_every_route_but_health_needs_a_key(keyed: tuple[str, list[tuple[str, str]]]) -> None:
    base, routes = keyed
    assert ("/health", "GET") in routes and ("/v1/chat/completions", "POST") in routes
    assert ("/ui/dummy", "GET") in routes  # not a file of the page: behind the key
    assert len(routes) > 10
    refused = 0
    with httpx.Client(base_url=base, timeout=10) as client:
        for path, method in [*routes, ("/no/such/route", "GET"), ("/no/such/route", "POST")]:
            for headers in (
                {},
                {"Authorization": "Bearer sk-wrong-0000"},
                {"Authorization": f"Bearer {ALICE}x"},
                {"Authorization": f"Basic {ALICE}"},
                {"Authorization": ALICE},
                {"x-api-key": "sk-wrong-0000"},
                {"x-api-key": f"{ALICE}x", "Authorization": f"Bearer {BOB}x"},
            ):
                r = client.request(method, path, headers=headers, json={})
                if path in PUBLIC:
                    assert r.status_code == 200, (method, path, headers)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer"
                if method != "HEAD" and path in OLLAMA_PATHS:  # Ollama's shape: a string
                    assert isinstance(r.json()["error"], str) and r.json()["error"], r.text
                elif method != "HEAD" and (
                    path.startswith("/v1beta/") or (":" in path and path.startswith("/v1/models/"))
                ):  # Google's shape
                    assert r.json()["error"]["status"] == "UNAUTHENTICATED", r.text
                elif method != "HEAD":
                    err = r.json()["error"]
                    assert err["type"] == "authentication_error"
                    if path.startswith("/v1/messages"):  # Anthropic's shape: no code
                        assert r.json()["type"] == "error", r.text
                    else:
                        assert err["code"] == "invalid_api_key"
                refused += 1
    assert refused >= 7 * (len(routes) - 3)  # /health; / by GET and HEAD


def test_the_right_key_gets_through(keyed: tuple[str, list[tuple[str, str]]]) -> None:
    base, routes = keyed
    with httpx.Client(base_url=base, timeout=10) as client:
        # GETs only: a POST with the right key would act (load, download, ...).
        for path, method in routes:
            if method == "GET":
                r = client.get(path, headers={"Authorization": f"Bearer {BOB}"})
                assert r.status_code != 401, (path, r.text)
        r = client.get("/no/such/route", headers={"Authorization": f"bearer  {ALICE}"})
        assert r.status_code == 404  # with a key, an unknown route is a plain 404
        body = {"messages": [{"role": "user", "content": "hi"}]}
        for key in (ALICE, CAROL):
            r = client.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        # Anthropic's header, the same keys and the same accounting; a wrong Bearer
        # beside a right x-api-key still gets in (clients may send a stale one).
        messages = {**body, "model": "scripted", "max_tokens": 8}
        for headers in ({"x-api-key": ALICE}, {"x-api-key": BOB, "Authorization": "Bearer no"}):
            r = client.post("/v1/messages", json=messages, headers=headers)
            assert r.status_code == 200 and r.json()["content"][0]["text"], r.text
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {ALICE}"}).text
    counts = dict(re.findall(r'sluice_requests_by_key_total\{key="(\w+)"\} (\S+)', metrics))
    assert float(counts["alice"]) >= 3 and float(counts["bob"]) >= 2
    assert float(counts["default"]) >= 1  # CAROL came in as --api-key


def test_a_route_sees_its_key_name() -> None:
    async def whoami(raw_request: Request) -> Response:
        return JSONResponse({"key": key_name(raw_request)})

    inner = Starlette(routes=[Route("/whoami", whoami), Route("/health", whoami)])
    app = BearerAuth(inner, ApiKeys({"alice": ALICE, "bob": BOB}))
    with serve_app(app) as base:
        for key, name in ((ALICE, "alice"), (BOB, "bob")):
            r = httpx.get(base + "/whoami", headers={"Authorization": f"Bearer {key}"})
            assert r.json() == {"key": name}
        assert httpx.get(base + "/whoami").status_code == 401
        assert httpx.get(base + "/health").json() == {"key": ""}  # no check, no name
    with serve_app(inner) as base:  # no keys: every caller is anonymous
        assert httpx.get(base + "/whoami").json() == {"key": ""}


def test_a_server_without_keys_has_no_check() -> None:
    with scripted_server(ScriptedRunner()) as base:
        assert httpx.get(base + "/v1/models").status_code == 200


def test_a_websocket_without_a_key_is_closed() -> None:
    sent: list[dict[str, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("reached the app")

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    app = BearerAuth(inner, ApiKeys({"alice": ALICE}))  # type: ignore[arg-type]
    scope = {"type": "websocket", "path": "/ws", "headers": []}
    asyncio.run(app(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]


def test_a_query_string_key_is_never_logged() -> None:
    import logging

    from sluice.server.auth import QueryKeyRedactor

    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        "",
        0,
        '%s - "%s %s HTTP/%s" %d',
        (
            "127.0.0.1:5",
            "POST",
            f"/v1beta/models/x:generateContent?alt=sse&key={ALICE}",
            "1.1",
            200,
        ),
        None,
    )
    assert QueryKeyRedactor().filter(record)
    line = record.getMessage()
    assert ALICE not in line and "?alt=sse&key=[redacted]" in line
