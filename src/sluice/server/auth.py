"""API keys: several named keys, checked in constant time on every route but the public
ones (``/health``, and the web page's files: nothing secret, and the page asks for a key).

Sources, merged (a name or a key given twice, in one source or across them, is an error):

* ``--api-key`` / ``SLUICE_API_KEY``: one key, named ``default``;
* ``SLUICE_API_KEYS="alice:sk-alice-1,bob:sk-bob-22"``: ``name:key`` pairs;
* the config file's ``[keys]`` table (``--config``)::

    [keys]
    alice = "sk-alice-1"              # the key itself
    bob = { env = "BOB_KEY" }         # read from this environment variable
    ci = { key = "sk-ci-key-0001", rpm = 60, max_streams = 4, models = ["qwen"] }

A table entry may carry limits (``rpm``, ``tpm``, ``max_streams``, ``token_budget`` with
``budget_period``, ``models``): ``models/limits.py`` says how each is counted.

Rules: a name is 1-64 of ``A-Z a-z 0-9 _ . -`` (it becomes a log word and a
metric label); a key is at least :data:`MIN_KEY_LENGTH` printable ASCII
characters without spaces (what an ``Authorization`` header can carry). The
old single ``--api-key`` keeps accepting shorter keys, with a warning, so
existing setups still start. Error messages name the source and the key's
name, never the key.

Example::

    keys = ApiKeys.from_settings(settings)
    keys.lookup("sk-alice-1")     # "alice"; None for an unknown token
    app = BearerAuth(starlette_app, keys)
    ...
    async def route(raw_request: Request) -> Response:
        owner = key_name(raw_request)   # "alice"; "" when the server has no keys
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sluice.config import Settings
from sluice.config.file import ConfigError, ConfigFile, describe_value
from sluice.core.errors import AuthenticationFailed, PermissionDenied, SluiceError
from sluice.models.limits import LIMIT_FIELDS, KeyLimits, parse_limits
from sluice.server.sse import error_response

log = logging.getLogger("sluice.api")

DEFAULT_NAME = "default"  # the name of --api-key / SLUICE_API_KEY
ADMIN, USER = "admin", "user"  # a key's role; a key named "admin" is an admin key
ROLES = (ADMIN, USER)
STATE_ROLE = "sluice_role"  # request.state.sluice_role: the caller's role
MIN_KEY_LENGTH = 8
STATE_KEY = "sluice_key"  # request.state.sluice_key: the name of the caller's key
ENV_KEYS = "SLUICE_API_KEYS"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: a header's token


class ApiKeys:
    """The server's keys by name, looked up in constant time.

    Only a SHA-256 digest of each key is kept: every comparison is then
    between two 32-byte strings, so its time says nothing about a key's length.

    Example::

        keys = ApiKeys({"alice": "sk-alice-1"})
        keys.lookup("sk-alice-1")    # "alice"
        keys.lookup("nope")          # None
        bool(ApiKeys({}))            # False: the server is open
    """

    def __init__(
        self,
        keys: Mapping[str, str],
        *,
        admins: Iterable[str] = (),
        source: str = "keys",
    ) -> None:
        self._entries = _checked((source, name, key, MIN_KEY_LENGTH) for name, key in keys.items())
        self._admins = _admins(self.names, admins)
        self.limits: dict[str, KeyLimits] = {}  # by name: the keys that have limits

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        env: Mapping[str, str] | None = None,
        config: ConfigFile | None = None,
    ) -> ApiKeys:
        """Every source merged: ``--api-key``, ``SLUICE_API_KEYS``, the config's ``[keys]``.

        ``env`` (default ``os.environ``) is where ``{ env = "VAR" }`` entries are read;
        ``config``: the config file already read (else ``settings.config`` is read).
        Anything wrong is a :class:`ConfigError` naming the source and the key's name.
        """
        env = os.environ if env is None else env
        found: list[tuple[str, str, str, int]] = []  # (source, name, key, minimum length)
        admins: list[str] = []
        if settings.api_key:
            admins.append(DEFAULT_NAME)  # the one key the operator starts it with
            # --api-key predates the length rule: a short one still starts, with a warning.
            if len(settings.api_key) < MIN_KEY_LENGTH:
                log.warning("--api-key is shorter than %d characters", MIN_KEY_LENGTH)
            found.append(("--api-key/SLUICE_API_KEY", DEFAULT_NAME, settings.api_key, 1))
        if settings.api_keys:
            parsed = parse_env_keys(settings.api_keys)
            found += [(ENV_KEYS, n, k, MIN_KEY_LENGTH) for n, k in parsed.items()]
        if config is None and settings.config:
            config = ConfigFile.read(settings.config)
        if config is not None:
            file = config.path
            table = config_keys(file, config.table("keys"), env)
            found += [(f"{file} [keys]", n, e.key, MIN_KEY_LENGTH) for n, e in table.items()]
            admins += [n for n, e in table.items() if e.role == ADMIN]
            limits = {n: e.limits for n, e in table.items() if e.limits}
        else:
            limits = {}
        keys = cls({})
        keys._entries = _checked(found)
        keys._admins = _admins(keys.names, admins)
        keys.limits = limits
        return keys

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._entries)

    def role(self, name: str) -> str:
        """``"admin"`` or ``"user"``: what the key named ``name`` may do."""
        return ADMIN if name in self._admins else USER

    def lookup(self, token: str) -> str | None:
        """The name of the key ``token`` is, or ``None``.

        Every key is compared, with no early exit, so the time taken depends
        on neither which key matched nor how much of one did.
        """
        # surrogatepass: never raises, and a lone surrogate cannot turn into an ASCII byte.
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found: str | None = None
        for name, expected in self._entries:
            if hmac.compare_digest(digest, expected):
                found = name
        return found

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ApiKeys({', '.join(self.names)})"  # names only: a repr ends up in logs


def parse_env_keys(raw: str) -> dict[str, str]:
    """``"alice:sk-1...,bob:sk-2..."`` -> ``{"alice": ..., "bob": ...}``.

    Spaces around entries and empty entries (a trailing comma) are ignored; a
    key may contain ``:`` (the name cannot) but not ``,``.
    """
    keys: dict[str, str] = {}
    for i, entry in enumerate(e.strip() for e in raw.split(",")):
        if not entry:
            continue
        name, sep, key = entry.partition(":")
        if not sep:
            # Without a ':' the entry may be a bare key: never echo it.
            raise ConfigError(f"{ENV_KEYS}: entry {i + 1} is not 'name:key'")
        name, key = name.strip(), key.strip()
        _check_name(ENV_KEYS, name)
        if name in keys:
            raise ConfigError(f"{ENV_KEYS}: key name {name!r} is given twice")
        _check_key(ENV_KEYS, name, key)
        keys[name] = key
    return keys


_ENTRY = (
    'a string, { key = "..." } or { env = "VARIABLE" } (either with role = "admin" and '
    "limits: " + ", ".join(LIMIT_FIELDS) + ")"
)


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One ``[keys]`` entry: the key, its role and its limits."""

    key: str
    role: str = USER
    limits: KeyLimits = field(default_factory=KeyLimits)


