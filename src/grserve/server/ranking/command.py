"""``grserve serve ranking``: the BAT ranking server (POST /v1/rank, /v1/users, /v1/items, /health, /metrics).

Default: preset ``tiny`` with seeded random weights and a generated synthetic catalog of items and users
(``grserve.ranking.workload``); ``--items-file`` / ``--users-file`` load JSON lines instead
(``{"item_id": 7, "tokens": [...]}``; an item's last token is its identifier token).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from grserve.config import (
    ClusterConfig,
    HRCSConfig,
    ModelConfig,
    RankingConfig,
    RankingDataConfig,
    RankingLimits,
    RankingServeConfig,
    ServerConfig,
    ProcessConfig,
    StateConfig,
)
from grserve.flags import Checked, UsageError, add_flags, command_parser, flag, from_args, non_negative
from grserve.server.launch.modes import Deployments, cluster_app, deploy, restore_started
from grserve.server.launch.startup import (
    GR_CLUSTER_SKIP,
    RECOMMEND_ONLY,
    add_edge_flags,
    add_state_flags,
    check_model,
    edge_from_args,
)

MiB = 1 << 20


@dataclass(frozen=True)
class UserCacheMiB(Checked):
    """``--user-cache-mb``: :attr:`RankingConfig.user_cache_bytes` on the command line, in MiB."""

    user_cache_mb: float = flag(RankingConfig().user_cache_bytes / MiB, "user-prefix KV cache capacity in MiB "
                                                                         "(whole pages)", check=non_negative)


def add_command(sub) -> None:
    p = command_parser(sub, "ranking", help="serve GR ranking (BAT): POST /v1/rank", description=__doc__)
    d = RankingServeConfig()
    add_flags(p, d.model, title="model")
    engine = p.add_argument_group("ranking engine")
    add_flags(engine, d.ranking, skip=("user_cache_bytes",))
    add_flags(engine, UserCacheMiB())
    add_flags(p, d.data, title="users and items")
    add_flags(p, d.limits, title="request limits")
    add_flags(p, d.server, title="HTTP", skip=RECOMMEND_ONLY)
    add_edge_flags(p, "POST /v1/users, /v1/items")
    add_state_flags(p, d.state, "POST /v1/users and /v1/items")
    add_flags(p, ClusterConfig, title="cluster (several instances on Ray; docs/cluster.md)", skip=GR_CLUSTER_SKIP)
    add_flags(p, ProcessConfig, title="processes (the engine in its own process; docs/architecture.md)",
              skip=("api_servers",))
    add_flags(p, d.hrcs, title="item KV over KV-cache workers, BAT's HRCS (--instances N; docs/ranking.md)")
    p.set_defaults(handler=lambda ns: run(config_from_args(ns)))


def config_from_args(ns: argparse.Namespace) -> RankingServeConfig:
    cache_bytes = int(from_args(UserCacheMiB, ns).user_cache_mb * MiB)
    return RankingServeConfig(model=from_args(ModelConfig, ns),
                              ranking=from_args(RankingConfig, ns, user_cache_bytes=cache_bytes),
                              data=from_args(RankingDataConfig, ns), limits=from_args(RankingLimits, ns),
                              hrcs=from_args(HRCSConfig, ns),
                              server=from_args(ServerConfig, ns), edge=edge_from_args(ns),
                              cluster=from_args(ClusterConfig, ns), state=from_args(StateConfig, ns),
                              process=from_args(ProcessConfig, ns))


def run(cfg: RankingServeConfig) -> int:
    check_model(cfg.model)
    return deploy(cfg, Deployments(run_in_thread, run_engine_process, run_cluster))


def run_in_thread(cfg: RankingServeConfig) -> int:
    """The ranking engine on a thread of this process (``--no-engine-process``)."""
    from grserve.engine.ranking_engine import RankingEngine
    from grserve.engine.ranking_runner import RankingRunner
    from grserve.model.thread_choice import serving_threads
    from grserve.memory import settle_allocator
    from grserve.model import load_model
    from grserve.ranking.registry import RegistryError
    from grserve.server.launch.serving import serve_until_exit
    from grserve.server.ranking.app import create_ranking_app
    from grserve.state.store import open_state, restore_registry, state_line

    store, stored = open_state(cfg.state.state_dir, "ranking")  # before anything heavy: a locked dir fails fast
    settle_allocator(cfg.process)  # the engine on a thread of this process: its allocator settings here
    m = cfg.model
    model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed, quantization=m.quantization)
    print(f"grserve: {serving_threads(cfg.process.threads, model, packed=False)}", flush=True)
    from grserve.model.precision_label import model_label  # lazy: torch

    print(f"grserve: model {m.source} ({model_label(model, m)})", flush=True)
    try:
        from grserve.ranking.startup_data import build_registry

        reg = build_registry(cfg.data, model.spec.vocab_size)
        restore_registry(reg, stored)  # before the item pool is sized and precomputed
    except (RegistryError, OSError) as e:
        raise UsageError(str(e)) from None
    print(f"grserve ranking: {reg.num_items} items, {reg.num_users} users, policy {cfg.ranking.policy}; "
          "precomputing item KV", file=sys.stderr, flush=True)
    runner = RankingRunner(model, reg, cfg.ranking, progress=True)
    engine = RankingEngine(runner, edge=cfg.edge)
    app = create_ranking_app(engine, cfg.limits, edge=cfg.edge, store=store)
    s = cfg.server
    print(f"grserve: {state_line(store, stored)}", flush=True)
    print(f"grserve ranking -> http://{s.host}:{s.port}  (POST /v1/rank)", flush=True)
    engine.start()
    return serve_until_exit(app, s.host, s.port, s.log_level, engine.stop)


def run_cluster(cfg: RankingServeConfig) -> int:
    """``--instances N`` (or ``--ray-address``): N ranking engine actors on Ray behind this front end, which owns the
    state store: the instances are sent what it holds once started (and again when one is restarted)."""
    from grserve.cluster.gr.kv_workers import kv_cache_workers
    from grserve.cluster.gr.modes import ClusterRankingEngine
    from grserve.ranking.registry import RegistryError
    from grserve.server.launch.serving import serve_until_exit
    from grserve.server.ranking.app import create_ranking_app
    from grserve.state.store import open_state, state_line

    store, stored = open_state(cfg.state.state_dir, "ranking")  # before anything heavy: a locked dir fails fast
    n = kv_cache_workers(cfg, cfg.cluster.instances)
    where = f"the item KV on {n} KV-cache workers (HRCS)" if n else "each precomputes the item KV"
    print(f"grserve ranking: starting {cfg.cluster.instances} instances ({where})", file=sys.stderr, flush=True)
    try:
        engine = ClusterRankingEngine.launch(cfg, cfg.cluster)
    except (ValueError, RegistryError, OSError) as e:
        raise UsageError(str(e)) from None
    app = cluster_app(engine, lambda m: create_ranking_app(engine, cfg.limits, m, edge=cfg.edge, store=store))
    engine.start()  # with KV-cache workers: filled before the first request
    for line in engine.describe():
        print(f"grserve: {line}", flush=True)
    s = cfg.server
    reg = engine.registry
    from grserve.model.precision_label import dtype_label

    print(f"grserve ranking: model {cfg.model.source} ({dtype_label(cfg.model)}), {reg.num_items} items, "
          f"{reg.num_users} users, policy {engine.runner.policy.name}, {cfg.cluster.instances} instances -> http://{s.host}:{s.port}  (POST /v1/rank)", flush=True)
    restore_started(engine, stored)
    print(f"grserve: {state_line(store, stored)}", flush=True)
    return serve_until_exit(app, s.host, s.port, s.log_level, engine.stop)


def run_engine_process(cfg: RankingServeConfig) -> int:
    """The ranking engine in an engine-core process (``engine_core/``), this process the HTTP front end; with
    ``--api-servers N`` > 1, N front-end processes on the port."""
    from grserve.server.launch.processes import serve_split

    if cfg.process.api_servers > 1 and cfg.state.state_dir:
        raise UsageError("--api-servers > 1 with --state-dir: one front end owns the state store; use one")
    print(f"grserve ranking: policy {cfg.ranking.policy}; the engine process precomputes the item KV",
          file=sys.stderr, flush=True)
    return serve_split("ranking", cfg, cfg.server, cfg.process, cfg.edge, ranking_front_end)


def ranking_front_end(cfg: RankingServeConfig, client, info: dict):
    """The ranking app over an engine-core client, with the front end's copy of the users and items."""
    from grserve.engine_core.registry_copy import CoreRunnerView
    from grserve.ranking.registry import RegistryError
    from grserve.ranking.startup_data import build_registry
    from grserve.server.ranking.app import create_ranking_app
    from grserve.state.store import open_state, state_line

    store, stored = open_state(cfg.state.state_dir, "ranking")
    try:
        reg = build_registry(cfg.data, info["vocab_size"])
        client.runner = runner = CoreRunnerView(client, reg, info["policy"])
        client.registry = reg
        runner.restore(stored)
    except (RegistryError, OSError) as e:
        raise UsageError(str(e)) from None
    app = create_ranking_app(client, cfg.limits, edge=cfg.edge, store=store)
    s = cfg.server
    return app, [state_line(store, stored), *info.get("lines", []),
                 f"ranking: {reg.num_items} items, {reg.num_users} users, policy {info['policy']} -> "
                 f"http://{s.host}:{s.port}  (POST /v1/rank)"]
