"""Stored responses (``POST /v1/responses`` with ``store``): one SQLite database.

A row is one response: its owner (the SHA-256 of the API key that created it, ``""`` when the
server has no keys), the response object as returned, and the conversation it answered (the
items of every earlier turn, then this turn's input) so ``previous_response_id`` needs one read.

Every statement runs on one connection in one worker thread (``asyncio`` never blocks on the
disk, and the statements of this process never race). The file is in WAL mode, so readers and
another process's writer do not block each other; a writer waits up to ``busy_timeout`` for a
lock and then fails: every failure is a :class:`~stoic.errors.StorageFailed` naming the database
(a 503), never a hang. A response is stored (committed) before the client is told it completed.
Retention: after each insert only the newest ``retention`` responses are kept.

``:memory:`` keeps the database in memory: it serves ``previous_response_id`` while the server
runs and keeps nothing after it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .._logging import get_logger
from ..errors import StorageFailed

__all__ = ["MEMORY", "ResponseStore", "StoredResponse", "default_responses_db"]

_log = get_logger("stoic.http")
_T = TypeVar("_T")

MEMORY = ":memory:"
#: the schema version (``PRAGMA user_version``); a newer file is refused, not rewritten
_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    items TEXT NOT NULL
)
"""


def default_responses_db() -> Path:
    """``$STOIC_DATA_DIR/responses.sqlite3``, else under ``$XDG_DATA_HOME/stoic``, else
    ``~/.local/share/stoic``."""
    env = os.environ.get("STOIC_DATA_DIR")
    if env:
        root = Path(env).expanduser()
    else:
        root = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "stoic"
    return root / "responses.sqlite3"


@dataclass(frozen=True)
class StoredResponse:
    #: the response object as it was returned
    response: dict[str, Any]
    #: the conversation it answered: earlier turns' items, then this turn's input items
    items: list[dict[str, Any]]


class ResponseStore:
    """The database of stored responses at ``path`` (a file, created with its directory, or
    :data:`MEMORY`), keeping the newest ``retention`` responses.

    :raises StorageFailed: if the file cannot be opened or is not a stoic responses database.
    :raises ValueError: if ``retention`` is below 1.
    """

    def __init__(
        self, path: str | Path = MEMORY, *, retention: int = 10_000, busy_timeout: float = 5.0
    ) -> None:
        if retention < 1:
            raise ValueError("the responses retention must be at least 1")
        self.path = str(path)
        self.retention = retention
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoic-responses")
        try:
            self._db = self._pool.submit(self._connect, busy_timeout).result()
        except BaseException:
            self._pool.shutdown()
            raise

    def _failed(self, doing: str, exc: BaseException) -> StorageFailed:
        return StorageFailed(f"the responses database {self.path} failed {doing}: {exc}")

    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        try:
            if self.path != MEMORY:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
        except (sqlite3.Error, OSError) as exc:
            raise self._failed("to open", exc) from exc
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > _VERSION:
                raise StorageFailed(
                    f"the responses database {self.path} was written by a newer stoic "
                    f"(schema {version}, this one reads {_VERSION})"
                )
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(_SCHEMA)
            db.execute(f"PRAGMA user_version={_VERSION}")
        except sqlite3.Error as exc:
            db.close()
            raise self._failed("to open (is it a responses database?)", exc) from exc
        except BaseException:
            db.close()
            raise
        return db

    async def _run(self, doing: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        def call() -> _T:
            try:
                return fn(self._db)
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.rollback()
                raise self._failed(doing, exc) from exc

        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        except StorageFailed as exc:
            _log.error("http.responses_db_failed", message=exc.message)
            raise

    async def put(self, owner: str, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Store ``response`` (committed when this returns), then apply the retention."""
        row = (
            response["id"],
            owner,
            float(response["created_at"]),
            _dumps(response),
            _dumps(items),
        )

        def put(db: sqlite3.Connection) -> None:
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", row)
                db.execute(
                    "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses "
                    "ORDER BY rowid DESC LIMIT -1 OFFSET ?)",
                    (self.retention,),
                )

        await self._run("to store a response", put)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response ``response_id`` if ``owner`` stored it, else None."""

        def get(db: sqlite3.Connection) -> tuple[str, str] | None:
            row = db.execute(
                "SELECT response, items FROM responses WHERE id = ? AND owner = ?",
                (response_id, owner),
            ).fetchone()
            return None if row is None else (row[0], row[1])

        row = await self._run("to read a response", get)
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete ``response_id`` if ``owner`` stored it; whether it was there."""

        def delete(db: sqlite3.Connection) -> bool:
            with db:
                cursor = db.execute(
                    "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
                )
            return cursor.rowcount > 0

        return await self._run("to delete a response", delete)

    async def count(self) -> int:
        """How many responses are stored (all owners)."""
        return await self._run(
            "to count responses",
            lambda db: db.execute("SELECT count(*) FROM responses").fetchone()[0],
        )

    def close(self) -> None:
        """Close the database (waits for the statement running, if any)."""

        def close() -> None:
            self._db.close()

        self._pool.submit(close).result()
        self._pool.shutdown()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
