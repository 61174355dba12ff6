"""Several engines and KV-cache workers: HRCS item placement (BAT §5.2), KV-cache workers and the cache meta
service as Ray actors (or in-process objects in the one-process mode)."""
