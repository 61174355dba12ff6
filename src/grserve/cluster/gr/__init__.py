"""The GR wing of the cluster (``serve [retrieval|ranking] --instances N``; BAT §5: HRCS, KV-cache workers)."""
