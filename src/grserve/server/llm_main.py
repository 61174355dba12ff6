"""``grserve serve llm``: an LLM behind an OpenAI-compatible API, on the hybrid-cache continuous-batching engine."""

from __future__ import annotations

import argparse
import sys

from grserve.engine.llm import EngineLoop, build_model_engine, calibrate_rho
from grserve.scheduler.llm_factory import SCHEDULERS, make_llm_scheduler
from grserve.server.core import serve_until_exit
from grserve.server.llm_app import create_llm_app


def build_engine(args: argparse.Namespace):
    from grserve.engine.tokenizer import load_tokenizer
    from grserve.model import load_model

    model = load_model(args.model, dtype=args.dtype, device=args.device, seed=args.seed)
    tok = load_tokenizer(args.model, model.spec.vocab_size)
    rho = args.rho if args.rho is not None else (calibrate_rho(model) if args.scheduler == "aptserve" else 0.0)
    pol = make_llm_scheduler(args.scheduler, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo, rho=rho,
                             token_budget=args.token_budget, max_num_batched_tokens=args.max_batched_tokens,
                             max_num_seqs=args.max_num_seqs)
    engine = build_model_engine(model, pol, num_blocks=args.num_blocks, block_size=args.block_size,
                                prefix_cache_tokens=args.prefix_cache_tokens,
                                prefix_cache_policy=args.prefix_cache_policy,
                                eos_token_id=tok.eos_token_id, detokenize=tok.decode)
    return engine, tok, model


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grserve serve llm", description=(
        "Serve an LLM over an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) plus "
        "/health and /metrics, on the continuous-batching engine with Apt-Serve's hybrid KV/hidden cache."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-mha", help="preset name (tiny, tiny-mha, qwen3-0.6b, ...) or HF dir")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: --model)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--scheduler", default="aptserve", choices=SCHEDULERS)
    p.add_argument("--num-blocks", type=int, default=4096, help="blocks in the unified KV/hidden pool")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT SLO in seconds (aptserve)")
    p.add_argument("--tbt-slo", type=float, default=1.0, help="P99 TBT SLO in seconds (aptserve)")
    p.add_argument("--rho", type=float, default=None, help="hidden-cache cost per cached token in seconds "
                                                           "(default: profiled at start-up)")
    p.add_argument("--token-budget", type=int, default=512, help="tokens per iteration (chunked)")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="prefill tokens per iteration")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--prefix-cache-tokens", type=int, default=0,
                   help="prompt-prefix KV cache size in tokens (0 = off): requests sharing a prompt prefix copy "
                        "its K/V instead of computing it (KV-cache requests only)")
    p.add_argument("--prefix-cache-policy", default="lru", choices=("lru", "lfu", "laru"),
                   help="eviction policy of the prefix cache (laru: learning-augmented LRU, online LightGBM)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.num_blocks < 2 or args.block_size < 1:
        print("grserve serve llm: error: --num-blocks must be >= 2 and --block-size >= 1", file=sys.stderr)
        return 2
    if args.prefix_cache_tokens < 0:
        print("grserve serve llm: error: --prefix-cache-tokens must be >= 0", file=sys.stderr)
        return 2
    try:
        engine, tok, model = build_engine(args)
    except (ValueError, OSError) as exc:
        print(f"grserve serve llm: error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    loop = EngineLoop(engine).start()
    app = create_llm_app(loop, tok, name, model.spec.max_position_embeddings, model.spec.vocab_size)
    pc = engine.prefix_cache
    prefix = (f", prefix cache {pc.capacity} tokens ({pc.bytes / 2**20:.0f} MiB, {args.prefix_cache_policy})"
              if pc is not None else "")
    print(f"grserve: LLM {name} ({args.dtype}), scheduler {args.scheduler}, {args.num_blocks} blocks x "
          f"{args.block_size} tokens{prefix} -> http://{args.host}:{args.port}/v1", flush=True)
    return serve_until_exit(app, args.host, args.port, args.log_level, loop.stop)
