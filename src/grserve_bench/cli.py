"""``grserve bench BENCH``: the lab's command, added to grserve's command line by the entry point

    [project.entry-points."grserve.commands"]
    bench = "grserve_bench.cli:register"

that pyproject.toml declares (``grserve.cli.installed_commands`` loads it). ``python -m grserve_bench BENCH ...``
runs the same command from a source tree that was never installed (``PYTHONPATH=src``).
"""

from __future__ import annotations

from typing import Any

from grserve.cli import command_group
from grserve_bench import cache, cluster, invariance, pd, peers, prefix_reuse, quality, ranking, retrieval, serve, \
    soak

BENCHES = (retrieval, cache, prefix_reuse, quality, ranking, serve, cluster, pd, peers, soak, invariance)


def register(sub: Any) -> None:
    """Add ``bench`` and its benchmarks to grserve's root command group ``sub``."""
    bench = command_group(sub, "bench", "benchmarks",
                          "Benchmarks; 'grserve bench BENCH --help' lists a benchmark's flags.", "BENCH")
    for module in BENCHES:
        module.add_command(bench)
