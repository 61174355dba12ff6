"""The shared core of the cluster: router, global KV index, heartbeat, recovery, restart, life cycle, Ray."""