def config_keys(file: Path, table: Any, env: Mapping[str, str]) -> dict[str, KeyEntry]:
    """The config file's ``[keys]`` table: ``name = "key"``, or a table with the key
    (``key = "..."``) or where to read it (``env = "VAR"``), optionally ``role = "admin" |
    "user"`` (default user; a key named admin is admin) and limits (``models/limits.py``)."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ConfigError(f"{file}: 'keys' must be a table ([keys]), not {_kind(table)}")
    source = f"{file} [keys]"
    keys: dict[str, KeyEntry] = {}
    for name, value in table.items():
        _check_name(source, name)
        role = ADMIN if name == ADMIN else USER
        limits = KeyLimits()
        if isinstance(value, dict):
            role = value.get("role", role)
            if role not in ROLES:
                raise ConfigError(f"{source}: {name!r} has role {role!r}: admin or user")
            given = set(value) - {"role", *LIMIT_FIELDS}
            if given == {"key"} and isinstance(value["key"], str):
                key = value["key"]
                _check_key(source, name, key)
            elif given == {"env"} and isinstance(value["env"], str) and value["env"]:
                var = value["env"]
                read = env.get(var)
                if not read:
                    missing = "is not set" if read is None else "is empty"
                    raise ConfigError(f"{source}: {name!r} reads ${var}, which {missing}")
                key = read
                _check_key(f"{source} ({name!r} from ${var})", name, key)
            else:
                raise ConfigError(f"{source}: {name!r} must be {_ENTRY}")
            limits = parse_limits(source, name, value)
        elif isinstance(value, str):
            key = value
            _check_key(source, name, key)
        else:
            raise ConfigError(f"{source}: {name!r} must be {_ENTRY}, not {_kind(value)}")
        keys[name] = KeyEntry(key, role, limits)
    return keys


def key_name(raw_request: Request) -> str:
    """The name of the key the request came with; ``""`` when the server has no keys."""
    return str(raw_request.scope.get("state", {}).get(STATE_KEY, ""))


def is_admin(raw_request: Request) -> bool:
    """Whether the caller may manage models and see every key's requests: an admin key,
    or a server with no keys (open, on loopback or as told)."""
    return bool(raw_request.scope.get("state", {}).get(STATE_ROLE, ADMIN) == ADMIN)


def require_admin(raw_request: Request, what: str) -> None:
    """:class:`PermissionDenied` (403) unless the caller :func:`is_admin`."""
    if not is_admin(raw_request):
        raise PermissionDenied(_needs_admin(what, raw_request.scope))


def _needs_admin(what: str, scope: Scope) -> str:
    name = scope.get("state", {}).get(STATE_KEY, "")
    if not name:
        return (
            f"{what} needs an admin key; this server has no keys and listens beyond "
            "loopback (start it with keys, or --allow-unauthenticated-admin)."
        )
    return f"{what} needs an admin key; the key '{name}' is a user key."


def _admins(names: Iterable[str], admins: Iterable[str]) -> frozenset[str]:
    wanted = set(admins) | {ADMIN}  # a key named admin has always been one
    return frozenset(n for n in names if n in wanted)


def names_line(names: Iterable[str]) -> str:
    """The startup log's words for the keys: names only, never the keys."""
    listed = ", ".join(names)
    return f"API keys: {listed}" if listed else "API keys: none (every route is open)"


