"""`grserve bench ranking` end to end on a micro model: the last line is the JSON the issue asks for, the token
statistics are consistent, and the HRCS placement (with a GPU-like prefill time) moves fewer bytes than hash
sharding while storing less than full replication."""

from __future__ import annotations

import dataclasses
import json

import torch

from grserve.cli import main
from grserve.model import PRESETS, Decoder, save_pretrained


def test_bench_ranking_prints_the_summary_and_placements(tmp_path, capsys):
    spec = dataclasses.replace(PRESETS["tiny-bat"], hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    save_pretrained(Decoder(spec), tmp_path / "micro")
    rc = main(["bench", "ranking", "--model", str(tmp_path / "micro"), "--users", "12", "--items", "300",
               "--scale", "0.2",
               "--systems", "bat,user_prefix,recompute", "--kv-workers", "2", "--hrcs-prefill-s", "0.1",
               "--hrcs-kv-bytes-per-token", "28672"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("speedup_vs_up", "speedup_vs_recompute", "cached_token_fraction"):
        assert key in out
    st = out["systems"]
    assert st["recompute"]["cached_token_fraction"] == 0
    assert 0 <= out["cached_token_fraction"] <= out["workload"]["cacheable_share_ceiling"] + 1e-9
    assert out["computed_token_ratio_vs_recompute"] == st["recompute"]["computed_tokens"] / st["bat"]["computed_tokens"]
    pl = out["cluster"]["placements"]
    assert pl["replicate"]["bytes_moved"] == 0 and pl["hash"]["replication_ratio"] == 0
    assert 0 < pl["hrcs"]["replication_ratio"] < 1
    assert pl["hrcs"]["bytes_moved"] < pl["hash"]["bytes_moved"]
    assert pl["hrcs"]["bytes_per_worker"] < pl["replicate"]["bytes_per_worker"]


def test_bench_ranking_instances_serves_the_trace_with_hrcs(tmp_path, capsys):
    """``--instances 2``: the trace on a served ranking cluster (two instances, two KV-cache workers): each instance's
    worker holds about half the item KV at start (sharded), the hot items join every worker after the re-placement
    (less remote reading), nothing failed."""
    spec = dataclasses.replace(PRESETS["tiny-bat"], hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    save_pretrained(Decoder(spec), tmp_path / "micro")
    rc = main(["bench", "ranking", "--model", str(tmp_path / "micro"), "--users", "12", "--items", "300",
               "--scale", "0.2", "--instances", "2", "--hrcs-prefill-s", "0.1", "--hrcs-kv-bytes-per-token", "28672"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cluster_served"]
    mem, ph = out["item_kv_memory_vs_full_replication"], out["phases"]
    assert 0.45 <= mem["sharded"] <= 0.6 and mem["sharded"] < mem["after_replacement"] < 1
    assert 0 < out["replication_ratio"] < 1 and out["replicated_items"] > 0
    assert 0.35 <= ph["sharded"]["remote_item_fraction"] <= 0.65
    assert ph["after_replacement"]["remote_item_fraction"] < ph["sharded"]["remote_item_fraction"]
    for p in ph.values():
        assert p["fetch_failures"] == 0 and p["ip_requests"] > 0 and p["remote_bytes_per_ip_request"] > 0
    assert sum(p["requests"] for p in ph.values()) == out["requests"]
