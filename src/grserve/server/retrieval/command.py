"""``grserve serve retrieval`` (also plain ``grserve serve``): GR retrieval over HTTP.

Builds the retrieval engine (model + catalog + batching scheduler) from a ServeConfig and serves it over HTTP:
POST /v1/recommend, GET /health, GET /metrics, POST /v1/catalog (admin reload). With no flags: preset ``tiny``
(random weights, seeded), a generated 20,000-item catalog, http://127.0.0.1:8000.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

from grserve.config import (
    AccelConfig,
    BeamApiConfig,
    CatalogConfig,
    CatalogReloadConfig,
    ClusterConfig,
    ModelConfig,
    PrecisionGateConfig,
    PrefixCacheConfig,
    ProcessConfig,
    SchedulerConfig,
    SearchConfig,
    ServeConfig,
    ServerConfig,
    StateConfig,
)
from grserve.flags import UsageError, add_flags, command_parser, from_args
from grserve.server.launch.modes import Deployments, cluster_app, deploy, restore_started, usage_error
from grserve.server.launch.startup import (
    GR_CLUSTER_SKIP,
    add_edge_flags,
    add_state_flags,
    check_catalog_dir,
    check_model,
    edge_from_args,
)

if TYPE_CHECKING:
    from grserve.state.store import StateStore, StoredState


def add_command(sub) -> None:
    p = command_parser(sub, "retrieval", help="serve GR retrieval: POST /v1/recommend (the default mode)",
                       description=__doc__)
    d = ServeConfig()
    add_flags(p, d.model, title="model")
    add_flags(p, d.catalog, title="catalog")
    add_flags(p, d.search, title="search")
    add_flags(p, d.scheduler, title="batching")
    add_flags(p, d.prefix, title="prompt-prefix KV reuse (docs/architecture.md)")
    add_flags(p, d.server, title="HTTP")
    add_edge_flags(p, "POST /v1/catalog", reload=True)
    add_flags(p, d.beams, title="OpenAI beam routes (docs/serving-gr-models.md)")
    add_state_flags(p, d.state, "the catalogs POST /v1/catalog loaded")
    add_flags(p, d.accel, title="accelerator (docs/gpu.md)")
    add_flags(p, ClusterConfig, title="cluster (several instances on Ray; docs/cluster.md)", skip=GR_CLUSTER_SKIP)
    add_flags(p, ProcessConfig, title="processes (the engine in its own process, HTTP front ends; "
                                      "docs/architecture.md)")
    add_flags(p, PrecisionGateConfig, title="precision gate at start-up: a --dtype below float32 checked against "
                                            "float32 on sampled histories (docs/offline-eval.md, \"Precision\")")
    p.set_defaults(handler=lambda ns: run(config_from_args(ns)))


def config_from_args(ns: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of parsed ``serve retrieval`` flags; a request may always ask for the default beam width, so
    ``--max-beam-width`` is raised to ``--beam-width``."""
    return ServeConfig(
        model=from_args(ModelConfig, ns),
        catalog=from_args(CatalogConfig, ns),
        search=from_args(SearchConfig, ns, max_beam_width=max(ns.max_beam_width, ns.beam_width)),
        scheduler=from_args(SchedulerConfig, ns),
        server=from_args(ServerConfig, ns),
        edge=edge_from_args(ns),
        reload=from_args(CatalogReloadConfig, ns),
        accel=from_args(AccelConfig, ns),
        cluster=from_args(ClusterConfig, ns),
        state=from_args(StateConfig, ns),
        beams=from_args(BeamApiConfig, ns),
        prefix=from_args(PrefixCacheConfig, ns),
        process=from_args(ProcessConfig, ns),
        precision_gate=from_args(PrecisionGateConfig, ns),
    )


def run(cfg: ServeConfig) -> int:
    if cfg.catalog.path is not None and not os.path.isfile(cfg.catalog.path):
        raise UsageError(f"catalog file not found: {cfg.catalog.path}")
    check_model(cfg.model)
    check_catalog_dir(cfg.reload)
    cfg = precision_gate(cfg)
    return deploy(cfg, Deployments(run_in_thread, run_engine_process, run_cluster))


