"""Catalog reload by name (``POST /v1/catalog``): the one way a client may make the retrieval server read a file.

A client names a file; it never gives a path. The reload is bounded at every step:

1. **by name, from one directory** (``--catalog-dir``; unset: reload is off, 403): the name is a plain file name
   (letters, digits, ``.``, ``_``, ``-``; no ``/``, no ``..``, no leading dot) ending in ``.jsonl``, ``.csv``,
   ``.json`` (an LC-Rec index) or ``.grcat``, looked up relative to the directory (``dir_fd``), so no file outside
   it can be named, and an error never says whether a file outside it exists;
2. **regular files only**: ``lstat`` first (a FIFO, device, socket, directory or symlink is refused without being
   opened), then ``open(O_NONBLOCK | O_NOFOLLOW)`` and ``fstat`` again on the open descriptor (a file swapped in
   between is caught; opening a FIFO non-blocking never waits for a writer);
3. **size** (``--max-catalog-bytes``, 413) on ``fstat`` and again while reading (a file that grows is cut off);
4. **parsed while read** (``catalog.io.read_catalog``: line by line into compact arrays; ``.grcat`` straight into
   its arrays; an index ``.json`` whole, within the size limit), then bound to the served tokenizer (SID token text) on a daemon thread, with errors that name the line and never quote the file's text;
5. **deadline** (``--catalog-timeout``): past it the client gets a 504, the parse is told to stop (it checks
   every few thousand lines) and its result is **never applied** — a catalog is swapped in only by the request
   that started it, after the parse returned within its deadline;
6. **one at a time**: a reload waits at most ``reload_wait`` seconds for the one before it (then 429
   ``reload_busy``); the slot is freed when the parse thread really ends, so an abandoned parse still running
   cannot pile up more threads.

The parse thread is a daemon and the route never outlives the deadline, so a stuck reload never keeps SIGTERM
from stopping the server. With a state store (``--state-dir``) the parsed catalog is committed there, at the
version it will be served at, before it is swapped in and answered (500 ``state_write_failed``: the old catalog
stays); swaps run one at a time.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import stat
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any

from grserve.config import CatalogReloadConfig
from grserve.inputs.refusal import ApiError
from grserve.state.store import StateError, StateStore

CATALOG_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}\.(jsonl|csv|json|grcat)")
_POLL_S = 0.02


class ReloadAbandoned(Exception):
    """Raised inside an abandoned parse (its deadline passed): the parse stops and its result is dropped."""


def check_name(name: str) -> str:
    """A catalog file name a client may give, or 400 ``invalid_catalog_name`` (the name is not echoed back)."""
    if not CATALOG_NAME.fullmatch(name) or ".." in name:
        raise ApiError(400, "name: a catalog is named by its file name in the catalog directory (letters, digits, "
                            "'.', '_', '-'; ending in .jsonl, .csv, .json or .grcat; no path)", "name",
                       "invalid_catalog_name")
    return name


def open_catalog(catalog_dir: str, name: str, max_bytes: int) -> tuple[int, int]:
    """(open descriptor, size) of the regular file ``name`` in ``catalog_dir``; never blocks, never follows a
    symlink, never opens what is not a regular file. 404 ``catalog_not_found``, 400 ``not_a_regular_file``,
    413 ``catalog_too_large``."""
    name = check_name(name)
    try:
        dir_fd = os.open(catalog_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        raise ApiError(500, "the server's catalog directory cannot be opened", None, "internal") from None
    try:
        try:
            st = _lstat(name, dir_fd)
        except FileNotFoundError:
            raise ApiError(404, "name: no such catalog in the catalog directory", "name", "catalog_not_found") \
                from None
        except OSError:
            raise ApiError(400, "name: the catalog cannot be read", "name", "catalog_load_failed") from None
        _check_regular(st, max_bytes)
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError:
            raise ApiError(400, "name: the catalog cannot be opened (not a readable regular file)", "name",
                           "not_a_regular_file") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        _check_regular(st, max_bytes)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, int(st.st_size)


def _lstat(name: str, dir_fd: int) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _check_regular(st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ApiError(400, "name: not a regular file (FIFOs, devices, sockets, directories and symlinks are "
                            "refused)", "name", "not_a_regular_file")
    if st.st_size > max_bytes:
        raise ApiError(413, f"name: the catalog has {st.st_size} bytes, more than the limit of {max_bytes} "
                            f"(--max-catalog-bytes)", "name", "catalog_too_large")


class CappedReader(io.RawIOBase):
    """A raw reader over a descriptor that refuses to read past ``limit`` bytes (a file growing while read)."""

    def __init__(self, fd: int, limit: int) -> None:
        self._file = io.FileIO(fd, "rb", closefd=True)
        self._left = limit + 1

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._file.readinto(view[: min(len(view), self._left)]) or 0
        self._left -= n
        if self._left <= 0:
            raise ApiError(413, "name: the catalog grew past the size limit while it was read", "name",
                           "catalog_too_large")
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def load_for_serving(catalog_dir: str, name: str, served: Any, vocab_size: int, max_bytes: int,
                     check: Any = None, bind: Any = None) -> Any:
    """Open and parse the catalog ``name`` exactly as start-up reads a file (its declared layout, else the
    inferred one; the served token offset) and check it fits the served model: the same depth and codebook
    sizes as the catalog being served (the model was trained on those token ids), SID tokens inside the vocab."""
    from grserve.catalog import CatalogError
    from grserve.catalog.io import read_catalog
    from grserve.catalog.sid_text import SidTokenError

    fd, size = open_catalog(catalog_dir, name, max_bytes)
    raw = CappedReader(fd, max_bytes)
    try:
        with io.BufferedReader(raw, 1 << 16) as f:
            catalog = read_catalog(f, os.path.splitext(name)[1], name, size,
                                   token_offset=int(served.layout.token_offset), check=check,
                                   duplicate_sids=getattr(served, "duplicate_sids", "refuse"))
        if bind is not None:
            catalog = bind(catalog)  # SID token text → the served tokenizer's ids (as at start-up)
    except SidTokenError as exc:  # the token is quoted only when it is shaped like a SID token (never other text)
        shown = f" {exc.text!r}" if SID_TOKEN_SHAPE.fullmatch(exc.text) else " (not shaped like a SID token: not shown)"
        held = f" of item {exc.item_id}" if exc.item_id is not None else ""
        raise ApiError(400, f"cannot load catalog: the {exc.what}{shown}{held} is not exactly one token of the "
                            f"model's tokenizer (it encodes to {exc.n_tokens} tokens)", "name",
                       "catalog_load_failed") from None
    except (CatalogError, KeyError) as exc:  # CatalogError is a ValueError
        message = exc.args[0] if exc.args else type(exc).__name__
        raise ApiError(400, f"cannot load catalog: {message}", "name", "catalog_load_failed") from None
    except OSError:
        raise ApiError(400, "cannot load catalog: read error", "name", "catalog_load_failed") from None
    new, old = catalog.layout, served.layout
    if (new.depth, new.codebook_sizes) != (old.depth, old.codebook_sizes):
        raise ApiError(400, f"catalog {name} has depth {new.depth} and codebook sizes {list(new.codebook_sizes)}, "
                            f"the served model's layout is depth {old.depth}, codebook sizes "
                            f"{list(old.codebook_sizes)} (declare the sizes in the file if they were inferred: "
                            f"see 'grserve catalog')", "name", "catalog_incompatible")
    if new.num_tokens > vocab_size:
        raise ApiError(400, f"catalog {name} needs {new.num_tokens} SID tokens but the model vocabulary has "
                            f"{vocab_size}", "name", "catalog_incompatible")
    return catalog


SID_TOKEN_SHAPE = re.compile(r"<\|?[A-Za-z0-9_]{1,60}\|?>")  # a token such as <a_47> or <|sid_begin|>


class CatalogReloader:
    """Serialized, deadline-bounded reloads into an engine's ``CatalogStore`` (the module docstring)."""

    def __init__(self, cfg: CatalogReloadConfig, catalogs: Any, vocab_size: int,
                 store: StateStore | None = None) -> None:
        self.cfg, self.catalogs, self.vocab_size, self.store = cfg, catalogs, int(vocab_size), store
        self._slot = threading.Lock()  # taken by the route, released by the parse thread when it really ends
        self._swap = asyncio.Lock()  # stored and swapped in one at a time: the stored version is the served one
        self.abandoned = 0

    async def reload(self, name: str) -> Any:
        """Load ``name`` and swap it in; returns the new catalog. Raises ``ApiError`` (the old catalog stays)."""
        cfg = self.cfg
        if cfg.catalog_dir is None:
            raise ApiError(403, "catalog reload is off: start the server with --catalog-dir", None,
                           "reload_disabled")
        check_name(name)
        await self._take_slot()
        abandoned = threading.Event()
        done: Future = Future()
        threading.Thread(target=self._parse, args=(name, abandoned, done), name="grserve-catalog-reload",
                         daemon=True).start()
        try:
            catalog = await asyncio.wait_for(asyncio.wrap_future(done), cfg.catalog_timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            abandoned.set()  # the parse stops at its next check; its result, if any, is dropped
            self.abandoned += 1
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ApiError(504, f"the catalog reload took longer than {cfg.catalog_timeout:g} s "
                                f"(--catalog-timeout); it was abandoned and the served catalog is unchanged", None,
                           "reload_timeout") from None
        async with self._swap:  # only here: by the request that started it, within its deadline
            version = self.catalogs.version + 1
            if self.store is not None:
                await self._store(catalog, version)
            try:
                self.catalogs.replace(catalog, version)
            except ValueError as exc:
                raise ApiError(400, f"catalog rejected: {exc}", "name", "catalog_incompatible") from None
        return self.catalogs.current()

    async def _store(self, catalog: Any, version: int) -> None:
        try:
            catalog.layout.check_vocab(self.vocab_size)  # what replace() checks: never store what it would refuse
        except ValueError as exc:
            raise ApiError(400, f"catalog rejected: {exc}", "name", "catalog_incompatible") from None
        try:
            await asyncio.to_thread(self.store.put_catalog, catalog, version)  # type: ignore[union-attr]
        except StateError as exc:
            logging.getLogger("grserve.server").error("%s", exc)
            raise ApiError(500, "the catalog could not be stored; the served catalog is unchanged", None,
                           "state_write_failed") from None

    async def _take_slot(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.reload_wait
        while not self._slot.acquire(blocking=False):
            if loop.time() >= deadline:
                raise ApiError(429, "another catalog reload is running; retry later", None, "reload_busy",
                               {"Retry-After": "1"})
            await asyncio.sleep(_POLL_S)

    def _parse(self, name: str, abandoned: threading.Event, done: Future) -> None:
        def check() -> None:
            if abandoned.is_set():
                raise ReloadAbandoned(name)

        try:
            catalog = load_for_serving(self.cfg.catalog_dir, name, self.catalogs.current(),  # type: ignore[arg-type]
                                       self.vocab_size, self.cfg.max_catalog_bytes, check,
                                       getattr(self.catalogs, "bind", None))
            check()
            _settle(done, result=catalog)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting route (or dropped if it left)
            _settle(done, error=exc)
        finally:
            self._slot.release()


def _settle(done: Future, result: Any = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)
    except InvalidStateError:  # the waiting route was cancelled
        pass
