"""`grserve bench serve`: the effective throughput is located by bisection on each system's 90 % crossing, not
read off a coarse grid (a grid of 0.5 req/s steps put FCFS's cliff at 0.66 instead of ≈ 0.93 req/s)."""

from __future__ import annotations

from grserve_bench.llm_workloads import effective_throughput
from grserve_bench.serve import _refine


class _Bar:
    def update(self, n):
        pass


def test_refine_finds_a_cliff_between_grid_points():
    cliff = 1.23

    def run_one(system, rate):
        return {"attainment": 0.98 if rate <= cliff else 0.2}

    grid = [0.5, 1.0, 1.5, 2.0]
    pts = [(r, run_one("x", r)) for r in grid]
    coarse = effective_throughput(grid, [x["attainment"] for _, x in pts])
    assert abs(coarse - 1.051) < 0.001  # the grid's interpolation: far below the cliff
    pts = _refine(run_one, "x", pts, 4, _Bar())
    assert len(pts) == len(grid) + 4
    eff = effective_throughput([r for r, _ in pts], [x["attainment"] for _, x in pts])
    assert abs(eff - cliff) < 0.5 / 2 ** 4


def test_refine_leaves_curves_without_a_crossing_alone():
    pts = [(r, {"attainment": 1.0}) for r in (1.0, 2.0)]
    assert _refine(lambda s, r: {"attainment": 0.0}, "x", pts, 3, _Bar()) == pts


def test_sweep_stops_a_system_past_its_wall():
    from grserve_bench.serve import _sweep

    calls = []

    def run_one(system, rate):
        calls.append((system, rate))
        return {"attainment": 1.0 if system == "good" or rate < 2 else 0.1}

    out = _sweep(run_one, [1, 2, 3, 4], ["good", "bad"], _Bar(), stop_below=0.5)
    assert [x is None for x in out["bad"]] == [False, False, True, True]
    assert ("bad", 3) not in calls and ("good", 4) in calls