def precision_gate(cfg: ServeConfig) -> ServeConfig:
    """``--precision-gate-users N``: the served dtype checked against float32 before anything is served; the
    config to serve (float32 after a fallback; the verdict for the start line). Off: ``cfg`` unchanged."""
    if not cfg.precision_gate.enabled:
        return cfg
    from grserve.precision_check import startup_gate

    try:
        return startup_gate(cfg, log=lambda line: print(f"grserve: {line}", flush=True))
    except (ValueError, KeyError, OSError) as exc:  # a bad catalog or model fails here first
        raise usage_error(exc) from None


def run_in_thread(cfg: ServeConfig) -> int:
    """The retrieval engine on a thread of this process (``--no-engine-process``)."""
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.model.thread_choice import serving_threads
    from grserve.memory import settle_allocator
    from grserve.server.http.metrics import Metrics
    from grserve.server.launch.serving import serve_until_exit
    from grserve.state.store import restore_catalog, state_line

    store, stored = _open_state(cfg)  # before anything heavy: a locked dir fails fast
    settle_allocator(cfg.process)  # the engine on a thread of this process: its allocator settings here

    metrics = Metrics()
    try:
        popularity = load_popularity(cfg)
        engine = RetrievalEngine.build(cfg, on_batch=metrics.on_batch)
        restore_catalog(engine.catalogs, stored.catalog)
        app = create_app_for(engine, cfg, metrics, store, popularity)  # a bad --prompt-template fails here
    except (ValueError, KeyError, OSError) as exc:  # CatalogError is a ValueError: bad file, vocab mismatch...
        raise usage_error(exc) from None
    print(f"grserve: {state_line(store, stored)}", flush=True)
    runner = getattr(engine, "runner", None)  # a stand-in engine (tests) may have none
    if runner is not None:
        print(f"grserve: {serving_threads(cfg.process.threads, runner.model, cfg.accel.cpu_packed_linears)}",
              flush=True)
    cat = engine.catalogs.current()
    print_layout(engine)
    from grserve.model.precision_label import model_label  # lazy: torch
    dtype = cfg.precision_gate.label(model_label(getattr(engine, "model", None), cfg.model))
    print(f"grserve: model {cfg.model.source} ({dtype}), catalog {len(cat):,} items "
          f"(depth {cat.depth}, codebooks {list(cat.codebook_sizes)}), default beam width {cfg.search.beam_width} "
          f"-> {_url(cfg.server)}", flush=True)
    if cfg.search.warmup and hasattr(engine, "warm_up"):  # a stand-in engine (tests) may have none
        _warm_up(engine)
    engine.start()
    return serve_until_exit(app, cfg.server.host, cfg.server.port, cfg.server.log_level, engine.stop)


def _open_state(cfg: ServeConfig) -> tuple[StateStore | None, StoredState]:
    from grserve.state.store import open_state

    return open_state(cfg.state.state_dir, "retrieval", cfg.catalog.duplicate_sids)


def _warm_up(engine) -> None:
    """The engine's warm-up with a line per batch (``start()`` would do it silently); the server listens after."""
    t0 = time.perf_counter()
    engine.warm_up(log=lambda line: print(f"grserve: {line}", flush=True))
    print(f"grserve: warmed up in {time.perf_counter() - t0:.1f} s; listening", flush=True)


def load_popularity(cfg: ServeConfig):
    """The cold-start popularity of ``--popularity FILE`` (None without it: every item counts 0)."""
    from grserve.catalog.popularity import Popularity

    return Popularity.load(cfg.catalog.popularity) if cfg.catalog.popularity else None


def _url(server) -> str:
    host = f"[{server.host}]" if ":" in server.host else server.host
    return f"http://{host}:{server.port}"


def run_cluster(cfg: ServeConfig) -> int:
    """``--instances N`` (or ``--ray-address``): N retrieval engine actors on Ray behind this front end, which owns
    the state store: the instances are sent what it holds once started (and again when one is restarted)."""
    from grserve.cluster.gr.modes import ClusterRetrievalEngine
    from grserve.server.launch.serving import serve_until_exit
    from grserve.state.store import state_line

    store, stored = _open_state(cfg)  # before anything heavy: a locked dir fails fast
    try:
        popularity = load_popularity(cfg)
        engine = ClusterRetrievalEngine.launch(cfg, cfg.cluster)
    except (ValueError, KeyError, OSError) as exc:
        raise usage_error(exc) from None
    app = cluster_app(engine, lambda m: create_app_for(engine, cfg, m, store, popularity))
    cat = engine.catalogs.current()
    print_layout(engine)
    for line in engine.describe():
        print(f"grserve: {line}", flush=True)
    from grserve.model.precision_label import dtype_label  # lazy: torch
    print(f"grserve: model {cfg.model.source} ({cfg.precision_gate.label(dtype_label(cfg.model))}) on "
          f"{cfg.cluster.instances} instances, catalog {len(cat):,} items, default beam width "
          f"{cfg.search.beam_width} -> {_url(cfg.server)}", flush=True)
    engine.start()
    restore_started(engine, stored)
    print(f"grserve: {state_line(store, stored)}", flush=True)
    return serve_until_exit(app, cfg.server.host, cfg.server.port, cfg.server.log_level, engine.stop)


