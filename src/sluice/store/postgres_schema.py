"""The PostgreSQL store's schema (numbered migrations), how it migrates, and its URL shown safely.

The schema's version is the one row of ``sluice_schema``. Several sluice processes
may start at once on one database: each takes a session advisory lock before it
reads the version, so one migrates and the others then find the work done.

Example::

    await migrate(conn, MIGRATIONS, describe(url))  # conn: an autocommit AsyncConnection
    describe("postgresql://app:secret@db:5432/sluice")  # "postgresql://app@db:5432/sluice"
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from sluice.store.models import StoreFailed

log = logging.getLogger("sluice.store")

# The advisory locks' first key: sluice's (the second tells what is locked).
LOCK_CLASS = 0x51CE
MIGRATION_LOCK = 0  # second key of the migration lock; the rate counters' is a hash of the key

# Numbered migrations: entry N (0-based) takes the schema from version N to N + 1.
# Append only; never edit one that has shipped. The tables are SQLite's (store/schema.py)
# with PostgreSQL's types, plus what several processes on one database need: `instances`
# (which sluice processes are alive) and each response's instance.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE conversations (
        seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,  -- creation order: breaks ties
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        user_id TEXT,
        model TEXT,
        created_at DOUBLE PRECISION NOT NULL,  -- unix seconds
        updated_at DOUBLE PRECISION NOT NULL,
        head_id TEXT,
        message_count INTEGER NOT NULL DEFAULT 0,
        title TEXT
    );
    CREATE INDEX conversations_by_owner
        ON conversations (owner, user_id, updated_at DESC, seq DESC);
    CREATE TABLE messages (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- creation order
        id TEXT NOT NULL UNIQUE,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        parent_id TEXT REFERENCES messages (id),
        role TEXT NOT NULL,
        content TEXT,  -- JSON
        created_at DOUBLE PRECISION NOT NULL,
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
    -- the sluice processes using this database, each seen at its last heartbeat
    CREATE TABLE instances (
        id TEXT PRIMARY KEY,
        started_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
        last_seen TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
    );
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        conversation_id TEXT REFERENCES conversations (id) ON DELETE CASCADE,
        created_at DOUBLE PRECISION NOT NULL,
        body TEXT NOT NULL,  -- JSON: the response object
        input_items TEXT NOT NULL,  -- JSON
        instance TEXT,  -- the process that stored it last (what runs it, while unfinished)
        unfinished BOOLEAN NOT NULL DEFAULT false  -- body's status is queued or in_progress
    );
    CREATE INDEX responses_unfinished ON responses (instance) WHERE unfinished;
    -- the usage ledger: one row per API key, model and day (UTC), counts added up
    CREATE TABLE usage (
        key TEXT NOT NULL,
        model TEXT NOT NULL,
        day TEXT NOT NULL,  -- YYYY-MM-DD
        requests BIGINT NOT NULL DEFAULT 0,
        prompt_tokens BIGINT NOT NULL DEFAULT 0,
        cached_tokens BIGINT NOT NULL DEFAULT 0,
        completion_tokens BIGINT NOT NULL DEFAULT 0,
        errors BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (key, model, day)
    );
    CREATE INDEX usage_by_day ON usage (day);
    -- the limits' counters: a request taken, tokens used, at a time (an hour is kept)
    CREATE TABLE rate_requests (key TEXT NOT NULL, at DOUBLE PRECISION NOT NULL);
    CREATE INDEX rate_requests_by_key ON rate_requests (key, at);
    CREATE TABLE rate_tokens (
        key TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, tokens BIGINT NOT NULL
    );
    CREATE INDEX rate_tokens_by_key ON rate_tokens (key, at);
    -- One request taken for p_key if fewer than p_limit were taken after p_now - p_window
    -- (one taken "after" p_now counts too: another process read its clock later, or a
    -- little ahead, but took the lock first).
    -- The advisory lock makes count-then-insert one step for every process: a second
    -- taker of the same key waits for the first's commit, and then (each statement of a
    -- volatile function sees a fresh snapshot) counts its row. One lock per
    -- transaction: no deadlock. Not admitted: the time of the request whose leaving
    -- admits one more (NULL when p_limit is 0).
    CREATE FUNCTION sluice_take_request(
        p_key TEXT, p_limit INTEGER, p_window DOUBLE PRECISION, p_now DOUBLE PRECISION
    ) RETURNS TABLE (admitted BOOLEAN, oldest DOUBLE PRECISION)
    LANGUAGE plpgsql VOLATILE AS $$
    DECLARE
        taken BIGINT;
    BEGIN
        PERFORM pg_advisory_xact_lock(20942, hashtext(p_key));
        SELECT count(*) INTO taken FROM rate_requests AS r
            WHERE r.key = p_key AND r.at > p_now - p_window;
        IF taken < p_limit THEN
            INSERT INTO rate_requests (key, at) VALUES (p_key, p_now);
            RETURN QUERY SELECT true, NULL::DOUBLE PRECISION;
            RETURN;
        END IF;
        RETURN QUERY SELECT false, r.at FROM rate_requests AS r
            WHERE r.key = p_key AND r.at > p_now - p_window
            ORDER BY r.at OFFSET taken - p_limit LIMIT 1;
        IF NOT FOUND THEN
            RETURN QUERY SELECT false, NULL::DOUBLE PRECISION;
        END IF;
    END
    $$;
    """,
    # 2: a background run's events, so any instance can resume its stream, and a cancel
    # asked through another instance than the one running it (which polls for it).
    """
    CREATE TABLE response_events (
        response_id TEXT NOT NULL,
        seq INTEGER NOT NULL,  -- the event's sequence_number
        frame BYTEA NOT NULL,  -- the SSE frame as sent
        at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
        PRIMARY KEY (response_id, seq)
    );
    CREATE INDEX response_events_by_time ON response_events (at);
    ALTER TABLE responses ADD COLUMN cancel_requested BOOLEAN NOT NULL DEFAULT false;
    """,
    # 3: add_messages writes in one call, so the writer can send a whole batch of
    # writes at once (pipelined) and wait once. p_writes: a JSON array of writes, each
    # {"conversation", "advance", "now", "head_parent", "parents", "ids", "messages"},
    # planned by the caller without reading the database (ids, times, the chain):
    # "messages" are rows of the messages table's columns in sluice/store/common.py's
    # MESSAGE_FIELDS order (a migration adding a column redefines this function), and
    # "parents" and "ids" name what the plan took for granted: messages of this
    # conversation, ids not taken. For each write, in order, under its conversation's
    # row lock (each statement then sees a fresh snapshot: what others committed before
    # the lock was granted), the function checks those and inserts the messages and
    # moves the head only if all hold, the first message's parent being the head read
    # under the lock when "head_parent". One row a write, in order; it raises for
    # nothing a caller did wrong: not known is an unknown conversation, a parent or an
    # id named back a broken rule (either way that write wrote nothing).
    """
    CREATE FUNCTION sluice_add_messages(p_writes JSONB)
    RETURNS TABLE (known BOOLEAN, head TEXT, missing_parents TEXT[], taken_ids TEXT[])
    LANGUAGE plpgsql VOLATILE AS $$
    DECLARE
        w JSONB;
        m JSONB;
        v_conversation TEXT;
        v_count INTEGER;
    BEGIN
        -- (loops by index, and no check query for an empty list: a query costs more
        -- than an expression, and a write runs a few)
        FOR i IN 0 .. jsonb_array_length(p_writes) - 1 LOOP
            w := p_writes->i;
            v_conversation := w->>'conversation';
            head := NULL;
            missing_parents := '{}';
            taken_ids := '{}';
            SELECT c.head_id INTO head FROM conversations AS c
                WHERE c.id = v_conversation FOR UPDATE;
            known := FOUND;
            IF known AND jsonb_array_length(w->'parents') > 0 THEN
                missing_parents := ARRAY(
                    SELECT p FROM jsonb_array_elements_text(w->'parents') AS p
                    WHERE NOT EXISTS (SELECT 1 FROM messages AS o
                        WHERE o.id = p AND o.conversation_id = v_conversation));
            END IF;
            IF known AND jsonb_array_length(w->'ids') > 0 THEN
                taken_ids := ARRAY(
                    SELECT g FROM jsonb_array_elements_text(w->'ids') AS g
                    WHERE EXISTS (SELECT 1 FROM messages AS o WHERE o.id = g));
            END IF;
            IF known AND cardinality(missing_parents) = 0 AND cardinality(taken_ids) = 0 THEN
                v_count := jsonb_array_length(w->'messages');
                FOR k IN 0 .. v_count - 1 LOOP  -- one INSERT each: seq follows their order
                    m := w->'messages'->k;
                    INSERT INTO messages (id, conversation_id, parent_id, role, content,
                        created_at, status, model, reasoning, tool_calls, tool_call_id,
                        name, usage, error, finish_reason)
                    VALUES (m->>0, v_conversation,
                        CASE WHEN k = 0 AND (w->>'head_parent')::BOOLEAN
                            THEN head ELSE m->>2 END,
                        m->>3, m->>4, (m->>5)::DOUBLE PRECISION, m->>6, m->>7, m->>8,
                        m->>9, m->>10, m->>11, m->>12, m->>13, m->>14);
                END LOOP;
                UPDATE conversations AS c SET updated_at = (w->>'now')::DOUBLE PRECISION,
                    message_count = c.message_count + v_count,
                    head_id = CASE WHEN (w->>'advance')::BOOLEAN
                        THEN w->'messages'->(v_count - 1)->>0 ELSE c.head_id END
                    WHERE c.id = v_conversation;
            END IF;
            RETURN NEXT;
        END LOOP;
    END
    $$;
    """,
    # 4: a key's streams in flight across the instances (max_streams): a lease a stream,
    # held by the instance serving it. Those of instances gone (no heartbeat for
    # p_dead_after seconds) do not count, and a heartbeat deletes them. Taken under an
    # advisory lock on the key, as sluice_take_request: count-then-insert is one step.
    """
    CREATE TABLE stream_leases (
        id BIGSERIAL PRIMARY KEY,
        key TEXT NOT NULL,
        instance TEXT NOT NULL,
        at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
    );
    CREATE INDEX stream_leases_by_key ON stream_leases (key);
    CREATE INDEX stream_leases_by_instance ON stream_leases (instance);
    CREATE FUNCTION sluice_take_stream(
        p_key TEXT, p_limit INTEGER, p_instance TEXT, p_dead_after DOUBLE PRECISION
    ) RETURNS BIGINT  -- the lease's id; NULL when p_limit leases are held
    LANGUAGE plpgsql VOLATILE AS $$
    DECLARE
        held BIGINT;
        lease BIGINT;
    BEGIN
        PERFORM pg_advisory_xact_lock(20943, hashtext(p_key));
        SELECT count(*) INTO held FROM stream_leases AS l
            WHERE l.key = p_key AND (l.instance = p_instance OR EXISTS (
                SELECT 1 FROM instances AS i WHERE i.id = l.instance
                AND i.last_seen > clock_timestamp() - make_interval(secs => p_dead_after)));
        IF held >= p_limit THEN
            RETURN NULL;
        END IF;
        INSERT INTO stream_leases (key, instance) VALUES (p_key, p_instance)
            RETURNING id INTO lease;
        RETURN lease;
    END
    $$;
    """,
)


