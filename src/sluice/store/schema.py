"""The conversation database's schema (numbered migrations) and how a connection opens.

Example::

    conn = connect("conversations.db", MIGRATIONS)   # WAL, FULL sync, migrated
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from sluice.store.models import StoreFailed

log = logging.getLogger("sluice.store")

# Numbered migrations: entry N (0-based) takes the schema from user_version N
# to N + 1. Append only; never edit one that has shipped.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        user_id TEXT,
        model TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        head_id TEXT,
        message_count INTEGER NOT NULL DEFAULT 0
    );
    -- the list query: WHERE owner = ? AND user_id IS ? ORDER BY updated_at DESC
    CREATE INDEX conversations_by_owner ON conversations (owner, user_id, updated_at);
    CREATE TABLE messages (
        seq INTEGER PRIMARY KEY,  -- creation order
        id TEXT NOT NULL UNIQUE,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        parent_id TEXT REFERENCES messages (id),
        role TEXT NOT NULL,
        content TEXT,  -- JSON
        created_at REAL NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('complete', 'incomplete', 'failed')),
        model TEXT,
        reasoning TEXT,
        tool_calls TEXT,  -- JSON
        tool_call_id TEXT,
        name TEXT,
        usage TEXT,  -- JSON
        error TEXT,
        finish_reason TEXT
    );
    CREATE INDEX messages_by_conversation ON messages (conversation_id, seq);
    CREATE INDEX messages_by_parent ON messages (parent_id);
    """,
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        conversation_id TEXT REFERENCES conversations (id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        body TEXT NOT NULL,  -- JSON: the response object
        input_items TEXT NOT NULL  -- JSON
    );
    """,
    """
    ALTER TABLE conversations ADD COLUMN title TEXT;  -- a name the user gave it
    """,
    """
    -- the usage ledger: one row per API key, model and day (UTC), counts added up
    CREATE TABLE usage (
        key TEXT NOT NULL,
        model TEXT NOT NULL,
        day TEXT NOT NULL,  -- YYYY-MM-DD
        requests INTEGER NOT NULL DEFAULT 0,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        errors INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (key, model, day)
    ) WITHOUT ROWID;
    CREATE INDEX usage_by_day ON usage (day);
    -- the limits' counters: a request taken, tokens used, at a time (an hour is kept)
    CREATE TABLE rate_requests (key TEXT NOT NULL, at REAL NOT NULL);
    CREATE INDEX rate_requests_by_key ON rate_requests (key, at);
    CREATE TABLE rate_tokens (key TEXT NOT NULL, at REAL NOT NULL, tokens INTEGER NOT NULL);
    CREATE INDEX rate_tokens_by_key ON rate_tokens (key, at);
    """,
)


def connect(path: str, migrations: tuple[str, ...]) -> sqlite3.Connection:
    if path != ":memory:" and not path.startswith("file:"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    # isolation_level None: the module starts no transactions of its own; the
    # store thread says BEGIN and COMMIT itself.
    conn = sqlite3.connect(path, isolation_level=None, uri=path.startswith("file:"))
    try:
        conn.execute("PRAGMA busy_timeout = 5000")
        # WAL: a commit appends to the log instead of rewriting pages, readers never
        # block the writer, and a process killed mid-write leaves the last committed
        # state intact.
        conn.execute("PRAGMA journal_mode = WAL")
        # FULL, not WAL's usual NORMAL: NORMAL already survives SIGKILL (the OS holds
        # the written log), but may lose the last commits to a power cut or kernel
        # panic. FULL fsyncs the log at every COMMIT, so an acknowledged turn is on
        # disk; group commit shares that fsync among concurrent turns.
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        migrate(conn, migrations, path)
    except BaseException:
        conn.close()
        raise
    return conn


def migrate(conn: sqlite3.Connection, migrations: tuple[str, ...], path: str) -> None:
    """Apply the migrations this file has not had yet, each with its version bump atomically."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version > len(migrations):
        raise StoreFailed(
            f"The conversation database is at schema version {version}, newer than this "
            f"sluice knows ({len(migrations)}); upgrade sluice or use another file."
        )
    for number in range(version, len(migrations)):
        # One script, one transaction: a crash mid-migration leaves the old version.
        # (executescript would COMMIT a transaction begun outside it, so BEGIN is inside.)
        try:
            conn.executescript(
                f"BEGIN IMMEDIATE;\n{migrations[number]}\n;"
                f"PRAGMA user_version = {number + 1};\nCOMMIT;"
            )
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        log.info("conversation store %s migrated to version %d", path, number + 1)
