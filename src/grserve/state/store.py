"""The durable state of one server: an SQLite database (stdlib ``sqlite3``) in WAL mode under ``--state-dir``.

What is kept, and nothing else: ranking's registered users and items (each id's newest tokens, numbered in the order
of their last write) and retrieval's current catalog **as parsed**, as ``.grcat`` bytes (item ids, SIDs, the layout
and SID text it declares) with the name it was loaded from, its version and a digest — never a path, so a restart
serves the acknowledged catalog whatever became of the file since.

A write is one transaction, committed with ``synchronous=FULL`` (the WAL is fsynced at every commit) before the
route applies it and answers: an answered write survives kill -9, SIGTERM and a power cut. A write torn by a kill is
rolled back as a whole when the database is next opened (SQLite's WAL recovery). One server at a time: the directory
is locked (``flock``, released by the kernel when the process dies) for as long as the store is open.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from grserve.flags import UsageError

if TYPE_CHECKING:
    from grserve.catalog import Catalog, CatalogStore
    from grserve.ranking.registry import RankingRegistry

FILE, LOCK, SCHEMA = "grserve-state.sqlite3", "grserve-state.lock", "1"
_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS registry (kind TEXT NOT NULL, id TEXT NOT NULL, seq INTEGER NOT NULL, "
    "tokens BLOB NOT NULL, PRIMARY KEY (kind, id))",  # id as decimal text: any integer a client may send
    "CREATE INDEX IF NOT EXISTS registry_seq ON registry (seq)",
    "CREATE TABLE IF NOT EXISTS catalog (one INTEGER PRIMARY KEY CHECK (one = 1), version INTEGER NOT NULL, "
    "name TEXT NOT NULL, grcat BLOB NOT NULL, digest TEXT NOT NULL)",
)
MEMORY_ONLY = ("state: memory only (no --state-dir): registered users and items and catalog reloads are lost when "
               "the server stops")


class StateError(RuntimeError):
    """The store cannot be opened, read or written."""


@dataclass
class StoredState:
    """What a store holds: the catalog (its ``version`` the one it was served at) and users / items as (id, tokens)
    in the order of their last write."""

    catalog: Catalog | None = None
    users: list[tuple[int, np.ndarray]] = field(default_factory=list)
    items: list[tuple[int, np.ndarray]] = field(default_factory=list)


class StateStore:
    def __init__(self, state_dir: str, mode: str) -> None:
        self.path, self.mode = os.path.join(state_dir, FILE), mode
        self._lock = threading.Lock()  # one connection, shared by the threads that write through it
        self._lock_fd: int | None = None
        self._db: sqlite3.Connection | None = None
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            self._lock_fd = _lock_dir(state_dir)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._setup(mode)
            _fsync_dir(state_dir)  # the new files' directory entries
        except BaseException as exc:
            self._release()
            if isinstance(exc, (OSError, sqlite3.Error)):
                raise StateError(f"{self.path}: cannot open the state store ({exc})") from None
            raise

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StateError(f"{self.path}: the state store is closed")
        return self._db

    def _setup(self, mode: str) -> None:
        db = self._conn()
        journal = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if journal != "wal":
            raise StateError(f"{self.path}: SQLite cannot use WAL mode here (journal mode {journal})")
        db.execute("PRAGMA synchronous=FULL")
        if (check := db.execute("PRAGMA quick_check").fetchone()[0]) != "ok":
            raise StateError(f"{self.path}: the database is damaged ({check})")
        with self._transaction() as tx:
            for sql in _TABLES:
                tx.execute(sql)
            tx.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?), ('mode', ?)", (SCHEMA, mode))
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        if (meta["schema"], meta["mode"]) != (SCHEMA, mode):
            raise StateError(f"{self.path}: holds the state of a {meta['mode']} server (schema {meta['schema']}), "
                             f"not of this {mode} server (schema {SCHEMA})")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (durably) when the block ends, rolled back if it raises."""
        with self._lock:
            db = self._conn()
            try:
                db.execute("BEGIN IMMEDIATE")
                yield db
                db.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StateError(f"{self.path}: the write failed ({exc}); nothing was stored") from None
                raise

    # ---- writes: each is committed when it returns ------------------------------------------------------------
    def put_registry(self, kind: str, entries: Iterable[tuple[int, Any]]) -> None:
        """Users or items (``kind``) as (id, tokens), registered or replaced."""
        with self._transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) FROM registry").fetchone()[0]
            db.executemany("INSERT OR REPLACE INTO registry VALUES (?, ?, ?, ?)",
                           [(kind, str(int(key)), seq + n, np.asarray(tokens, dtype="<i8").tobytes())
                            for n, (key, tokens) in enumerate(entries, 1)])

    def put_catalog(self, catalog: Catalog, version: int) -> None:
        """The catalog to serve at ``version`` (it replaces the stored one)."""
        from grserve.catalog.io import write_grcat

        buf = io.BytesIO()
        write_grcat(catalog, buf)
        blob = buf.getvalue()
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO catalog VALUES (1, ?, ?, ?, ?)",
                       (int(version), catalog.source, blob, hashlib.blake2b(blob, digest_size=16).hexdigest()))

    # ---- reads --------------------------------------------------------------------------------------------------
    def load(self, duplicate_sids: str = "refuse") -> StoredState:
        """What the store holds; ``duplicate_sids``: the server's policy, under which a stored catalog with several
        items per SID was acknowledged (``catalog/duplicates.py``)."""
        try:
            with self._lock:
                db = self._conn()
                rows = db.execute("SELECT kind, id, tokens FROM registry ORDER BY seq").fetchall()
                cat = db.execute("SELECT version, name, grcat, digest FROM catalog").fetchone()
        except sqlite3.Error as exc:
            raise StateError(f"{self.path}: cannot read the state store ({exc})") from None
        state = StoredState(catalog=self._catalog(*cat, duplicate_sids) if cat is not None else None)
        for kind, key, blob in rows:
            (state.users if kind == "user" else state.items).append((int(key), np.frombuffer(blob, "<i8").copy()))
        return state

    def _catalog(self, version: int, name: str, blob: bytes, digest: str, duplicate_sids: str) -> Catalog:
        from grserve.catalog import CatalogError
        from grserve.catalog.io import read_catalog

        if hashlib.blake2b(blob, digest_size=16).hexdigest() != digest:
            raise StateError(f"{self.path}: the stored catalog {name!r} does not match its digest")
        try:
            catalog = read_catalog(io.BytesIO(blob), ".grcat", name, len(blob), duplicate_sids=duplicate_sids)
        except CatalogError as exc:
            raise StateError(f"{self.path}: the stored catalog {name!r} (version {version}) cannot be served with "
                             f"these flags: {exc}") from None
        catalog.version = int(version)
        return catalog

    def close(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        if self._db is not None:
            self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the directory is free for the next server
        self._db = self._lock_fd = None


def _lock_dir(state_dir: str) -> int:
    fd = os.open(os.path.join(state_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateError(f"{state_dir}: in use by another grserve server (one state dir per server)") from None
    return fd


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- start-up: open, restore, say so --------------------------------------------------------------------------
def open_state(state_dir: str | None, mode: str, duplicate_sids: str = "refuse") -> tuple[StateStore | None,
                                                                                         StoredState]:
    """The server's store and what it holds; (None, nothing) without ``--state-dir`` (memory only). A store that
    cannot be opened or read is a usage error: a server never starts without the writes it acknowledged.
    ``duplicate_sids``: the server's ``--duplicate-sids`` (a stored catalog is read under it, as a reload was)."""
    if state_dir is None:
        return None, StoredState()
    store: StateStore | None = None
    try:
        store = StateStore(state_dir, mode)
        return store, store.load(duplicate_sids)
    except StateError as exc:
        if store is not None:
            store.close()  # the directory's lock released: the user may start again with other flags
        raise UsageError(f"--state-dir: {exc}") from None


def restore_registry(registry: RankingRegistry, state: StoredState) -> None:
    """Replay the stored users and items over the start-up registry (before any cache is built), each kind as one
    change (items may have handed identifier tokens over among themselves)."""
    from grserve.ranking.registry import RegistryError

    for kind, entries in (("user", state.users), ("item", state.items)):
        try:
            registry.update(kind, entries, notify=False)
        except RegistryError as exc:
            raise UsageError(f"--state-dir: the stored {kind}s do not fit the start-up ones ({exc}): start with the "
                             "users/items flags (and model) they were stored for, or another --state-dir") from None


def restore_catalog(catalogs: CatalogStore, catalog: Catalog | None) -> None:
    """Serve the stored catalog at its version, bound to the served model as a reload is (its SID text resolved by
    the tokenizer); it must have the served depth and codebook sizes, as a reload must."""
    if catalog is None:
        return
    version = catalog.version
    bound = catalogs.bind(catalog) if catalogs.bind is not None else catalog
    new, served = bound.layout, catalogs.current().layout
    if (new.depth, new.codebook_sizes) != (served.depth, served.codebook_sizes):
        raise UsageError(f"--state-dir: the stored catalog {catalog.source!r} (version {version}) has depth "
                         f"{new.depth} and codebook sizes {list(new.codebook_sizes)}, the served model's layout "
                         f"{served.depth} and {list(served.codebook_sizes)}: start with the model it was stored for, "
                         "or another --state-dir")
    catalogs.replace(bound, version)


def state_line(store: StateStore | None, state: StoredState) -> str:
    """The start-up line: where the state lives and what was restored, or that it lives in memory only."""
    if store is None:
        return MEMORY_ONLY
    if store.mode == "ranking":
        restored = f"restored {len(state.users)} users, {len(state.items)} items"
    elif state.catalog is not None:
        restored = f"restored catalog {state.catalog.source!r} version {state.catalog.version}"
    else:
        restored = "no catalog reload stored (the start-up catalog serves)"
    return f"state: {store.path} (SQLite WAL, synchronous=FULL; kept across restarts): {restored}"
