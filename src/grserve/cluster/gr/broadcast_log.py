"""What a restarted retrieval/ranking instance must be told to serve the same state as the live ones.

Every state change of the GR cluster reaches the instances as a broadcast (``ClusterGREngine.broadcast``) of a
``wire.StateChange``: a catalog reload (``CatalogReplace``) or new/replaced users and items (``RegistryUpdate``). A
restarted instance starts from the start-up flags, so it has seen none of them. ``BroadcastLog`` keeps, compactly,
what replays them:

- the newest catalog with its version (older catalogs are irrelevant: a reload replaces the whole catalog, and the
  version is carried so the new instance's version counter agrees with the front end's);
- the newest tokens of every user and item key ever updated, in the order of their last update (a key's older
  tokens are irrelevant; the order keeps item identifier hand-overs valid in the usual cases);
- the newest ``ItemPlacement`` (ranking with KV-cache workers), sent last: it lists the items replayed before it.

``replay(send)`` sends them as state changes through ``send`` — the caller binds it to the new actor — before the
instance takes requests. Memory is one catalog reference plus one token array per changed key. ``generation``
counts the recorded changes: a caller that replayed at generation g and reads another afterwards missed a change
recorded meanwhile, and replays again (replaying is idempotent: the newest state each time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from grserve.cluster.wire import CatalogReplace, ItemPlacement, RegistryUpdate, StateChange

if TYPE_CHECKING:
    import numpy as np


class BroadcastLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._catalog: CatalogReplace | None = None
        self._placement: ItemPlacement | None = None
        self._updates: dict[tuple[str, int], np.ndarray] = {}  # (kind, key) -> tokens, in order of the last update
        self.generation = 0

    def record(self, change: StateChange) -> None:
        """A state change that reached the live instances."""
        with self._lock:
            self.generation += 1
            if isinstance(change, CatalogReplace):
                # the version the front end serves it at: ``change.catalog`` is the catalog as sent, before the
                # engine binds it to the model (a SID-token catalog is bound into a copy, so its own ``version``
                # field stays 0 and must not be replayed)
                version = change.version if change.version is not None else change.catalog.version
                self._catalog = CatalogReplace(change.catalog, int(version))
                return
            if isinstance(change, ItemPlacement):
                self._placement = change
                return
            for key, tokens in change.entries:
                self._updates.pop((change.kind, int(key)), None)  # re-insert: the order of last updates
                self._updates[(change.kind, int(key))] = tokens

    def __len__(self) -> int:
        return len(self._updates) + (self._catalog is not None) + (self._placement is not None)

    def replay(self, send: Callable[[StateChange], object]) -> int:
        """Send the recorded state through ``send``: the catalog (with its version) first, then the updates grouped
        into runs of one kind (order kept). Returns the number of changes sent."""
        with self._lock:
            catalog, updates, placement = self._catalog, list(self._updates.items()), self._placement
        sent = 0
        if catalog is not None:
            send(catalog)
            sent += 1
        run: list[tuple[int, np.ndarray]] = []
        for i, ((kind, key), tokens) in enumerate(updates):
            run.append((key, tokens))
            if i + 1 == len(updates) or updates[i + 1][0][0] != kind:  # the run of one kind ends here
                send(RegistryUpdate(kind, tuple(run)))  # type: ignore[arg-type]
                sent += 1
                run = []
        if placement is not None:
            send(placement)
            sent += 1
        return sent
