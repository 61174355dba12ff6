"""Command line: ``grserve serve``, ``grserve bench retrieval``, ``grserve catalog generate|validate``.

``main(argv)`` returns the process exit code (0 ok, 1 a failed check, 2 bad arguments); ``--help`` returns 0.
Heavy imports (torch, the engine, uvicorn) happen inside the commands, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Sequence

from grserve.config import (
    CatalogConfig,
    ModelConfig,
    SchedulerConfig,
    SearchConfig,
    ServeConfig,
    ServerConfig,
)

_D_MODEL, _D_CAT, _D_SEARCH, _D_SCHED, _D_SERVER = (ModelConfig(), CatalogConfig(), SearchConfig(), SchedulerConfig(),
                                                    ServerConfig())
DTYPES = ("float32", "bfloat16", "float16", "float64")
FALLBACK_PRESETS = ("tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen2-1.5b")


class UsageError(Exception):
    """A bad argument found after parsing (missing file, unknown preset...): one line on stderr, exit 2."""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def _port(text: str) -> int:
    v = _nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {v}")
    return v


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _presets() -> tuple[str, ...]:
    try:
        from grserve.model.spec import PRESETS
    except Exception:  # noqa: BLE001 - model package missing or broken: fall back to the documented names
        return FALLBACK_PRESETS
    return tuple(sorted(PRESETS))


# ----------------------------------------------------------------------------------------------------------
# parser
# ----------------------------------------------------------------------------------------------------------
class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:  # "(default: None)" says nothing; the help text explains the fallback
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grserve", formatter_class=_Formatter,
        description="Inference server for generative recommenders: a user's item history goes in, the top items "
                    "found by semantic-ID beam search come out.",
        epilog="Run 'grserve COMMAND --help' for a command's flags. 'grserve serve' with no flags starts the "
               "embedded default: the 'tiny' model preset and a generated 20,000-item catalog on 127.0.0.1:8000.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # serve
    p = sub.add_parser(
        "serve", formatter_class=_Formatter, help="run the HTTP server",
        description="Build the retrieval engine (model + catalog + batching scheduler) and serve it over HTTP.\n"
                    "Routes: POST /v1/recommend, GET /health, GET /metrics, POST /v1/catalog (admin reload).\n"
                    "With no flags: preset 'tiny' (random weights, seeded), a generated 20,000-item catalog, "
                    "http://127.0.0.1:8000.")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=_D_MODEL.source, metavar="PRESET_OR_DIR",
                   help="a model preset (tiny, qwen3-0.6b, qwen3-1.7b, qwen2-1.5b; seeded random weights) or a "
                        "Hugging Face-format checkpoint directory (config.json + *.safetensors)")
    g.add_argument("--device", type=_device, default=_D_MODEL.device, metavar="cpu|cuda|cuda:N",
                   help="where the model runs")
    g.add_argument("--dtype", choices=DTYPES, default=_D_MODEL.dtype, help="model weights and activations dtype")
    g.add_argument("--seed", type=_nonneg_int, default=_D_MODEL.seed,
                   help="seed for a preset's random weights and for the generated catalog")
    g = p.add_argument_group("catalog")
    g.add_argument("--catalog", default=None, metavar="FILE",
                   help="item catalog file (.jsonl, .csv or .grcat; see 'grserve catalog'); default: generate one "
                        "with --num-items/--depth/--codebook-size")
    g.add_argument("--num-items", type=_positive_int, default=_D_CAT.num_items, metavar="N",
                   help="items in the generated catalog (ignored with --catalog)")
    g.add_argument("--depth", type=_positive_int, default=_D_CAT.depth, metavar="D",
                   help="SID tokens per item in the generated catalog (ignored with --catalog)")
    g.add_argument("--codebook-size", type=_positive_int, default=_D_CAT.codebook_size, metavar="C",
                   help="codes per SID level in the generated catalog (ignored with --catalog)")
    g = p.add_argument_group("search and batching")
    g.add_argument("--beam-width", type=_positive_int, default=_D_SEARCH.beam_width, metavar="BW",
                   help="beam width used when a request does not give one (requests may ask for up to "
                        f"max({_D_SEARCH.max_beam_width}, BW))")
    g.add_argument("--token-capacity", type=_positive_int, default=_D_SCHED.token_capacity, metavar="T",
                   help="prompt tokens per batch; a single longer request runs alone")
    g.add_argument("--slo-ms", type=_positive_float, default=_D_SCHED.slo_ms, metavar="MS",
                   help="P99 latency budget; requests wait up to "
                        f"{_D_SCHED.wait_quota_fraction:g} x MS for a batch to fill")
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default=_D_SERVER.host, metavar="H", help="address to listen on (0.0.0.0: all)")
    g.add_argument("--port", type=_port, default=_D_SERVER.port, metavar="P", help="TCP port to listen on")
    g.add_argument("--log-level", default=_D_SERVER.log_level,
                   choices=("critical", "error", "warning", "info", "debug"), help="uvicorn / grserve log level")

    # bench
    p = sub.add_parser("bench", formatter_class=_Formatter, help="benchmarks",
                       description="Benchmarks. 'grserve bench retrieval [FLAGS]' runs the retrieval benchmark; "
                                   "see 'grserve bench retrieval --help' for its flags.")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    for (group, name), (_, text) in DELEGATED.items():
        if group == "bench":
            bsub.add_parser(name, help=f"{text} (flags are forwarded; see --help)", add_help=False)

    # catalog
    p = sub.add_parser("catalog", formatter_class=_Formatter, help="generate or validate catalog files",
                       description="Catalog files map item ids to semantic IDs. Formats (by extension): .jsonl "
                                   "({\"item_id\": 7, \"sid\": [3, 41, 9]} per line), .csv (item_id,sid with "
                                   "dash-joined codes, or item_id,c1,c2,...) and the compact binary .grcat.")
    csub = p.add_subparsers(dest="catalog_command", metavar="ACTION")
    g = csub.add_parser("generate", formatter_class=_Formatter, help="write a synthetic catalog",
                        description="Write a deterministic synthetic catalog (item ids 0..N-1, SIDs shaped like "
                                    "RQ semantic IDs). The format follows the --out extension.")
    g.add_argument("--out", required=True, metavar="FILE", help="output file: .jsonl, .csv or .grcat")
    g.add_argument("--num-items", type=_positive_int, default=_D_CAT.num_items, metavar="N", help="number of items")
    g.add_argument("--depth", type=_positive_int, default=_D_CAT.depth, metavar="D", help="SID tokens per item")
    g.add_argument("--codebook-size", type=_positive_int, default=_D_CAT.codebook_size, metavar="C",
                   help="codes per SID level")
    g.add_argument("--seed", type=_nonneg_int, default=_D_CAT.seed, help="random seed")
    csub.add_parser("build", help=DELEGATED[("catalog", "build")][1] + " (see 'grserve catalog build --help')",
                    add_help=False)
    v = csub.add_parser("validate", formatter_class=_Formatter, help="check a catalog file",
                        description="Load a catalog file and print its item count, depth and codebook sizes, or "
                                    "the first problem found (exit code 1).")
    v.add_argument("file", metavar="FILE", help="catalog file (.jsonl, .csv or .grcat)")
    parser._grserve_subparsers = dict(sub.choices)  # type: ignore[attr-defined]
    return parser


# ----------------------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """ServeConfig from parsed ``serve`` flags; UsageError for a bad preset, missing file or absent GPU."""
    if args.catalog is not None and not os.path.isfile(args.catalog):
        raise UsageError(f"catalog file not found: {args.catalog}")
    if not os.path.isdir(os.path.expanduser(args.model)) and args.model not in _presets():
        raise UsageError(f"unknown model {args.model!r}: not a preset ({', '.join(_presets())}) "
                         "and not an existing directory")
    if args.catalog is None and args.num_items > args.codebook_size ** args.depth:
        raise UsageError(f"--num-items {args.num_items} does not fit in {args.codebook_size}**{args.depth} SIDs")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: no CUDA device is available (use --device cpu)")
    return ServeConfig(
        model=ModelConfig(source=args.model, dtype=args.dtype, device=args.device, seed=args.seed),
        catalog=CatalogConfig(path=args.catalog, num_items=args.num_items, depth=args.depth,
                              codebook_size=args.codebook_size, seed=args.seed),
        search=SearchConfig(beam_width=args.beam_width,
                            max_beam_width=max(_D_SEARCH.max_beam_width, args.beam_width)),
        scheduler=SchedulerConfig(token_capacity=args.token_capacity, slo_ms=args.slo_ms),
        server=ServerConfig(host=args.host, port=args.port, log_level=args.log_level),
    )


def _serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)

    from grserve.engine.engine import RetrievalEngine
    from grserve.server.core import serve_until_exit
    from grserve.server.metrics import Metrics
    from grserve.server.retrieval_app import create_app

    metrics = Metrics()
    try:
        engine = RetrievalEngine.build(cfg, on_batch=metrics.on_batch)
    except (ValueError, KeyError, OSError) as exc:  # CatalogError is a ValueError: bad file, vocab mismatch...
        raise UsageError(exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)) from None
    app = create_app(engine, cfg.server, metrics)
    cat = engine.catalogs.current()
    host = f"[{cfg.server.host}]" if ":" in cfg.server.host else cfg.server.host
    print(f"grserve: model {cfg.model.source} ({cfg.model.dtype}, {cfg.model.device}), catalog {len(cat):,} items "
          f"(depth {cat.depth}, codebooks {list(cat.codebook_sizes)}), default beam width {cfg.search.beam_width} "
          f"-> http://{host}:{cfg.server.port}", flush=True)
    engine.start()
    return serve_until_exit(app, cfg.server.host, cfg.server.port, cfg.server.log_level, engine.stop)


# Subcommands whose flags belong to the module that implements them: (group, name) → (module, one-line help).
DELEGATED = {
    ("bench", "retrieval"): ("grserve.bench.retrieval", "GR retrieval throughput / latency / KV memory vs HF transformers"),
    ("bench", "cache"): ("grserve.bench.cache", "cache eviction hit rates (LRU, OPT, FPB, HF, LARU) on replayed traces"),
    ("bench", "quality"): ("grserve.movielens.quality", "Recall@10 / NDCG@10 of the served MovieLens model vs baselines"),
    ("bench", "ranking"): ("grserve.bench.ranking", "BAT ranking throughput: hotness-aware prefix choice vs UP, IP, greedy, recompute"),
    ("serve", "ranking"): ("grserve.server.ranking_main", "serve GR ranking (BAT): POST /v1/rank"),
    ("bench", "serve"): ("grserve.bench.serve", "LLM serving: SLO attainment and effective throughput, FCFS vs chunked vs Apt-Serve"),
    ("serve", "llm"): ("grserve.server.llm_main", "serve an LLM with an OpenAI-compatible API (hybrid KV/hidden cache, Apt-Serve)"),
    ("catalog", "build"): ("grserve.movielens.build", "build a SID catalog from item text (RQ-KMeans over embeddings)"),
}


def _delegate(module_name: str, argv: list[str], group: str = "") -> int:
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not module_name.startswith(exc.name or "\0"):
            raise
        print(f"grserve: error: {module_name} is not installed", file=sys.stderr)
        return 2

    try:
        rc = module.main(argv) if hasattr(module, "main") else _run_command(module, argv, group)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(rc or 0)


def _run_command(module, argv: list[str], group: str) -> int:
    """A module of the add_command/run convention, until this file is one argparse tree."""
    from grserve.flags import ConfigError

    parser = argparse.ArgumentParser(prog=f"grserve {group}")
    sub = parser.add_subparsers()
    module.add_command(sub)
    (name,) = sub.choices
    ns = parser.parse_args([name, *argv])
    try:
        return ns.handler(ns)
    except ConfigError as exc:
        sub.choices[name].error(str(exc))


def _catalog_generate(args: argparse.Namespace) -> int:
    from grserve.catalog import CatalogError, generate_catalog, save_catalog

    ext = os.path.splitext(args.out)[1].lower()
    if ext not in (".jsonl", ".csv", ".grcat"):
        raise UsageError(f"--out {args.out}: unknown catalog extension {ext!r} (use .jsonl, .csv or .grcat)")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise UsageError(f"--out {args.out}: directory {parent} does not exist")
    try:
        cat = generate_catalog(args.num_items, args.depth, args.codebook_size, args.seed)
        save_catalog(cat, args.out)
    except (CatalogError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {args.out}: {len(cat):,} items, depth {cat.depth}, codebook sizes {list(cat.codebook_sizes)}")
    return 0


def _catalog_validate(args: argparse.Namespace) -> int:
    from grserve.catalog import load_catalog

    if not os.path.isfile(args.file):
        print(f"grserve: error: catalog file not found: {args.file}", file=sys.stderr)
        return 1
    try:
        cat = load_catalog(args.file)
    except (ValueError, OSError) as exc:  # CatalogError is a ValueError
        print(f"invalid catalog: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: ok: {len(cat):,} items, depth {cat.depth}, codebook sizes {list(cat.codebook_sizes)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and (argv[0], argv[1]) in DELEGATED:
        return _delegate(DELEGATED[(argv[0], argv[1])][0], argv[2:], argv[0])  # the rest belongs to that module's parser
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "catalog" and args.catalog_command == "generate":
            return _catalog_generate(args)
        if args.command == "catalog" and args.catalog_command == "validate":
            return _catalog_validate(args)
    except UsageError as exc:
        print(f"grserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    # no (sub)command: show the relevant help on stderr
    sub = getattr(parser, "_grserve_subparsers", {}).get(args.command, parser)
    sub.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
