"""The store's tests run on both databases: ``backend`` is SQLite, then PostgreSQL.

One real PostgreSQL server serves the whole session (``postgres_server`` in
tests/conftest.py); each test gets a database of its own. Without PostgreSQL installed its tests skip, unless
``SLUICE_REQUIRE_POSTGRES=1`` (CI sets it): then they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sluice.store import PostgresStore, SQLiteStore, open_store

Store = SQLiteStore | PostgresStore


class Backend:
    """One database kind, for tests written once for both."""

    def __init__(self, name: str, location: str) -> None:
        self.name = name
        self.location = location  # a SQLite file, or a PostgreSQL URL

    async def open(self, **options: Any) -> Store:
        if self.name == "postgres":
            return await PostgresStore.open(self.location, **options)
        store = await open_store(self.location)
        assert isinstance(store, SQLiteStore)
        return store

    def hold(self, seconds: float) -> Callable[[Any], Any]:
        """A write that keeps the store's writer busy ``seconds`` (for ``store._call``)."""
        if self.name == "postgres":
            return lambda conn: asyncio.sleep(seconds)
        return lambda conn: time.sleep(seconds)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """``sql`` (``?`` placeholders) on a connection of its own, outside the store."""
        if self.name == "postgres":
            import psycopg

            with psycopg.connect(self.location, autocommit=True) as pg:
                cursor = pg.execute(sql.replace("?", "%s").encode(), params)
                return list(cursor.fetchall()) if cursor.description else []
        with contextlib.closing(sqlite3.connect(self.location)) as lite, lite:
            return list(lite.execute(sql, params).fetchall())


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "postgres":
        return Backend("postgres", request.getfixturevalue("postgres_url"))
    return Backend("sqlite", str(tmp_path / "sub" / "conversations.db"))


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    opened = await backend.open()
    yield opened
    await opened.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    opened = await SQLiteStore.open(tmp_path / "sub" / "conversations.db")
    yield opened
    await opened.close()
