"""The engine in a process of its own (issue 35, docs/architecture.md "Processes"): ``core_process`` runs the
engine and talks ZeroMQ, ``client`` is the Engine contract in a front end, ``supervisor`` starts and restarts the
core, ``messages`` is what travels between them; ``server/launch/processes.py`` runs the front end(s) around it."""
