"""A front end's copy of the served catalog (``grserve serve`` with the engine in its own process).

The front end lays histories out as tokens and checks item ids against the catalog, so it holds one; the engine
process searches its own. Both start from the same flags at version 1; a reload (``POST /v1/catalog``, or the
state store's catalog at start-up) is swapped in here, then sent to the engine process as a ``CatalogReplace``,
which it applies in order with the requests around it — and which every restarted engine process is sent again
before it takes a request (``EngineCoreClient.change``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grserve.catalog import Catalog, CatalogStore
from grserve.cluster.wire import CatalogReplace


class CatalogCopy(CatalogStore):
    def __init__(self, catalog: Catalog, vocab_size: int, bind: Callable[[Catalog], Catalog], client: Any):
        self._client = None
        super().__init__(catalog, vocab_size=vocab_size, bind=bind)
        self._client = client

    def replace(self, new: Catalog, version: int | None = None) -> int:
        version = super().replace(new, version)
        if self._client is not None:
            self._client.change(CatalogReplace(new, version))
        return version
