"""``grserve serve ranking``: the BAT ranking server (POST /v1/rank, /v1/users, /v1/items, /health, /metrics).

Default: preset ``tiny`` with seeded random weights and a generated synthetic catalog of items and users
(``grserve.ranking.workload``); ``--items-file`` / ``--users-file`` load JSON lines instead
(``{"item_id": 7, "tokens": [...]}``; an item's last token is its identifier token).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from grserve.config import RankingLimits
from grserve.engine.ranking import RankingConfig, RankingEngine, RankingRunner
from grserve.model import load_model
from grserve.ranking.registry import RankingRegistry, RegistryError
from grserve.ranking.workload import WorkloadSpec, generate_workload
from grserve.scheduler.prefix_choice import PREFIX_POLICIES
from grserve.server.core import serve_until_exit
from grserve.server.ranking_app import create_ranking_app

RANKING_DTYPES = ("float16", "float32", "bfloat16")  # choices on the command line


def parse_args(argv):
    p = argparse.ArgumentParser(prog="grserve serve ranking",
                                description="Serve GR ranking with Bipartite Attention (BAT): POST /v1/rank.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--model", default="tiny", help="preset or HF-format directory (default: tiny)")
    p.add_argument("--dtype", default="float32", choices=sorted(RANKING_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="bat", choices=sorted(PREFIX_POLICIES.names()),
                   help="prefix-choice policy (default: bat)")
    p.add_argument("--user-cache-mb", type=float, default=64.0, help="user-prefix KV cache budget (MiB)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--window-s", type=float, default=1800.0, help="user frequency window W (seconds)")
    p.add_argument("--items-file", default=None, help="JSON lines {item_id, tokens} (last token = identifier)")
    p.add_argument("--users-file", default=None, help="JSON lines {user_id, tokens}")
    p.add_argument("--instruction", default=None, help="comma-separated instruction token ids (default: generated)")
    p.add_argument("--num-items", type=int, default=2000, help="generated catalog size (default 2000)")
    p.add_argument("--num-users", type=int, default=200, help="generated users (default 200)")
    p.add_argument("--scale", type=float, default=0.25, help="generated profile-length scale (default 0.25)")
    p.add_argument("--max-candidates", type=int, default=256)
    p.add_argument("--max-profile-tokens", type=int, default=8192)
    p.add_argument("--max-batch-requests", type=int, default=8)
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def build_registry(a, vocab_size: int) -> RankingRegistry:
    if a.items_file or a.users_file:
        if a.instruction:
            instr = [int(x) for x in a.instruction.split(",")]
        else:
            instr = np.random.default_rng(a.seed).integers(16, vocab_size, size=4).tolist()
        reg = RankingRegistry(vocab_size, instr)
        if a.items_file:
            reg.load_jsonl(a.items_file, "item")
        if a.users_file:
            reg.load_jsonl(a.users_file, "user")
        return reg
    reg, _, _ = generate_workload(WorkloadSpec(num_items=a.num_items, num_users=a.num_users, scale=a.scale,
                                               seed=a.seed), vocab_size)
    return reg


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = load_model(a.model, dtype=a.dtype, seed=a.seed)
    try:
        reg = build_registry(a, model.spec.vocab_size)
    except (RegistryError, OSError) as e:
        print(f"grserve serve ranking: error: {e}", file=sys.stderr)
        return 2
    cfg = RankingConfig(policy=a.policy, user_cache_bytes=int(a.user_cache_mb * 2**20), page_size=a.page_size,
                        user_window_s=a.window_s, max_batch_requests=a.max_batch_requests)
    print(f"grserve ranking: {reg.num_items} items, {reg.num_users} users, policy {a.policy}; precomputing item KV",
          file=sys.stderr, flush=True)
    runner = RankingRunner(model, reg, cfg, progress=True)
    engine = RankingEngine(runner)
    app = create_ranking_app(engine, RankingLimits(max_candidates=a.max_candidates,
                                                   max_profile_tokens=a.max_profile_tokens))
    print(f"grserve ranking -> http://{a.host}:{a.port}  (POST /v1/rank)", flush=True)
    engine.start()
    return serve_until_exit(app, a.host, a.port, a.log_level, engine.stop)
