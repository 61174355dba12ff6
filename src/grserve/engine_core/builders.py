"""What an engine-core process builds, by kind: the engine and the facts its front ends need (``info``): what a
request must fit, the model's limits, and the start-up lines that say what was chosen on this machine."""

from __future__ import annotations

import time
from typing import Any

from grserve.model.thread_choice import engine_threads, start_line


def llm_lines(engine: Any, cfg: Any) -> list[str]:
    """The LLM engine's start-up lines (``grserve serve llm`` prints them, whichever process built it)."""
    c, s = cfg.llm, cfg.server
    name = c.served_model_name or cfg.model.source
    pc = engine.prefix_cache
    prefix = (f", prefix cache {pc.capacity} tokens ({pc.bytes / 2**20:.0f} MiB, {c.prefix_cache_policy})"
              if pc is not None else "")
    from grserve.model.precision_label import model_label  # lazy: torch
    lines = [f"LLM {name} ({model_label(getattr(engine, 'model', None), cfg.model)}), scheduler {c.scheduler}, {c.num_blocks} blocks x {c.block_size} "
             f"tokens{prefix}, {engine.thread_choice.describe()} -> http://{s.host}:{s.port}/v1"]
    describe = getattr(engine.core.executor, "describe", None)
    if describe is not None:  # the CPU fast paths chosen on this machine, and why (model/cpu_support.py)
        lines.append(describe())
    return lines


def build_llm(cfg: Any, on_batch: Any = None) -> tuple[Any, dict]:
    from grserve.engine.async_llm import AsyncLLMEngine

    engine = AsyncLLMEngine.build(cfg, pick_threads=True)
    spec = engine.model.spec
    info = {"fit": engine.core.fit, "max_model_len": spec.max_position_embeddings, "vocab_size": spec.vocab_size,
            "lines": llm_lines(engine, cfg), "threads": engine.thread_choice.threads}
    return engine, info


def llm_precheck(info: dict):
    """What a front end checks of an LLM request before sending it: that it can ever fit (``LLMFit``: a 400)."""
    fit = info["fit"]
    return lambda req: fit.check(len(req.prompt_ids), req.params.max_tokens)


def build_retrieval(cfg: Any, on_batch: Any = None) -> tuple[Any, dict]:
    """The retrieval engine of ``grserve serve`` (it warms up in ``start()``, before its first heartbeat)."""
    from grserve.engine.retrieval_engine import RetrievalEngine

    engine = RetrievalEngine.build(cfg, on_batch=on_batch)
    choice = engine_threads(cfg.process.threads, engine.runner.model, cfg.accel.cpu_packed_linears)
    if cfg.search.warmup:  # before the first heartbeat: the front end takes requests only after it
        t0 = time.perf_counter()
        engine.warm_up(log=lambda line: print(f"grserve: {line}", flush=True))
        print(f"grserve: warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    describe = getattr(engine.runner, "describe", None)
    lines = [start_line(choice), describe()] if callable(describe) else [start_line(choice)]
    info = {"vocab_size": engine.vocab_size, "catalog_version": engine.catalogs.version, "lines": lines,
            "threads": choice.threads, "dtype": _label(engine.model, cfg.model)}
    return engine, info


def _label(model: Any, model_cfg: Any) -> str:
    """The model's dtype (and quantization) for the front end's start line (``model/dtype_choice.py``)."""
    from grserve.model.precision_label import model_label  # lazy: torch

    return model_label(model, model_cfg)


def build_ranking(cfg: Any, on_batch: Any = None) -> tuple[Any, dict]:
    """The BAT ranking engine of ``grserve serve ranking``: the users and items of the flags (the front end sends
    what its state store restored as changes), the item KV precomputed before the first heartbeat."""
    from grserve.engine.ranking_engine import RankingEngine
    from grserve.engine.ranking_runner import RankingRunner
    from grserve.model import load_model
    from grserve.ranking.startup_data import build_registry

    m = cfg.model
    model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed, quantization=m.quantization)
    choice = engine_threads(cfg.process.threads, model, packed=False)  # BAT runs F.linear
    reg = build_registry(cfg.data, model.spec.vocab_size)
    runner = RankingRunner(model, reg, cfg.ranking, progress=True)
    engine = RankingEngine(runner, on_batch=on_batch, edge=cfg.edge)
    engine.beat = lambda: {"ranking_stats": runner.stats}  # the front end's /v1/ranking/stats
    return engine, {"vocab_size": model.spec.vocab_size, "policy": runner.policy.name,
                    "lines": [start_line(choice), f"model {m.source} ({_label(model, m)})"],
                    "threads": choice.threads}
