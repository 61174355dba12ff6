"""A front end's copy of the ranking users and items (``grserve serve ranking`` with the engine in its own process).

The ranking routes validate requests and registrations against the registry and lay users and candidates out as
tokens, so the front end holds one, built from the same flags as the engine process's. What changes it reaches the
engine process as the ``RegistryUpdate`` changes a cluster instance is sent (``EngineCoreClient.change``, replayed to
a restarted engine process): a replaced user (its cached KV is dropped there), new or replaced items (registered,
their KV precomputed there). A new user needs nothing there: a request carries the user's tokens.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from grserve.cluster.wire import RegistryUpdate


class CoreRunnerView:
    """What the ranking routes read of ``engine.runner``: ``registry``, ``policy.name``, ``stats`` (the engine
    process's, from its last heartbeat) and ``add_items`` (precomputed there)."""

    def __init__(self, client: Any, registry: Any, policy: str):
        self.client, self.registry = client, registry
        self.policy = SimpleNamespace(name=policy)
        registry.on_change(self._changed)

    def add_items(self, item_ids: list[int]) -> int:
        reg = self.registry
        return self.client.change(RegistryUpdate("item", tuple((int(i), reg.item_tokens(i)) for i in item_ids)))

    @property
    def stats(self) -> Any:
        from grserve.engine.ranking_runner import RankingStats

        core = self.client.core
        return (core.extra.get("ranking_stats") if core is not None else None) or RankingStats()

    def _changed(self, kind: str, key: int) -> None:
        """A user's or an item's tokens were replaced here: the engine process follows."""
        reg = self.registry
        tokens = reg.user_tokens(key) if kind == "user" else reg.item_tokens(key)
        self.client.change(RegistryUpdate(kind, ((int(key), tokens),)))  # type: ignore[arg-type]

    def restore(self, state: Any) -> None:
        """The state store's users and items: on this registry, then sent as one change per kind (new users stay
        here, as when they were registered)."""
        from grserve.state.store import restore_registry

        reg = self.registry
        users = [(key, tokens) for key, tokens in state.users if reg.has_user(key)]
        restore_registry(reg, state)
        for kind, entries in (("user", users), ("item", state.items)):
            if entries:
                self.client.change(RegistryUpdate(kind, tuple(entries)))  # type: ignore[arg-type]
