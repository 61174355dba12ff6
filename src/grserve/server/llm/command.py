"""``grserve serve llm [MODEL]``: an LLM behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions,
/v1/models, /tokenize, /detokenize, /version) plus /health and /metrics, on the continuous-batching engine with
Apt-Serve's hybrid KV/hidden cache. MODEL (positional, as ``vllm serve MODEL``) is the same as --model. At start-up
the tokenizer directory is printed (a preset's byte-level tokenizer is written there: ``aiperf --tokenizer DIR``)."""

from __future__ import annotations

import argparse

from grserve.config import (
    ClusterConfig,
    ColocationConfig,
    LLMApiConfig,
    LLMConfig,
    LLMServeConfig,
    ModelConfig,
    PDConfig,
    ProcessConfig,
    ServerConfig,
    SLOConfig,
)
from grserve.flags import UsageError, add_flags, command_parser, from_args
from grserve.server.launch.modes import Deployments, deploy
from grserve.server.launch.startup import RECOMMEND_ONLY, add_edge_flags, check_model, edge_from_args


def add_command(sub) -> None:
    p = command_parser(sub, "llm", help="serve an LLM with an OpenAI-compatible API (hybrid KV/hidden cache, "
                                        "Apt-Serve)", description=__doc__)
    d = LLMServeConfig()
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model (a preset or an HF directory), as --model; wins over --model")
    add_flags(p, d.model, title="model")
    add_flags(p, d.llm, title="engine")
    add_flags(p, d.server, title="HTTP", skip=RECOMMEND_ONLY)
    add_flags(p, d.api, title="OpenAI API")
    add_edge_flags(p, None)
    add_flags(p, ClusterConfig, title="cluster (several instances on Ray; docs/cluster.md)")
    add_flags(p, SLOConfig, title="latency SLOs (PD routing, role flips, co-location)")
    add_flags(p, PDConfig, title="prefill/decode disaggregation (needs --instances >= 2; docs/cluster.md)")
    add_flags(p, ColocationConfig, title="online/offline co-location (docs/llm.md)")
    add_flags(p, ProcessConfig, title="processes (the engine in its own process, HTTP front ends; "
                                      "docs/architecture.md)")
    p.set_defaults(handler=lambda ns: run(config_from_args(ns)))


def config_from_args(ns: argparse.Namespace) -> LLMServeConfig:
    tag = getattr(ns, "model_tag", None)
    model = from_args(ModelConfig, ns, **({"source": tag} if tag else {}))
    return LLMServeConfig(model=model, llm=from_args(LLMConfig, ns), server=from_args(ServerConfig, ns),
                          api=from_args(LLMApiConfig, ns), edge=edge_from_args(ns),
                          cluster=from_args(ClusterConfig, ns), slo=from_args(SLOConfig, ns),
                          pd=from_args(PDConfig, ns), colocation=from_args(ColocationConfig, ns),
                          process=from_args(ProcessConfig, ns))


def run(cfg: LLMServeConfig) -> int:
    check_model(cfg.model)
    if cfg.pd.pd and cfg.cluster.instances < 2:
        raise UsageError("--pd needs --instances >= 2 (docs/cluster.md)")
    return deploy(cfg, Deployments(run_in_thread, run_engine_process, run_cluster))


def run_in_thread(cfg: LLMServeConfig) -> int:
    """The LLM engine on a thread of this process (``--no-engine-process``)."""
    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine_core.builders import llm_lines
    from grserve.memory import settle_allocator
    from grserve.server.launch.serving import serve_until_exit

    settle_allocator(cfg.process)  # the engine on a thread of this process: its allocator settings here

    try:
        engine = AsyncLLMEngine.build(cfg, pick_threads=True)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    s = cfg.server
    tok, spec = engine.tokenizer, engine.model.spec
    engine.start()
    app = _llm_app(cfg, engine, tok, spec.max_position_embeddings, spec.vocab_size)
    for line in (*llm_lines(engine, cfg), tokenizer_line(tok)):
        print(f"grserve: {line}", flush=True)
    return serve_until_exit(app, s.host, s.port, s.log_level, engine.stop)


def run_cluster(cfg: LLMServeConfig) -> int:
    """``--instances N`` (or ``--ray-address``): N engine instance actors on Ray behind this front end."""
    from grserve.cluster.core.metrics import ClusterCollector
    from grserve.cluster.llm.front_end import ClusterLLMEngine
    from grserve.server.launch.serving import serve_until_exit

    if cfg.llm.prefix_cache_tokens == 0:
        print("grserve: note: --prefix-cache-tokens is 0: KV-aware routing sees no cached prefix and requests "
              "of a dead instance are recomputed (no KV snapshots)", flush=True)
    try:
        engine = ClusterLLMEngine.launch(cfg, cfg.cluster)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    c, s, cluster = cfg.llm, cfg.server, cfg.cluster
    name = c.served_model_name or cfg.model.source
    engine.start()
    info = engine.instances[0].info
    app = _llm_app(cfg, engine, engine.tokenizer, info.max_model_len, info.vocab_size)
    app.state.metrics.registry.register(ClusterCollector(engine))
    for line in engine.describe():
        print(f"grserve: {line}", flush=True)
    from grserve.model.precision_label import dtype_label  # lazy: torch
    print(f"grserve: LLM {name} ({dtype_label(cfg.model)}) on {cluster.instances} instances, scheduler {c.scheduler} "
          f"-> http://{s.host}:{s.port}/v1", flush=True)
    return serve_until_exit(app, s.host, s.port, s.log_level, engine.stop)


def run_engine_process(cfg: LLMServeConfig) -> int:
    """The engine in an engine-core process (``engine_core/``), this process the HTTP front end; with
    ``--api-servers N`` > 1, N front-end processes on the port (``server/launch/processes.py``)."""
    from grserve.server.launch.processes import serve_split

    return serve_split("llm", cfg, cfg.server, cfg.process, cfg.edge, llm_front_end)


def llm_front_end(cfg: LLMServeConfig, client, info: dict):
    """The LLM app over an engine-core client, and its start-up lines (a front-end process builds it)."""
    from grserve.engine.tokenizer import load_tokenizer
    from grserve.engine_core.builders import llm_precheck

    client.precheck = llm_precheck(info)
    tok = load_tokenizer(cfg.api.tokenizer or cfg.model.source, info["vocab_size"], info["max_model_len"],
                         cfg.api.tokenizer_cache)
    app = _llm_app(cfg, client, tok, info["max_model_len"], info["vocab_size"])
    return app, [*info["lines"], tokenizer_line(tok)]


def _llm_app(cfg: LLMServeConfig, engine, tok, max_model_len: int, vocab_size: int):
    from grserve.server.llm.app import create_llm_app

    name = cfg.llm.served_model_name or cfg.model.source
    return create_llm_app(engine, tok, name, max_model_len, vocab_size, edge=cfg.edge, max_n=cfg.api.max_n,
                          max_logprobs=cfg.api.max_logprobs, max_messages=cfg.api.max_chat_messages,
                          tool_call_parser=cfg.api.tool_call_parser)


def tokenizer_line(tok) -> str:
    """The start-up line that names the tokenizer (or says the model directory has none)."""
    if getattr(tok, "message", None):  # NoTokenizer: a model directory without tokenizer files
        return tok.message
    return f"tokenizer {tok.name_or_path} (an HF directory: aiperf --tokenizer {tok.name_or_path})"
