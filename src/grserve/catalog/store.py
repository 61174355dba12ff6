"""Holds the live catalog; replacing it never disturbs requests using an older snapshot."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .catalog import Catalog


class CatalogStore:
    """Current catalog plus a version counter. ``current()`` returns an immutable snapshot reference.

    ``bind``: how a catalog meets the served model before it is swapped in (``sid_text.bind_catalog`` with the
    model's tokenizer: SID token strings resolved, or a layout inferred); start-up and every reload alike."""

    def __init__(self, catalog: Catalog | None = None, vocab_size: int | None = None,
                 bind: Callable[[Catalog], Catalog] | None = None):
        self.vocab_size = vocab_size
        self.bind = bind
        self._lock = threading.Lock()
        self._catalog: Catalog | None = None
        self._version = 0
        if catalog is not None:
            self.replace(catalog)

    def current(self) -> Catalog:
        """The catalog to use for one request (keep the reference for the whole request)."""
        cat = self._catalog
        if cat is None:
            raise RuntimeError("no catalog loaded")
        return cat

    @property
    def version(self) -> int:
        return self._version

    def replace(self, new: Catalog, version: int | None = None) -> int:
        """Validate against the model vocab, assign the next version (or ``version``, which must be newer than the
        current one: a restarted cluster instance catching up with the front end) and swap it in; returns the
        version."""
        if self.bind is not None:
            new = self.bind(new)
        if self.vocab_size is not None:
            new.layout.check_vocab(self.vocab_size)
        with self._lock:
            if version is not None and version <= self._version:
                raise ValueError(f"catalog version {version} is not newer than the current {self._version}")
            self._version = self._version + 1 if version is None else int(version)
            new.version = self._version
            self._catalog = new
            return self._version

    def load(self, path, **kwargs) -> int:
        """Load a catalog file (see ``load_catalog``) and make it current."""
        from .io import load_catalog

        return self.replace(load_catalog(path, **kwargs))
