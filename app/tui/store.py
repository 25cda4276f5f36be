"""Saved chats: one SQLite file (WAL mode) under the user's data dir; `ROOFLINE_HOME` overrides it.

Each message is written when it completes; a streaming reply is written as it goes (status "streaming")
so a killed app loses nothing already shown, and is read back as "interrupted".

The schema's version is SQLite's `user_version`; a database of an older version is brought up to date when it is
opened (`MIGRATIONS`), so chats saved by an earlier Roofline open in a later one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done',
    stats TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    reasoning TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, id);
CREATE TABLE IF NOT EXISTS prefs (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# (version, SQL): what brings a database of an earlier version to this one; SCHEMA above is the latest whole
MIGRATIONS = [
    (2, "ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''"),  # a reply's thinking, shown collapsed
]


def data_dir() -> Path:
    """`ROOFLINE_HOME`, else platformdirs' user data dir for "roofline"."""
    home = os.environ.get("ROOFLINE_HOME")
    if home:
        return Path(home).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("roofline", appauthor=False))


@dataclass
class ChatSettings:
    """Per-chat generation settings (the SamplingParams the user controls, plus a system prompt)."""

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    speculative: str | None = "auto"  # None: off; "auto" speculates only where the backend and acceptance say it pays
    num_draft_tokens: int = 4
    # a reasoning model's thinking effort (mlx_engine.api.REASONING_EFFORTS; "none" turns thinking off), None: the
    # model's own default; a model without reasoning is sent none
    reasoning_effort: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChatSettings:
        try:
            raw = json.loads(text or "{}")
        except ValueError:
            raw = {}
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__} if isinstance(raw, dict) else {}
        return cls(**known)


@dataclass
class Chat:
    id: int
    title: str
    model: str
    settings: ChatSettings
    created: float
    updated: float


@dataclass
class Message:
    id: int
    chat_id: int
    role: str  # "user" | "assistant"
    content: str
    status: str = "done"  # "done" | "stopped" | "error" | "streaming" | "interrupted" | "length"
    stats: dict[str, Any] = field(default_factory=dict)
    reasoning: str = ""  # a reasoning model's thinking before `content` (never sent back to the model)


