"""A state change of a retrieval or ranking engine that lives apart from the front end holding the state (a cluster
instance, an engine-core process): a catalog reload, or replaced users and new or replaced items. Both apply it
here, the same way."""

from __future__ import annotations

from typing import Any

from grserve.cluster.wire import CatalogReplace, RegistryUpdate


def apply_change(engine: Any, change: CatalogReplace | RegistryUpdate) -> int:
    """Apply ``change`` to ``engine``; returns the catalog version, or the entries applied. A replaced user's
    cached KV is dropped (also when this registry did not know the user yet); a replaced item's KV is
    re-precomputed (the runner's registry listener), a new item's computed here."""
    if isinstance(change, CatalogReplace):
        return engine.catalogs.replace(change.catalog, change.version)
    runner = engine.runner
    new = runner.registry.update(change.kind, change.entries)
    if change.kind == "user":
        for uid, _ in change.entries:
            runner._invalidate("user", int(uid))
        return len(change.entries)
    return runner.add_items(new) if new else len(change.entries)
