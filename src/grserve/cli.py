"""The ``grserve`` command line: one argparse tree that each command module contributes to.

::

    grserve serve [retrieval] | ranking | llm        server/{retrieval,ranking,llm}/command.py
    grserve bench retrieval | cache | ranking | serve | quality | cluster | pd | peers     the lab package, grserve_bench
    grserve catalog generate | validate | convert | build
    grserve recommend                                recommend_main.py (offline, JSONL in and out)
    grserve check precision                          precision_check.py (a lower precision against float32)

Each command module has ``add_command(sub)``: it adds its subcommand to a group with flags generated from config
dataclasses (:mod:`grserve.flags`: every flag, its default and its check are defined once, in a dataclass field) and
sets ``handler``, which builds the configs and calls the module's ``run(cfg)``. Heavy imports (torch, the engines,
uvicorn) happen inside the handlers, so ``--help`` is instant and never imports torch.

Commands of other packages installed beside grserve come in through the entry-point group ``grserve.commands``
(``name = "module:register"``; ``register(sub)`` adds command ``name`` to the root). That is how ``grserve bench``
reaches the lab package ``grserve_bench`` (pyproject.toml declares it), which grserve never imports; without it,
``grserve bench`` says in one line how to get it.

``main(argv)`` returns the exit code: 0 ok, 1 a failed check (``catalog validate``), 2 bad arguments (argparse's
own errors, a :class:`~grserve.flags.ConfigError` or :class:`~grserve.flags.UsageError`, printed as
``grserve: error: ...``), 130 on Ctrl-C; ``--help`` returns 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

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
from grserve.server.llm import command as llm_main
from grserve.server.ranking import command as ranking_main
from grserve.server.retrieval import command as retrieval_main
from grserve import precision_check, recommend_main

CATALOG_EXTENSIONS = (".jsonl", ".csv", ".grcat", ".json")
DEFAULT_SERVE_MODE = "retrieval"
COMMANDS_GROUP = "grserve.commands"
BENCH_MISSING = ("the benchmarks are the grserve_bench package, which is not installed here; get it with "
                 "'pip install -e .' (or 'make install') in a grserve checkout")


# ----------------------------------------------------------------------------------------------------------
# catalog generate | validate (here rather than in grserve.catalog, whose package import loads torch)
# ----------------------------------------------------------------------------------------------------------
def _catalog_extension(path: str) -> str | None:
    ext = os.path.splitext(path)[1].lower()
    return None if ext in CATALOG_EXTENSIONS else \
        f"unknown catalog extension {ext!r} in {path!r} (use {', '.join(CATALOG_EXTENSIONS)})"


@dataclass(frozen=True)
class CatalogOut(Checked):
    out: str = flag(help="output file: .jsonl, .csv, .json or .grcat (the extension picks the format)",
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


def _load_bound(path: str, model: str | None, duplicate_sids: str = "refuse"):
    """The catalog at ``path``, bound to ``model``'s tokenizer when given (SID token text resolved, or inferred)."""
    from grserve.catalog import load_catalog
    from grserve.catalog.sid_text import bind_catalog
    from grserve.engine.tokenizer import model_tokenizer

    cat = load_catalog(path, duplicate_sids=duplicate_sids)
    if model is None:
        return cat, None
    if not os.path.isdir(model):
        raise ValueError(f"--model {model}: not a model directory")
    return bind_catalog(cat, model_tokenizer(model))


def _catalog_error(message: str) -> int:
    """A catalog file that is missing or invalid: one line on stderr, exit 1 (validate and convert alike)."""
    print(f"invalid catalog: {message}", file=sys.stderr)
    return 1


def _counts(cat) -> str:
    sids = f" ({len(cat):,} SIDs)" if cat.num_items != len(cat) else ""
    return f"{cat.num_items:,} items{sids}, depth {cat.depth}, codebook sizes {list(cat.codebook_sizes)}"


