"""``grserve bench prefix`` end to end on a small replay: the JSON line carries every engine's numbers, the beams with
the cache equal the beams without it, the cache-on engines reuse prompt tokens, and the hit-rate replay through the
engine's cache agrees with the engine's own count on the same trace."""

from __future__ import annotations

import json

from grserve_bench.prefix_reuse import PrefixBenchConfig, run


def test_bench_prefix_small(capsys):
    cfg = PrefixBenchConfig(instruction_requests=16, visits=48, cold_batches=1, sizes="0.1", policies="lru,leader",
                            engine_runs="returning:0.1:lru,instruction:0.1:lru", beam_width=8, instruction_tokens=64)
    assert run(cfg) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    engines = [r for r in out["rows"] if r["kind"] == "engine"]
    assert {(r["workload"], r["setting"]) for r in engines} >= {("instruction", "off"), ("instruction", "lru@0.1"),
                                                                ("returning", "off"), ("returning", "lru@0.1"),
                                                                ("cold", "off")}
    assert out["goals"]["beams_identical"] is True
    on = next(r for r in engines if r["workload"] == "instruction" and r["setting"] == "lru@0.1")
    assert on["hit_rate"] > 0
    replay = next(r for r in out["rows"] if r["kind"] == "replay" and r["workload"] == "instruction"
                  and r["policy"] == "lru")
    assert abs(replay["hit_rate"] - on["hit_rate"]) < 1e-3  # the same cache, the same batches
    assert "goals" in out and out["cpu"]
