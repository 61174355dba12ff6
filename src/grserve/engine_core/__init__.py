"""The engine in a process of its own (issue 35, docs/architecture.md "Processes"): ``core_process`` runs the
engine and talks ZeroMQ, ``client`` is the Engine contract in a front end, ``supervisor`` starts and restarts the
core, ``api_servers`` runs several HTTP front ends on one port, ``messages`` is what travels between them."""