def catalog_validate(path: str, model: str | None = None, duplicate_sids: str = "refuse") -> int:
    if not os.path.isfile(path):
        return _catalog_error(f"file not found: {path}")
    try:
        cat, note = _load_bound(path, model, duplicate_sids)
    except (ValueError, OSError) as exc:  # CatalogError is a ValueError
        return _catalog_error(str(exc))
    text = f", SID text {cat.text.describe()}" if cat.text is not None else ""
    print(f"{path}: ok: {_counts(cat)}{text}")
    if note:
        print(note)
    if model is not None:
        print(f"on {model}: {cat.layout.describe()}")
    return 0


def catalog_convert(path: str, out: str, duplicate_sids: str = "refuse") -> int:
    """Any catalog format to any other (the layout and SID text carried over; .grcat for million-item catalogs)."""
    from grserve.catalog import load_catalog, save_catalog

    if not os.path.isfile(path):
        return _catalog_error(f"file not found: {path}")
    try:
        cat = load_catalog(path, duplicate_sids=duplicate_sids)
    except (ValueError, OSError) as exc:  # CatalogError is a ValueError
        return _catalog_error(str(exc))
    try:
        save_catalog(cat, out)
    except (ValueError, OSError) as exc:  # an output the format cannot hold, or cannot be written: a usage error
        raise UsageError(str(exc)) from None
    print(f"wrote {out}: {_counts(cat)}")
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
    p.add_argument("file", metavar="FILE", help="catalog file (.jsonl, .csv, .json or .grcat)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="also resolve the catalog's SID tokens against this model directory's tokenizer (default: "
                        "none)")
    _duplicate_flag(p)
    p.set_defaults(handler=lambda ns: catalog_validate(ns.file, ns.model, ns.duplicate_sids))
    p = command_parser(sub, "convert", help="rewrite a catalog in another format",
                       description="Read a catalog (.jsonl, .csv, .json: an LC-Rec / MiniOneRec index, .grcat) and write "
                                   "it in the format of --out's extension, its layout and SID token text carried "
                                   "over (.csv cannot carry SID token text).")
    p.add_argument("file", metavar="FILE", help="catalog file to read")
    add_flags(p, CatalogOut)
    _duplicate_flag(p)
    p.set_defaults(handler=lambda ns: catalog_convert(ns.file, from_args(CatalogOut, ns).out, ns.duplicate_sids))


def _duplicate_flag(p: Any) -> None:
    p.add_argument("--duplicate-sids", choices=("refuse", "popularity"), default="refuse",
                   help="several items with one SID: refuse (exit 1 naming both), or popularity: keep them all, as "
                        "'grserve serve --duplicate-sids popularity' serves them (default: refuse)")


# ----------------------------------------------------------------------------------------------------------
# the tree
# ----------------------------------------------------------------------------------------------------------
def _help_on_stderr(parser: argparse.ArgumentParser) -> int:
    """No (sub)command given: the relevant help on stderr, exit 2."""
    parser.print_help(sys.stderr)
    return 2


def command_group(sub: Any, name: str, help: str, description: str, metavar: str) -> Any:
    """A command with subcommands (``grserve serve MODE``, ``grserve bench BENCH``); given none, it prints its help."""
    p = command_parser(sub, name, help=help, description=description)
    p.set_defaults(handler=lambda ns: _help_on_stderr(p))
    return p.add_subparsers(dest=f"{name}_command", metavar=metavar, title="commands")


Register = Callable[[Any], None]


def installed_commands() -> dict[str, Register]:
    """name → ``register`` of every command that an installed package declares in the entry-point group
    ``grserve.commands``; one declared by an install whose package is gone counts as not installed."""
    from importlib.metadata import entry_points

    found: dict[str, Register] = {}
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            found[ep.name] = ep.load()
        except ImportError:
            continue
    return found


def _missing_bench(ns: argparse.Namespace) -> int:
    raise UsageError(f"grserve bench: {BENCH_MISSING}")


def _add_missing_bench(sub: Any) -> None:
    p = command_parser(sub, "bench", help="benchmarks (not installed: the grserve_bench package)",
                       description=f"Benchmarks: {BENCH_MISSING}.")
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(handler=_missing_bench)


def build_parser(commands: Mapping[str, Register] | None = None) -> argparse.ArgumentParser:
    """The whole tree; ``commands``: the extra commands (default: ``installed_commands()``)."""
    parser = argparse.ArgumentParser(
        prog="grserve", formatter_class=HelpFormatter,
        description="Inference server for generative recommenders: a user's item history goes in, the top items "
                    "found by semantic-ID beam search come out; also GR ranking (BAT) and LLM serving.",
        epilog="Run 'grserve COMMAND --help' for a command's flags. 'grserve serve' with no flags starts the "
               "embedded default: the 'tiny' model preset and a generated 20,000-item catalog on 127.0.0.1:8000.")
    parser.set_defaults(handler=lambda ns: _help_on_stderr(parser))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    serve = command_group(sub, "serve", "run an HTTP server (retrieval, ranking or llm; default retrieval)",
                   f"Serve a model over HTTP. MODE is retrieval (the default: 'grserve serve [FLAGS]' is 'grserve "
                   f"serve {DEFAULT_SERVE_MODE} [FLAGS]'), ranking or llm; 'grserve serve MODE --help' lists its "
                   "flags.", "MODE")
    for module in (retrieval_main, ranking_main, llm_main):
        module.add_command(serve)

    commands = installed_commands() if commands is None else commands
    for register in commands.values():
        register(sub)
    if "bench" not in commands:
        _add_missing_bench(sub)

    catalog = command_group(sub, "catalog", "generate, validate or build catalog files",
                     "Catalog files map item ids to semantic IDs. Formats (by extension): .jsonl ({\"item_id\": 7, "
                     "\"sid\": [3, 41, 9]} or {\"item_id\": 7, \"sid_tokens\": [\"<a_3>\", \"<b_41>\", "
                     "\"<c_9>\"]} per line), .csv (item_id,sid with dash-joined codes, or item_id,c1,c2,...), .json (an "
                     "LC-Rec / MiniOneRec index) and the compact binary .grcat (docs/serving-gr-models.md).", "ACTION")
    _add_catalog_commands(catalog)
    movielens_build.add_command(catalog)
    recommend_main.add_command(sub)
    check = command_group(sub, "check", "checks of a model before it serves (precision)",
                          "Checks of a model before it serves: 'grserve check precision' compares a lower precision's "
                          "recommendations with float32's.", "CHECK")
    precision_check.add_command(check)
    return parser


def _with_default_serve_mode(argv: list[str]) -> list[str]:
    """``grserve serve [FLAGS]`` → ``grserve serve retrieval [FLAGS]`` (``grserve serve --help`` stays the group's)."""
    if argv[:1] == ["serve"] and (len(argv) == 1 or (argv[1].startswith("-") and argv[1] not in ("-h", "--help"))):
        return ["serve", DEFAULT_SERVE_MODE, *argv[1:]]
    return argv


def _serve_help(parser: argparse.ArgumentParser) -> int:
    """``grserve serve --help``: the modes, then the flags of the default mode (what plain ``grserve serve`` takes)."""
    serve = _choices(parser)["serve"]
    serve.print_help()
    print(f"\nThe default mode, '{DEFAULT_SERVE_MODE}' ('grserve serve [FLAGS]'):\n")
    _choices(serve)[DEFAULT_SERVE_MODE].print_help()
    return 0


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def main(argv: Sequence[str] | None = None, commands: Mapping[str, Register] | None = None) -> int:
    """Run one command; ``commands`` as in ``build_parser``."""
    argv = _with_default_serve_mode(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(commands)
    if argv in (["serve", "--help"], ["serve", "-h"]):
        return _serve_help(parser)
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