def served_model_name(cfg: ServeConfig) -> str:
    """The OpenAI routes' model id: ``--served-model-name``, else ``--model`` as given."""
    return cfg.beams.served_model_name or cfg.model.source


def print_layout(engine) -> None:
    """The SID layout the catalog serves with, and what was inferred from the tokenizer (if anything)."""
    note = getattr(engine, "layout_note", None)
    if note:
        print(f"grserve: {note}", flush=True)
    print(f"grserve: SID layout: {engine.catalogs.current().layout.describe()}", flush=True)


def create_app_for(engine, cfg: ServeConfig, metrics, store: StateStore | None = None, popularity=None):
    from grserve.server.retrieval.app import create_app

    return create_app(engine, cfg.server, metrics, cfg.edge, cfg.reload, cfg.beams, served_model_name(cfg), store,
                      popularity)


def run_engine_process(cfg: ServeConfig) -> int:
    """The retrieval engine in an engine-core process (``engine_core/``), this process the HTTP front end; with
    ``--api-servers N`` > 1, N front-end processes on the port."""
    from grserve.server.launch.processes import serve_split

    if cfg.process.api_servers > 1 and cfg.state.state_dir:
        raise UsageError("--api-servers > 1 with --state-dir: one front end owns the state store; use one")
    if cfg.process.api_servers > 1 and cfg.reload.catalog_dir:
        raise UsageError("--api-servers > 1 with --catalog-dir: a reload reaches the front end that took it, the "
                         "others would validate against the old catalog; use one front end")
    return serve_split("retrieval", cfg, cfg.server, cfg.process, cfg.edge, retrieval_front_end)


def retrieval_front_end(cfg: ServeConfig, client, info: dict):
    """The retrieval app over an engine-core client: the client gets what the app reads of a retrieval engine
    (its own catalog copy, the search defaults, the model's tokenizer); returns the app and its start-up lines."""
    from grserve.engine.retrieval_engine import served_catalog
    from grserve.engine.tokenizer import model_tokenizer
    from grserve.cluster.gr.state_change import BroadcastCatalogStore
    from grserve.server.http.metrics import Metrics
    from grserve.state.store import restore_catalog, state_line

    store, stored = _open_state(cfg)
    try:
        popularity = load_popularity(cfg)
        client.tokenizer = model_tokenizer(cfg.model.source)
        catalog, client.layout_note, bind = served_catalog(cfg, client.tokenizer)
        client.vocab_size, client.search = info["vocab_size"], cfg.search
        # the front end's copy: a reload is swapped in here, then sent to the engine process, which applies it in
        # order with the requests around it (replayed to a restarted engine process: EngineCoreClient.change)
        client.catalogs = BroadcastCatalogStore(catalog, client.vocab_size, client.broadcast, bind)
        restore_catalog(client.catalogs, stored.catalog)
        metrics = Metrics()
        client.on_batch = metrics.on_batch
        app = create_app_for(client, cfg, metrics, store, popularity)
    except (ValueError, KeyError, OSError) as exc:
        raise usage_error(exc) from None
    cat = client.catalogs.current()
    lines = [state_line(store, stored), *info.get("lines", [])]
    if client.layout_note:
        lines.append(client.layout_note)
    # the engine process's choice, with the precision gate's verdict
    dtype = cfg.precision_gate.label(info.get("dtype") or f"{cfg.model.dtype}, {cfg.model.device}")
    lines += [f"SID layout: {cat.layout.describe()}",
              f"model {cfg.model.source} ({dtype}), catalog {len(cat):,} items (depth "
              f"{cat.depth}, codebooks {list(cat.codebook_sizes)}), default beam width {cfg.search.beam_width} -> "
              f"{_url(cfg.server)}"]
    return app, lines