async def migrate(
    conn: psycopg.AsyncConnection[Any], migrations: tuple[str, ...], where: str
) -> None:
    """Apply the migrations this database has not had yet, each with its version bump
    atomically; under an advisory lock, so concurrent starters migrate once."""
    await conn.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_CLASS, MIGRATION_LOCK))
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS sluice_schema (version INTEGER NOT NULL)")
        row = await (await conn.execute("SELECT version FROM sluice_schema")).fetchone()
        if row is None:
            await conn.execute("INSERT INTO sluice_schema (version) VALUES (0)")
        version = 0 if row is None else int(row[0])
        if version > len(migrations):
            raise StoreFailed(
                f"The conversation database {where} is at schema version {version}, newer "
                f"than this sluice knows ({len(migrations)}); upgrade sluice or use another "
                "database."
            )
        for number in range(version, len(migrations)):
            # One script, one transaction: a failure mid-migration leaves the old version.
            async with conn.transaction():
                await conn.execute(migrations[number].encode())
                await conn.execute("UPDATE sluice_schema SET version = %s", (number + 1,))
            log.info("conversation store %s migrated to version %d", where, number + 1)
    finally:
        if not conn.closed:
            await conn.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_CLASS, MIGRATION_LOCK))


def describe(url: str) -> str:
    """``url`` without its password, for messages and logs: ``postgresql://user@host:port/db``."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.Error:
        return "(a PostgreSQL URL that does not parse)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = str(parts.get("host") or "localhost")
    port = f":{parts['port']}" if parts.get("port") else ""
    database = str(parts.get("dbname") or parts.get("user") or "")
    return f"postgresql://{user}{host}{port}/{database}"


def scrub(text: str, url: str) -> str:
    """``text`` with ``url``'s password (as given and as decoded) replaced by ``***``."""
    try:
        password = conninfo_to_dict(url).get("password")
    except psycopg.Error:
        password = urllib.parse.urlsplit(url).password
    if password:
        for form in {str(password), urllib.parse.quote(str(password), safe="")}:
            text = text.replace(form, "***")
    return text
