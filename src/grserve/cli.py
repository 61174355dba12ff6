"""The ``grserve`` command line: one argparse tree that each command module contributes to.

::

    grserve serve [retrieval] | ranking | llm        server/retrieval_main.py, ranking_main.py, llm_main.py
    grserve bench retrieval | cache | ranking | serve | quality | cluster | pd
    grserve catalog generate | validate | build
    grserve recommend                                recommend_main.py (offline, JSONL in and out)

Each command module has ``add_command(sub)``: it adds its subcommand to a group with flags generated from config
dataclasses (:mod:`grserve.flags`: every flag, its default and its check are defined once, in a dataclass field) and
sets ``handler``, which builds the configs and calls the module's ``run(cfg)``. Heavy imports (torch, the engines,
uvicorn) happen inside the handlers, so ``--help`` is instant and never imports torch.

``main(argv)`` returns the exit code: 0 ok, 1 a failed check (``catalog validate``), 2 bad arguments (argparse's
own errors, a :class:`~grserve.flags.ConfigError` or :class:`~grserve.flags.UsageError`, printed as
``grserve: error: ...``), 130 on Ctrl-C; ``--help`` returns 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from grserve.bench import cache as bench_cache
from grserve.bench import cluster as bench_cluster
from grserve.bench import pd as bench_pd
from grserve.bench import ranking as bench_ranking
from grserve.bench import retrieval as bench_retrieval
from grserve.bench import serve as bench_serve
from grserve.config import CatalogConfig
from grserve.flags import (
    Checked,
    ConfigError,
    HelpFormatter,
    UsageError,
    add_flags,
    command_parser,
    flag,
    from_args,
)
from grserve.movielens import build as movielens_build
from grserve.movielens import quality as movielens_quality
from grserve.server import llm_main, ranking_main, retrieval_main
from grserve import recommend_main

CATALOG_EXTENSIONS = (".jsonl", ".csv", ".grcat")
DEFAULT_SERVE_MODE = "retrieval"


# ----------------------------------------------------------------------------------------------------------
# catalog generate | validate (here rather than in grserve.catalog, whose package import loads torch)
# ----------------------------------------------------------------------------------------------------------
def _catalog_extension(path: str) -> str | None:
    ext = os.path.splitext(path)[1].lower()
    return None if ext in CATALOG_EXTENSIONS else \
        f"unknown catalog extension {ext!r} in {path!r} (use {', '.join(CATALOG_EXTENSIONS)})"


@dataclass(frozen=True)
class CatalogOut(Checked):
    out: str = flag(help="output file: .jsonl, .csv or .grcat (the extension picks the format)",
                    check=_catalog_extension, metavar="FILE")


def catalog_generate(cat: CatalogConfig, out: str) -> int:
    from grserve.catalog import CatalogError, generate_catalog, save_catalog

    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"--out {out}: directory {parent} does not exist")
    try:
        catalog = generate_catalog(cat.num_items, cat.depth, cat.codebook_size, cat.seed)
        save_catalog(catalog, out)
    except (CatalogError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {out}: {len(catalog):,} items, depth {catalog.depth}, codebook sizes {list(catalog.codebook_sizes)}")
    return 0


def catalog_validate(path: str) -> int:
    from grserve.catalog import load_catalog

    if not os.path.isfile(path):
        print(f"grserve: error: catalog file not found: {path}", file=sys.stderr)
        return 1
    try:
        cat = load_catalog(path)
    except (ValueError, OSError) as exc:  # CatalogError is a ValueError
        print(f"invalid catalog: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: ok: {len(cat):,} items, depth {cat.depth}, codebook sizes {list(cat.codebook_sizes)}")
    return 0


def _add_catalog_commands(sub: Any) -> None:
    p = command_parser(sub, "generate", help="write a synthetic catalog",
                       description="Write a deterministic synthetic catalog (item ids 0..N-1, SIDs shaped like RQ "
                                   "semantic IDs). The format follows the --out extension.")
    add_flags(p, CatalogOut)
    add_flags(p, CatalogConfig, skip=("path",))
    p.set_defaults(handler=lambda ns: catalog_generate(from_args(CatalogConfig, ns), from_args(CatalogOut, ns).out))
    p = command_parser(sub, "validate", help="check a catalog file",
                       description="Load a catalog file and print its item count, depth and codebook sizes, or the "
                                   "first problem found (exit code 1).")
    p.add_argument("file", metavar="FILE", help="catalog file (.jsonl, .csv or .grcat)")
    p.set_defaults(handler=lambda ns: catalog_validate(ns.file))


# ----------------------------------------------------------------------------------------------------------
# the tree
# ----------------------------------------------------------------------------------------------------------
def _help_on_stderr(parser: argparse.ArgumentParser) -> int:
    """No (sub)command given: the relevant help on stderr, exit 2."""
    parser.print_help(sys.stderr)
    return 2


def _group(sub: Any, name: str, help: str, description: str, metavar: str) -> Any:
    p = command_parser(sub, name, help=help, description=description)
    p.set_defaults(handler=lambda ns: _help_on_stderr(p))
    return p.add_subparsers(dest=f"{name}_command", metavar=metavar, title="commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grserve", formatter_class=HelpFormatter,
        description="Inference server for generative recommenders: a user's item history goes in, the top items "
                    "found by semantic-ID beam search come out; also GR ranking (BAT) and LLM serving.",
        epilog="Run 'grserve COMMAND --help' for a command's flags. 'grserve serve' with no flags starts the "
               "embedded default: the 'tiny' model preset and a generated 20,000-item catalog on 127.0.0.1:8000.")
    parser.set_defaults(handler=lambda ns: _help_on_stderr(parser))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    serve = _group(sub, "serve", "run an HTTP server (retrieval, ranking or llm; default retrieval)",
                   f"Serve a model over HTTP. MODE is retrieval (the default: 'grserve serve [FLAGS]' is 'grserve "
                   f"serve {DEFAULT_SERVE_MODE} [FLAGS]'), ranking or llm; 'grserve serve MODE --help' lists its "
                   "flags.", "MODE")
    for module in (retrieval_main, ranking_main, llm_main):
        module.add_command(serve)

    bench = _group(sub, "bench", "benchmarks", "Benchmarks; 'grserve bench BENCH --help' lists a benchmark's flags.",
                   "BENCH")
    for module in (bench_retrieval, bench_cache, movielens_quality, bench_ranking, bench_serve, bench_cluster,
                   bench_pd):
        module.add_command(bench)

    catalog = _group(sub, "catalog", "generate, validate or build catalog files",
                     "Catalog files map item ids to semantic IDs. Formats (by extension): .jsonl ({\"item_id\": 7, "
                     "\"sid\": [3, 41, 9]} per line), .csv (item_id,sid with dash-joined codes, or item_id,c1,c2,...) "
                     "and the compact binary .grcat.", "ACTION")
    _add_catalog_commands(catalog)
    movielens_build.add_command(catalog)
    recommend_main.add_command(sub)
    return parser


def _with_default_serve_mode(argv: list[str]) -> list[str]:
    """``grserve serve [FLAGS]`` → ``grserve serve retrieval [FLAGS]`` (``grserve serve --help`` stays the group's)."""
    if argv[:1] == ["serve"] and (len(argv) == 1 or (argv[1].startswith("-") and argv[1] not in ("-h", "--help"))):
        return ["serve", DEFAULT_SERVE_MODE, *argv[1:]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = _with_default_serve_mode(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argparse usage error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return int(ns.handler(ns) or 0)
    except (UsageError, ConfigError) as exc:
        print(f"grserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
