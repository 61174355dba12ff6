"""A state change of a retrieval or ranking engine that lives apart from the front end holding the state (a cluster
instance, an engine-core process): a catalog reload, or replaced users and new or replaced items. The front end's
catalog sends a reload on (``BroadcastCatalogStore``); the engine's side applies a change (``apply_change``); both
kinds of front end and both kinds of engine do it the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from grserve.catalog import Catalog, CatalogStore
from grserve.cluster.wire import CatalogReplace, RegistryUpdate

log = logging.getLogger("grserve.cluster")


class BroadcastCatalogStore(CatalogStore):
    """A front end's catalog; ``replace`` (a reload) swaps it here, then sends it through ``broadcast`` (to every
    live cluster instance, or to the engine process) before it returns. ``broadcast`` returns the versions the
    engines took; they agree: every store starts at 1 and takes every replacement."""

    def __init__(self, catalog: Catalog, vocab_size: int, broadcast: Callable[[CatalogReplace], list[int]],
                 bind: Callable[[Catalog], Catalog] | None = None):
        self._broadcast: Callable[[CatalogReplace], list[int]] | None = None
        super().__init__(catalog, vocab_size=vocab_size, bind=bind)
        self._broadcast = broadcast

    def replace(self, new: Catalog, version: int | None = None) -> int:
        version = super().replace(new, version)
        if self._broadcast is not None:
            versions = self._broadcast(CatalogReplace(new, version))
            # None: not sent now (an engine process being restarted; its catch-up carries the change)
            if any(v is not None and v != version for v in versions):
                log.warning("catalog versions disagree after a reload: front end %d, engines %s", version, versions)
        return version


def replaced_entry(registry: Any, kind: str, key: int) -> RegistryUpdate:
    """The change that carries a user's or an item's new tokens (the registry's change listener)."""
    tokens = registry.user_tokens(key) if kind == "user" else registry.item_tokens(key)
    return RegistryUpdate(kind, ((int(key), tokens),))  # type: ignore[arg-type]


def restore_updates(registry: Any, state: Any) -> list[RegistryUpdate]:
    """A front end's state store replayed on its registry, and the changes, one per kind, that bring engines built
    from the flags level with it. New users stay at the front end, as when they were registered (a request carries
    the user's tokens); replaced users and every stored item reach the engines."""
    from grserve.state.store import restore_registry

    users = [(key, tokens) for key, tokens in state.users if registry.has_user(key)]
    restore_registry(registry, state)
    return [RegistryUpdate(kind, tuple(entries))  # type: ignore[arg-type]
            for kind, entries in (("user", users), ("item", state.items)) if entries]


def apply_change(engine: Any, change: CatalogReplace | RegistryUpdate) -> int:
    """Apply ``change`` to ``engine``; returns the catalog version, or the entries applied. A replaced user's
    cached KV is dropped (also when this registry did not know the user yet); a replaced item's KV is
    re-precomputed (the runner's registry listener), a new item's computed here."""
    if isinstance(change, CatalogReplace):
        if change.version is not None and change.version == engine.catalogs.version:
            return change.version  # already served (a replay sent again): every version names one catalog
        return engine.catalogs.replace(change.catalog, change.version)
    runner = engine.runner
    new = runner.registry.update(change.kind, change.entries)
    if change.kind == "user":
        for uid, _ in change.entries:
            runner._invalidate("user", int(uid))
        return len(change.entries)
    return runner.add_items(new) if new else len(change.entries)
