"""The chat store's schema versions: an older database is brought up to date when opened and keeps its chats."""

from __future__ import annotations

import sqlite3

from app.tui.store import SCHEMA_VERSION, ChatSettings, ChatStore

OLD_SCHEMA = """
CREATE TABLE chats (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done', stats TEXT NOT NULL DEFAULT '', created REAL NOT NULL);
CREATE INDEX messages_by_chat ON messages(chat_id, id);
CREATE TABLE prefs (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO chats VALUES (1, 'old chat', '', '{"temperature": 0.5}', 1.0, 1.0);
INSERT INTO messages VALUES (1, 1, 'user', 'hi', 'done', '', 1.0), (2, 1, 'assistant', 'hello', 'done', '', 2.0);
PRAGMA user_version=1;
"""


def test_a_version_1_database_gains_the_reasoning_column_and_keeps_its_chats(tmp_path) -> None:
    path = tmp_path / "chats.db"
    conn = sqlite3.connect(path)
    conn.executescript(OLD_SCHEMA)
    conn.close()
    store = ChatStore(path)
    assert store.notice is None
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    assert [(m.content, m.reasoning) for m in store.messages(1)] == [("hi", ""), ("hello", "")]
    assert store.get_chat(1).settings == ChatSettings(temperature=0.5)
    m = store.add_message(1, "assistant", "42", reasoning="six sevens")
    store.update_message(m.id, "42.", "done")  # no reasoning given: kept
    store.close()
    store = ChatStore(path)  # opened again: nothing left to migrate
    assert [(m.content, m.reasoning) for m in store.messages(1)][-1] == ("42.", "six sevens")
    store.close()


def test_a_database_of_a_newer_version_is_left_at_its_version(tmp_path) -> None:
    path = tmp_path / "chats.db"
    ChatStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=7")
    conn.close()
    store = ChatStore(path)
    assert store.notice is None and store.conn.execute("PRAGMA user_version").fetchone()[0] == 7
    store.close()
