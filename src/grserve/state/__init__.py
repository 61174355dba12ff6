"""What the servers keep across a restart: the admin writes (``POST /v1/users``, ``/v1/items``, ``/v1/catalog``) in an
embedded SQLite store under ``--state-dir`` (``store.py``; the promise: docs/security.md, "Durability")."""

from grserve.state.store import StateError, StateStore, StoredState, open_state

__all__ = ["StateError", "StateStore", "StoredState", "open_state"]