class BearerAuth:
    """Requires a key on every route but the ``public`` paths (``/health`` unless told),
    and an admin key on the routes ``admin_only`` names (with no keys, ``open_role``
    decides):
    ``Authorization: Bearer <key>``, or ``x-api-key: <key>`` (Anthropic's header; the
    same keys). A public path is matched exactly (a set lookup: as cheap as the one
    comparison it replaced), so ``/ui/../v1/models`` is not public.

    Unknown routes answer 401 as well, so nobody learns which routes exist
    without a key. The key's name goes into the ASGI scope's state
    (``request.state.sluice_key``, read it with :func:`key_name`) and is
    counted in ``sluice_requests_by_key_total``. Other attributes (``routes``,
    ``state``, ...) are the wrapped app's.

    Example::

        app = BearerAuth(Starlette(routes=[...]), ApiKeys.from_settings(settings))
        app.app.routes      # the wrapped app's routes
    """

    def __init__(
        self,
        app: Any,  # the Starlette app (or a layer that passes its attributes through)
        keys: ApiKeys,
        render_for: Callable[[str], Callable[[SluiceError], Response]] | None = None,
        *,
        public: Iterable[str] = ("/health",),
        admin_only: Callable[[str, str], str | None] = lambda method, path: None,
        open_role: str = USER,
    ) -> None:
        self.app = app
        self.keys = keys
        self.public = frozenset(public)
        # What (method, path) does if only an admin may ("Loading a model"), else None.
        self.admin_only = admin_only
        self.open_role = open_role  # the caller's role when the server has no keys
        # The refusal in the shape of the dialect at a path (OpenAI's by default).
        self.render_for = render_for or (lambda path: error_response)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in self.public:
            if self.keys:
                name = self._authenticate(scope)
                if name is None:
                    await self._refuse(scope, receive, send)
                    return
                role = self.keys.role(name)
                # The metrics live in the state the lifespan builds; before it there is none.
                metrics = getattr(getattr(self.app.state, "sluice", None), "metrics", None)
                if metrics is not None:
                    metrics.count_key(name)
            else:
                name, role = "", self.open_role
            state = scope.setdefault("state", {})
            state[STATE_KEY] = name
            state[STATE_ROLE] = role
            if role != ADMIN and scope["type"] == "http":
                what = self.admin_only(scope["method"], scope["path"])
                if what is not None:  # refused before anything else is read
                    denied = PermissionDenied(_needs_admin(what, scope))
                    await self.render_for(scope["path"])(denied)(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _authenticate(self, scope: Scope) -> str | None:
        auth: bytes | None = None
        api_key: bytes | None = None
        for header, value in scope["headers"]:
            if header == b"authorization":
                auth = value  # the last one wins, as with dict(headers)
            elif header == b"x-api-key" or header == b"x-goog-api-key":
                api_key = value  # Anthropic's header, Google's
        if auth is not None:
            scheme, _, token = auth.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                name = self.keys.lookup(token.strip())
                if name is not None or api_key is None:
                    return name
        if api_key is not None:
            return self.keys.lookup(api_key.decode("latin-1").strip())
        query = scope.get("query_string", b"")
        if b"key=" in query:  # Google's ?key=KEY (never logged: only its name is)
            for name, value in parse_qsl(query.decode("latin-1")):
                if name == "key":
                    return self.keys.lookup(value.strip())
        return None

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # A close before the accept: the server answers the handshake with a 403.
            await send({"type": "websocket.close", "code": 1008})
            return
        resp = self.render_for(scope["path"])(
            AuthenticationFailed(
                "Missing or invalid API key (Authorization: Bearer ... or x-api-key: ...)."
            )
        )
        resp.headers["WWW-Authenticate"] = "Bearer"
        await resp(scope, receive, send)


def _checked(
    found: Iterable[tuple[str, str, str, int]],
) -> tuple[tuple[str, bytes], ...]:
    """(name, digest) per key, once every name and key is checked and known unique."""
    names: dict[str, str] = {}  # name -> its source
    owners: dict[bytes, tuple[str, str]] = {}  # digest -> (name, source)
    for source, name, key, minimum in found:
        _check_name(source, name)
        _check_key(source, name, key, minimum)
        if name in names:
            raise ConfigError(f"{source}: key name {name!r} is also given in {names[name]}")
        names[name] = source
        digest = _digest(key)
        if digest in owners:
            first, where = owners[digest]
            raise ConfigError(
                f"{source}: key {name!r} is the same key as {first!r} ({where}); "
                "each caller needs its own key"
            )
        owners[digest] = (name, source)
    return tuple((name, digest) for digest, (name, _) in owners.items())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _check_name(source: str, name: Any) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"{source}: key name {name!r} must be 1-64 characters of A-Z a-z 0-9 _ . -"
        )


def _check_key(source: str, name: str, key: Any, minimum: int = MIN_KEY_LENGTH) -> None:
    # The messages name the key, never show it: they end up in logs and terminals.
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{source}: key {name!r} is empty")
    if not _KEY.fullmatch(key):
        raise ConfigError(
            f"{source}: key {name!r} must be printable ASCII without spaces "
            "(what an Authorization header carries)"
        )
    if len(key) < minimum:
        raise ConfigError(
            f"{source}: key {name!r} is shorter than {minimum} characters (easy to guess)"
        )


def _kind(value: Any) -> str:
    return describe_value(value).split(" (")[0]  # the type's words, not the value


_QUERY_KEY = re.compile(r"([?&]key=)[^&#\s]*")


class QueryKeyRedactor(logging.Filter):
    """Google's ``?key=KEY`` out of access-log lines (uvicorn's ``uvicorn.access`` records
    carry the path with its query): the key becomes ``[redacted]``, the line stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) and "key=" in a for a in args):
            record.args = tuple(
                _QUERY_KEY.sub(r"\1[redacted]", a) if isinstance(a, str) else a for a in args
            )
        return True
