"""grserve's lab: the benchmarks (``grserve bench ...``), workloads and traces, the simulators, the peer baselines,
and the policies and caches only they use. It imports grserve; grserve never imports it (its command line finds
``grserve bench`` through the entry point that pyproject.toml declares, see ``grserve_bench.cli``)."""
