"""What a restarted retrieval/ranking instance must be told to serve the same state as the live ones.

Every state change of the GR cluster reaches the instances as a broadcast (``ClusterGREngine.broadcast``): a
catalog reload (``replace_catalog``) or new/replaced users and items (``update``). A restarted instance starts from
the start-up flags, so it has seen none of them. ``BroadcastLog`` keeps, compactly, what replays them:

- the newest catalog with its version (older catalogs are irrelevant: a reload replaces the whole catalog, and the
  version is carried so the new instance's version counter agrees with the front end's);
- the newest tokens of every user and item key ever updated, in the order of their last update (a key's older
  tokens are irrelevant; the order keeps item identifier hand-overs valid in the usual cases).

``replay(call)`` sends them through ``call(method, *args)`` — the caller binds it to the new actor — before the
instance takes requests. Memory is one catalog reference plus one token array per changed key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BroadcastLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._catalog: tuple[Any, int] | None = None
        self._updates: dict[tuple[str, int], Any] = {}  # (kind, key) -> tokens, in order of the last update

    def record(self, method: str, args: tuple) -> None:
        """A broadcast that reached the live instances."""
        with self._lock:
            if method == "replace_catalog":
                catalog = args[0]
                self._catalog = (catalog, int(catalog.version))
            elif method == "update":
                kind, entries = args
                for key, tokens in entries:
                    self._updates.pop((kind, int(key)), None)  # re-insert: the order of last updates
                    self._updates[(kind, int(key))] = tokens

    def __len__(self) -> int:
        return len(self._updates) + (self._catalog is not None)

    def replay(self, call: Callable[..., Any]) -> int:
        """Send the recorded state through ``call(method, *args)``: the catalog first, then the updates grouped
        into runs of one kind (order kept). Returns the number of calls."""
        with self._lock:
            catalog, updates = self._catalog, list(self._updates.items())
        calls = 0
        if catalog is not None:
            call("replace_catalog", catalog[0], catalog[1])
            calls += 1
        run_kind, run = None, []
        for (kind, key), tokens in updates + [((None, 0), None)]:  # a sentinel closes the last run
            if kind != run_kind and run:
                call("update", run_kind, run)
                calls += 1
                run = []
            run_kind = kind
            if kind is not None:
                run.append((key, tokens))
        return calls