class ChatStore:
    """Chats and their messages. `notice` is set when an unreadable database was moved aside."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else data_dir() / "chats.db"
        self.notice: str | None = None
        self.conn = self._open()

    # ---- opening ---------------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.notice = f"Cannot create {self.path.parent} ({e.strerror}); chats are kept in memory only."
            return self._connect(":memory:")
        try:
            return self._connect(str(self.path))
        except (sqlite3.DatabaseError, OSError) as e:
            moved = self._move_aside()
            if moved is None:
                self.notice = f"Chat database {self.path} is unreadable ({e}); chats are kept in memory only."
                return self._connect(":memory:")
            self.notice = f"Chat database was unreadable ({e}); moved it to {moved.name} and started a fresh one."
            return self._connect(str(self.path))

    @staticmethod
    def _connect(where: str) -> sqlite3.Connection:
        conn = sqlite3.connect(where, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=NORMAL")
            row = conn.execute("PRAGMA quick_check").fetchone()
            if row is None or row[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {row[0] if row else 'no answer'}")
            _migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self) -> Path | None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        try:
            self.path.rename(target)
            for suffix in ("-wal", "-shm"):
                side = self.path.with_name(self.path.name + suffix)
                if side.exists():
                    side.rename(target.with_name(target.name + suffix))
        except OSError:
            return None
        return target

    def close(self) -> None:
        self.conn.close()

    # ---- chats -----------------------------------------------------------------------------------------

    def create_chat(self, title: str = "New chat", model: str = "", settings: ChatSettings | None = None) -> Chat:
        now = time.time()
        s = settings or ChatSettings()
        cur = self.conn.execute(
            "INSERT INTO chats(title, model, settings, created, updated) VALUES (?, ?, ?, ?, ?)",
            (title, model, s.to_json(), now, now),
        )
        return Chat(int(cur.lastrowid), title, model, s, now, now)

    def list_chats(self) -> list[Chat]:
        """Newest (most recently updated) first."""
        rows = self.conn.execute(
            "SELECT id, title, model, settings, created, updated FROM chats ORDER BY updated DESC, id DESC"
        ).fetchall()
        return [Chat(r[0], r[1], r[2], ChatSettings.from_json(r[3]), r[4], r[5]) for r in rows]

    def get_chat(self, chat_id: int) -> Chat | None:
        r = self.conn.execute(
            "SELECT id, title, model, settings, created, updated FROM chats WHERE id=?", (chat_id,)
        ).fetchone()
        return None if r is None else Chat(r[0], r[1], r[2], ChatSettings.from_json(r[3]), r[4], r[5])

    def rename_chat(self, chat_id: int, title: str) -> None:
        self.conn.execute("UPDATE chats SET title=? WHERE id=?", (title, chat_id))

    def save_settings(self, chat_id: int, settings: ChatSettings) -> None:
        self.conn.execute("UPDATE chats SET settings=? WHERE id=?", (settings.to_json(), chat_id))

    def set_chat_model(self, chat_id: int, model: str) -> None:
        self.conn.execute("UPDATE chats SET model=? WHERE id=?", (model, chat_id))

    def touch(self, chat_id: int) -> None:
        self.conn.execute("UPDATE chats SET updated=? WHERE id=?", (time.time(), chat_id))

    def delete_chat(self, chat_id: int) -> None:
        with self.conn:
            self.conn.execute("DELETE FROM messages WHERE chat_id=?", (chat_id,))
            self.conn.execute("DELETE FROM chats WHERE id=?", (chat_id,))

    # ---- messages --------------------------------------------------------------------------------------

    def messages(self, chat_id: int) -> list[Message]:
        rows = self.conn.execute(
            "SELECT id, chat_id, role, content, status, stats, reasoning FROM messages WHERE chat_id=? ORDER BY id",
            (chat_id,)).fetchall()
        out = []
        for r in rows:
            status = "interrupted" if r[4] == "streaming" else r[4]
            out.append(Message(r[0], r[1], r[2], r[3], status, _stats(r[5]), r[6]))
        return out

    def add_message(self, chat_id: int, role: str, content: str, status: str = "done",
                    stats: dict[str, Any] | None = None, reasoning: str = "") -> Message:
        cur = self.conn.execute(
            "INSERT INTO messages(chat_id, role, content, status, stats, created, reasoning) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (chat_id, role, content, status, json.dumps(stats) if stats else "", time.time(), reasoning),
        )
        self.touch(chat_id)
        return Message(int(cur.lastrowid), chat_id, role, content, status, stats or {}, reasoning)

    def update_message(self, message_id: int, content: str, status: str, stats: dict[str, Any] | None = None,
                       reasoning: str | None = None) -> None:
        """`reasoning` None leaves the message's reasoning as it is."""
        self.conn.execute(
            "UPDATE messages SET content=?, status=?, stats=?, reasoning=coalesce(?, reasoning) WHERE id=?",
            (content, status, json.dumps(stats) if stats else "", reasoning, message_id),
        )

    def delete_messages_from(self, chat_id: int, message_id: int) -> None:
        """Deletes the message `message_id` and every later one of the chat (edit-and-resend, regenerate)."""
        self.conn.execute("DELETE FROM messages WHERE chat_id=? AND id>=?", (chat_id, message_id))

    # ---- preferences -----------------------------------------------------------------------------------

    def get_pref(self, key: str, default: str | None = None) -> str | None:
        r = self.conn.execute("SELECT value FROM prefs WHERE key=?", (key,)).fetchone()
        return default if r is None else r[0]

    def set_pref(self, key: str, value: str) -> None:
        self.conn.execute("INSERT INTO prefs(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                          (key, value))


def _migrate(conn: sqlite3.Connection) -> None:
    """Creates the schema in a new database, or brings an older one up to SCHEMA_VERSION, in one transaction (a
    second app opening the same file at once waits, then finds the work done). A newer database is left as it is."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        fresh = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='messages'").fetchone() is None
        if not fresh:
            for to, sql in MIGRATIONS:
                if version < to:
                    conn.execute(sql)
        for statement in SCHEMA.split(";"):  # executescript would commit the transaction first
            if statement.strip():
                conn.execute(statement)
        if version < SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _stats(text: str) -> dict[str, Any]:
    """A message's stats column: a JSON object, else (a row written by hand or damaged) none."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
