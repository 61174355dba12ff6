"""A front end's copy of the ranking users and items (``grserve serve ranking`` with the engine in its own process).

The ranking routes validate requests and registrations against the registry and lay users and candidates out as
tokens, so the front end holds one, built from the same flags as the engine process's. What changes it reaches the
engine process as the ``RegistryUpdate`` changes a cluster instance is sent (``EngineCoreClient.change``, replayed to
a restarted engine process): a replaced user (its cached KV is dropped there), new or replaced items (registered,
their KV precomputed there). A new user needs nothing there: a request carries the user's tokens.
"""

from __future__ import annotations

from typing import Any

from grserve.cluster.gr.modes import FrontRunner
from grserve.cluster.gr.state_change import replaced_entry, restore_updates


class CoreRunnerView(FrontRunner):
    """The cluster front end's runner view over one engine process: ``add_items`` is sent to it (the client's
    ``broadcast``), ``stats`` are its last heartbeat's."""

    def __init__(self, client: Any, registry: Any, policy: str):
        client.item_kv = None  # no KV-cache workers: the engine process holds the item pool
        super().__init__(client, registry, policy, None)  # type: ignore[arg-type]
        registry.on_change(lambda kind, key: client.change(replaced_entry(registry, kind, key)))

    @property
    def stats(self) -> Any:
        from grserve.engine.ranking_runner import RankingStats

        core = self.engine.core
        return (core.extra.get("ranking_stats") if core is not None else None) or RankingStats()

    def restore(self, state: Any) -> None:
        """The state store's users and items: on this registry, then sent to the engine process."""
        for change in restore_updates(self.registry, state):
            self.engine.change(change)
