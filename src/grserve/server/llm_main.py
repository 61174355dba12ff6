"""``grserve serve llm``: an LLM behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions,
/v1/models) plus /health and /metrics, on the continuous-batching engine with Apt-Serve's hybrid KV/hidden cache."""

from __future__ import annotations

import argparse

from grserve.config import LLMConfig, LLMServeConfig, ModelConfig, ServerConfig
from grserve.flags import UsageError, add_flags, command_parser, from_args
from grserve.server.startup import check_model


def add_command(sub) -> None:
    p = command_parser(sub, "llm", help="serve an LLM with an OpenAI-compatible API (hybrid KV/hidden cache, "
                                        "Apt-Serve)", description=__doc__)
    d = LLMServeConfig()
    add_flags(p, d.model, title="model")
    add_flags(p, d.llm, title="engine")
    add_flags(p, d.server, title="HTTP", skip=("max_prompt_tokens", "max_top_n"))
    p.set_defaults(handler=lambda ns: run(config_from_args(ns)))


def config_from_args(ns: argparse.Namespace) -> LLMServeConfig:
    return LLMServeConfig(model=from_args(ModelConfig, ns), llm=from_args(LLMConfig, ns),
                          server=from_args(ServerConfig, ns))


def build_engine(cfg: LLMServeConfig):
    from grserve.engine.llm import build_model_engine, calibrate_rho
    from grserve.engine.tokenizer import load_tokenizer
    from grserve.model import load_model
    from grserve.scheduler.llm_factory import make_llm_scheduler

    m, c = cfg.model, cfg.llm
    model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed)
    tok = load_tokenizer(m.source, model.spec.vocab_size)
    rho = c.rho if c.rho is not None else (calibrate_rho(model) if c.scheduler == "aptserve" else 0.0)
    pol = make_llm_scheduler(c.scheduler, ttft_slo=c.ttft_slo, tbt_slo=c.tbt_slo, rho=rho,
                             token_budget=c.token_budget, max_num_batched_tokens=c.max_batched_tokens,
                             max_num_seqs=c.max_num_seqs)
    engine = build_model_engine(model, pol, num_blocks=c.num_blocks, block_size=c.block_size,
                                prefix_cache_tokens=c.prefix_cache_tokens, prefix_cache_policy=c.prefix_cache_policy,
                                eos_token_id=tok.eos_token_id, detokenize=tok.decode)
    return engine, tok, model


def run(cfg: LLMServeConfig) -> int:
    check_model(cfg.model)

    from grserve.engine.llm import EngineLoop
    from grserve.server.core import serve_until_exit
    from grserve.server.llm_app import create_llm_app

    try:
        engine, tok, model = build_engine(cfg)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    c, s = cfg.llm, cfg.server
    name = c.served_model_name or cfg.model.source
    loop = EngineLoop(engine).start()
    app = create_llm_app(loop, tok, name, model.spec.max_position_embeddings, model.spec.vocab_size)
    pc = engine.prefix_cache
    prefix = (f", prefix cache {pc.capacity} tokens ({pc.bytes / 2**20:.0f} MiB, {c.prefix_cache_policy})"
              if pc is not None else "")
    print(f"grserve: LLM {name} ({cfg.model.dtype}), scheduler {c.scheduler}, {c.num_blocks} blocks x "
          f"{c.block_size} tokens{prefix} -> http://{s.host}:{s.port}/v1", flush=True)
    return serve_until_exit(app, s.host, s.port, s.log_level, loop.stop)
