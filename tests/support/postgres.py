"""A real PostgreSQL server for tests: initdb into a temporary folder, one loopback port.

Debian's ``postgresql`` package puts its programs in ``/usr/lib/postgresql/<version>/bin``
(not on PATH); :func:`find_bin` looks there too. PostgreSQL refuses to run as root, so
when the tests run as root the server runs as the ``postgres`` OS user (``runuser``) in
a folder that user owns. Durability is off (``fsync=off``): a test database is thrown away.

Example::

    with PostgresServer.start() as server:
        url = server.create_database()   # postgresql://sluice:...@127.0.0.1:PORT/t1
        ...
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

USER = "sluice"
PASSWORD = "test-secret-pw"


def find_bin(name: str = "initdb") -> Path | None:
    """PostgreSQL's ``name`` program: on PATH, else the newest Debian install; None if absent."""
    found = shutil.which(name)
    if found:
        return Path(found).resolve()
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(candidates[-1]) if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One running server; :meth:`create_database` gives each test a fresh database."""

    def __init__(self, bindir: Path, root: Path, port: int, run_as: str | None) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.port = port
        self.run_as = run_as
        self._databases = 0

    @classmethod
    @contextlib.contextmanager
    def start(cls) -> Iterator[PostgresServer]:
        initdb = find_bin("initdb")
        if initdb is None:
            raise FileNotFoundError("PostgreSQL is not installed (no initdb)")
        run_as = "postgres" if os.geteuid() == 0 else None
        root = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
        if run_as is not None:
            entry = pwd.getpwnam(run_as)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        server = cls(initdb.parent, root, _free_port(), run_as)
        try:
            server._initdb()
            server._pg_ctl(
                "start", "-w", "-t", "60", "-l", str(root / "log"), "-o", server._options()
            )
            yield server
        finally:
            with contextlib.suppress(Exception):
                server._pg_ctl("stop", "-m", "immediate", "-w", "-t", "30")
            shutil.rmtree(root, ignore_errors=True)

    def url(self, database: str = "postgres", *, password: str = PASSWORD) -> str:
        return f"postgresql://{USER}:{password}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; its URL (with the password)."""
        import psycopg

        self._databases += 1
        name = f"t{os.getpid()}_{self._databases}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0 STRATEGY FILE_COPY')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def log(self) -> str:
        try:
            return (self.root / "log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    # -- running the programs --------------------------------------------------

    def _options(self) -> str:
        return " ".join(
            (
                f"-c port={self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.root}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
                "-c shared_buffers=32MB",
            )
        )

    def _initdb(self) -> None:
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.run_as is not None:
            entry = pwd.getpwnam(self.run_as)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
            "--locale=C",
        )

    def _pg_ctl(self, *args: str) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), *args)

    def _run(self, *argv: str) -> None:
        command = list(argv)
        if self.run_as is not None:
            command = ["runuser", "-u", self.run_as, "--", *command]
        done = subprocess.run(
            command,
            check=False,
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:2])} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
                f"\n{self.log()}"
            )
