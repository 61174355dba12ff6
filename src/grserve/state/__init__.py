"""What the servers keep across a restart: the admin writes in an embedded SQLite store under ``--state-dir``
(``store.py``; the promise: docs/security.md, "Durability")."""
