"""The one SQLite write transaction of the journal and the ledger.

Both keep one connection opened with `isolation_level=None` (we issue BEGIN and COMMIT ourselves)
and guarded by a lock, so it can be shared across threads.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def write_transaction(conn: sqlite3.Connection, lock: threading.RLock) -> Iterator[sqlite3.Connection]:
    """One `BEGIN IMMEDIATE` transaction on `conn` under `lock`: committed when the block ends, rolled back if it raises."""
    # IMMEDIATE takes the write lock up front, so two writers queue on the
    # busy timeout instead of failing when a read would upgrade to a write.
    with lock:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            # Also after a failed COMMIT, so the connection stays usable.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
