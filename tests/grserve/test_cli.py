"""The one command line: every subcommand's --help works, shows every default and imports no torch; bad values exit
2 naming the flag; `grserve serve` defaults to retrieval; every old flag name still parses; each command's config
comes from its dataclass defaults (one place); `grserve bench` comes from the lab package through an entry point,
the product never imports the lab, and without the lab `grserve bench` says in one line how to get it."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint, distribution
from pathlib import Path

import pytest

from grserve import cli
from grserve_bench.cache import CacheBenchConfig
from grserve_bench.ranking import RankingBenchConfig
from grserve_bench.retrieval import RetrievalBenchConfig
from grserve_bench.serve import ServeBenchConfig
from grserve.config import LLMServeConfig, RankingServeConfig, ServeConfig
from grserve.server.llm import command as llm_main
from grserve.server.ranking import command as ranking_main
from grserve.server.retrieval import command as retrieval_main


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _leaves(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every command that runs something."""
    children = _subparsers(p)
    if not children:
        yield path, p
    for name, child in children.items():
        yield from _leaves(child, path + (name,))


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


LEAVES = dict(_leaves(cli.build_parser()))


def test_the_command_list():
    expected = {("serve", "retrieval"), ("serve", "ranking"), ("serve", "llm"), ("bench", "retrieval"),
                ("bench", "cache"), ("bench", "ranking"), ("bench", "serve"), ("bench", "quality"), ("bench", "cluster"),
                ("bench", "pd"), ("bench", "peers"), ("bench", "prefix"), ("bench", "soak"), ("bench", "invariance"),
                ("catalog", "generate"), ("catalog", "validate"), ("catalog", "convert"), ("catalog", "build"),
                ("recommend",), ("check", "precision")}
    assert expected == set(LEAVES)


@pytest.mark.parametrize("path", sorted(LEAVES), ids=" ".join)
def test_every_help_exits_0_and_shows_every_default(path, capsys):
    assert cli.main([*path, "--help"]) == 0
    text = "".join(capsys.readouterr().out.split())  # help wraps lines, also at hyphens
    shown = 0
    for a in LEAVES[path]._actions:
        if not a.option_strings or a.default is None or a.default is argparse.SUPPRESS:
            continue
        assert f"(default:{a.default})".replace(" ", "") in text, (a.option_strings, a.default)
        shown += 1
    assert text.count("(default:") >= shown


def test_help_imports_no_torch():
    """The parser build and every --help stay light: torch is imported by the commands' handlers only."""
    code = ("import argparse, contextlib, io, sys\n"
            "from grserve import cli\n"
            "def walk(p, path=()):\n"
            "    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]\n"
            "    yield path\n"
            "    for name, child in (subs[0].choices.items() if subs else ()):\n"
            "        yield from walk(child, path + (name,))\n"
            "from grserve_bench.cli import register\n"
            "paths = list(walk(cli.build_parser({'bench': register})))\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rcs = [cli.main([*p, '--help'], {'bench': register}) for p in paths]\n"
            "assert rcs == [0] * len(rcs), rcs\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print(len(paths))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 25  # the root, 4 groups, 20 commands


def test_serve_help_lists_the_modes_and_the_default(capsys):
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "retrieval" in out and "ranking" in out and "llm" in out
    assert "the default" in out and "'grserve serve [FLAGS]' is 'grserve serve retrieval [FLAGS]'" in out
    assert "--beam-width BW" in out and "--catalog-dir DIR" in out  # and the default mode's flags


@pytest.mark.parametrize("mode, admin, state", [
    ("retrieval", "POST /v1/catalog)", "the catalogs POST /v1/catalog loaded"),
    ("ranking", "POST /v1/users, /v1/items)", "POST /v1/users and /v1/items"),
    ("llm", None, None),
])
def test_each_mode_names_its_own_state_routes_and_only_its_flags(mode, admin, state, capsys):
    assert cli.main(["serve", mode, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    if admin is None:
        assert "--admin-api-key" not in out and "--state-dir" not in out
    else:
        assert admin in out and f"keeps {state} across restarts" in out
        assert ("/v1/users" in out) == (mode == "ranking") and ("/v1/catalog" in out) == (mode == "retrieval")
    recommend_only = ("--max-include-items", "--max-history-entries", "--truncate", "--max-exclude-items")
    assert all((flag in out) == (mode == "retrieval") for flag in recommend_only), mode


@pytest.mark.parametrize("command", [["serve", "retrieval"], ["recommend"]])
def test_catalog_help_names_every_format_the_loader_reads(command, capsys):
    from grserve.catalog.io import EXTENSIONS

    assert cli.main([*command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    help_text = out[out.index("--catalog FILE item catalog"):][:300]
    assert all(re.search(re.escape(ext) + "(?![a-z])", help_text) for ext in EXTENSIONS), help_text  # .json ≠ .jsonl


@pytest.mark.parametrize("argv, expected", [
    (["serve"], ["serve", "retrieval"]),
    (["serve", "--port", "9000", "--catalog", "x"], ["serve", "retrieval", "--port", "9000", "--catalog", "x"]),
    (["serve", "--help"], ["serve", "--help"]),
    (["serve", "-h"], ["serve", "-h"]),
    (["serve", "ranking", "--port", "1"], ["serve", "ranking", "--port", "1"]),
    (["bench", "serve"], ["bench", "serve"]),
])
def test_serve_defaults_to_retrieval(argv, expected):
    assert cli._with_default_serve_mode(argv) == expected


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--port", "70000"], "--port"),
    (["serve", "ranking", "--port", "-1"], "--port"),
    (["serve", "--slo-ms", "-1"], "--slo-ms"),
    (["serve", "--beam-width", "0"], "--beam-width"),
    (["serve", "--device", "tpu"], "--device"),
    (["serve", "--num-items", "100", "--codebook-size", "4", "--depth", "3"], "--num-items"),  # a cross-field check
    (["serve", "llm", "--num-blocks", "1"], "--num-blocks"),
    (["serve", "llm", "--ttft-slo", "0"], "--ttft-slo"),
    (["serve", "llm", "--instances", "0"], "--instances"),
    (["serve", "llm", "--routing", "random"], "--routing"),
    (["bench", "cluster", "--kill-after", "2"], "--kill-after"),
    (["serve", "ranking", "--user-cache-mb", "-1"], "--user-cache-mb"),
    (["serve", "ranking", "--window-s", "0"], "--window-s"),
    (["serve", "ranking", "--instruction", "1,x"], "--instruction"),
    (["bench", "retrieval", "--beam-widths", "16,0"], "--beam-widths"),
    (["bench", "cache", "--noise", "0,2"], "--noise"),
    (["bench", "cache", "--policies", "lru,nope"], "--policies"),
    (["bench", "cache", "--traces", "zipf,nope"], "--traces"),
    (["bench", "cache", "--laru-decay", "x"], "--laru-decay"),
    (["bench", "ranking", "--systems", "bat,nope"], "--systems"),
    (["bench", "ranking", "--users", "0"], "--users"),
    (["bench", "serve", "--systems", "fcfs,nope"], "--systems"),
    (["bench", "serve", "--rates", "1,x"], "--rates"),
    (["catalog", "generate", "--out", "x.parquet"], "--out"),
    (["catalog", "generate", "--out", "x.jsonl", "--num-items", "1000", "--codebook-size", "4", "--depth", "2"],
     "--num-items"),
])
def test_bad_value_exits_2_naming_the_flag(argv, flag, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and flag in err and "Traceback" not in err


def test_usage_errors_found_after_parsing_exit_2(capsys, tmp_path):
    assert cli.main(["serve", "llm", "--model", "no-such-preset"]) == 2
    assert capsys.readouterr().err.startswith("grserve: error: unknown model 'no-such-preset'")
    assert cli.main(["serve", "ranking", "--model", str(tmp_path / "none")]) == 2
    assert cli.main(["catalog", "generate", "--out", str(tmp_path / "no" / "x.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_missing_trace_file_is_one_line_naming_it_and_where_to_get_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no parent holds shared/traces/
    missing = str(tmp_path / "none.jsonl")
    assert cli.main(["bench", "cluster", "--trace", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and missing in err and "github.com/kvcache-ai/Mooncake" in err
    assert cli.main(["bench", "cluster"]) == 2  # the default, ../shared/traces/..., is not there either
    assert "Mooncake" in capsys.readouterr().err
    assert cli.main(["bench", "cache", "--trace-file", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and missing in err and "github.com/kvcache-ai/Mooncake" in err


def test_the_gpu_bench_without_a_gpu_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cli.main(["bench", "retrieval", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err


# every flag these commands had before they were generated from dataclasses (tests and docs use them)
OLD_FLAGS = {
    ("serve", "retrieval"): "--model --device --dtype --seed --catalog --num-items --depth --codebook-size "
                            "--beam-width --token-capacity --slo-ms --host --port --log-level",
    ("serve", "ranking"): "--host --port --model --dtype --seed --policy --user-cache-mb --page-size --window-s "
                          "--items-file --users-file --instruction --num-items --num-users --scale --max-candidates "
                          "--max-profile-tokens --max-batch-requests --log-level",
    ("serve", "llm"): "--model --served-model-name --dtype --device --seed --scheduler --num-blocks --block-size "
                      "--ttft-slo --tbt-slo --rho --token-budget --max-batched-tokens --max-num-seqs "
                      "--prefix-cache-tokens --prefix-cache-policy --host --port --log-level",
    ("bench", "retrieval"): "--model --device --dtype --prompt-len --beam-widths --headline-bw --num-items "
                            "--codebook-size --depth --requests --batch --hf-requests --naive-requests --top-n "
                            "--scoring --skip-hf --skip-naive --seed",
    ("bench", "cache"): "--traces --noise --policies --no-learned --quick --out-dir --laru-decay --async-batch --seed",
    ("bench", "ranking"): "--model --dtype --scale --full-scale --users --items --threads --user-cache-frac "
                          "--user-cache-mb --window-s --batch --page-size --systems --kv-workers --alpha --link-gbps "
                          "--hrcs-prefill-s --hrcs-kv-bytes-per-token --instances --seed",
    ("bench", "serve"): "--quick --simulate --dataset --systems --model --num-requests --rates --refine --cv --scale "
                        "--mem-requests --ttft-mult --tbt-mult --block-size --no-decode-bench --decode-only "
                        "--prefix-only --decode-repeats --threads --seed --out-dir",
    ("catalog", "generate"): "--out --num-items --depth --codebook-size --seed",
}


@pytest.mark.parametrize("path", sorted(OLD_FLAGS), ids=" ".join)
def test_every_old_flag_name_still_parses(path):
    missing = set(OLD_FLAGS[path].split()) - _flags(LEAVES[path])
    assert not missing, missing


def _configs_of(argv: list[str], module, monkeypatch) -> object:
    seen = []
    monkeypatch.setattr(module, "run", lambda cfg: seen.append(cfg) or 0)
    assert cli.main(argv) == 0
    return seen[0]


def test_no_flags_means_the_dataclass_defaults(monkeypatch):
    """Defaults live in one place: a command given no flags runs on its config class's defaults."""
    import grserve_bench.cache as cache
    import grserve_bench.ranking as ranking
    import grserve_bench.retrieval as retrieval
    import grserve_bench.serve as serve

    assert _configs_of(["bench", "retrieval"], retrieval, monkeypatch) == RetrievalBenchConfig()
    assert _configs_of(["bench", "cache"], cache, monkeypatch) == CacheBenchConfig()
    assert _configs_of(["bench", "ranking"], ranking, monkeypatch) == RankingBenchConfig()
    assert _configs_of(["bench", "serve"], serve, monkeypatch) == ServeBenchConfig()
    assert _configs_of(["serve"], retrieval_main, monkeypatch) == ServeConfig()
    assert _configs_of(["serve", "ranking"], ranking_main, monkeypatch) == RankingServeConfig()
    assert _configs_of(["serve", "llm"], llm_main, monkeypatch) == LLMServeConfig()


def test_flags_reach_the_configs(monkeypatch):
    import grserve_bench.cache as cache
    import grserve_bench.serve as serve

    cfg = _configs_of(["serve", "--port", "9000", "--seed", "3", "--beam-width", "600", "--max-waiting", "9"],
                      retrieval_main, monkeypatch)
    assert cfg.server.port == 9000 and cfg.model.seed == cfg.catalog.seed == 3 and cfg.edge.max_waiting == 9
    assert cfg.search.beam_width == cfg.search.max_beam_width == 600  # raised to the default beam width
    cfg = _configs_of(["serve", "llm", "--model", "tiny", "--num-blocks", "64", "--port", "0", "--rho", "0.5"],
                      llm_main, monkeypatch)
    assert (cfg.model.source, cfg.llm.num_blocks, cfg.server.port, cfg.llm.rho) == ("tiny", 64, 0, 0.5)
    cfg = _configs_of(["serve", "llm", "qwen3-0.6b", "--port", "0", "--max-n", "3"], llm_main, monkeypatch)
    assert (cfg.model.source, cfg.api.max_n) == ("qwen3-0.6b", 3)  # the model positionally, as `vllm serve MODEL`
    assert not _configs_of(["bench", "cache", "--no-learned", "--quick"], cache, monkeypatch).learned
    cfg = _configs_of(["bench", "serve", "--no-decode-bench", "--rates", "1,2"], serve, monkeypatch)
    assert not cfg.decode_bench and cfg.rates == "1,2"


def test_ctrl_c_exits_130(monkeypatch):
    import grserve_bench.cache as cache

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "run", interrupted)
    assert cli.main(["bench", "cache"]) == 130


# ---- the product and the lab --------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_bench_is_declared_as_the_labs_entry_point():
    declared = _pyproject()["project"]["entry-points"][cli.COMMANDS_GROUP]
    assert declared == {"bench": "grserve_bench.cli:register"}
    from grserve_bench.cli import register

    assert EntryPoint("bench", declared["bench"], cli.COMMANDS_GROUP).load() is register


def test_setuptools_finds_both_packages():
    from setuptools import find_packages

    found = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    packages = set(find_packages(str(ROOT / found["where"][0]), include=found.get("include", ("*",))))
    assert {"grserve", "grserve.eviction", "grserve_bench", "grserve_bench.eviction"} <= packages


def test_a_fresh_install_of_this_tree_registers_the_lab():
    """What `make install` gives (CI: a clean clone, `make test`): the installed entry points are the declared ones."""
    dist = distribution("grserve")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url.removeprefix("file://").rstrip("/") != str(ROOT):
        pytest.skip(f"grserve is installed from {url or 'a wheel'}, not from this tree")
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == cli.COMMANDS_GROUP}
    assert installed == _pyproject()["project"]["entry-points"][cli.COMMANDS_GROUP]


def test_installed_commands_come_from_the_entry_point_group(monkeypatch):
    """Every loadable entry point of the group becomes a command; one whose module is gone is left out."""
    import importlib.metadata

    def register(sub):
        p = sub.add_parser("hello")
        p.set_defaults(handler=lambda ns: 7)

    monkeypatch.setattr(sys.modules[__name__], "_hello_register", register, raising=False)
    eps = [EntryPoint("hello", f"{__name__}:_hello_register", cli.COMMANDS_GROUP),
           EntryPoint("gone", "no_such_module_anywhere:register", cli.COMMANDS_GROUP)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [e for e in eps if e.group == group])
    found = inspect.unwrap(cli.installed_commands)()  # grserve's own (tests/conftest.py may wrap it)
    assert list(found) == ["hello"] and found["hello"] is register
    assert cli.main(["hello"], found) == 7


@pytest.mark.parametrize("argv", [["bench"], ["bench", "retrieval", "--iters", "1"], ["bench", "cache", "--help"]])
def test_without_the_lab_bench_says_in_one_line_how_to_get_it(argv, capsys):
    assert cli.main(argv, commands={}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grserve: error: grserve bench: ")
    assert "grserve_bench" in err and "pip install -e ." in err
    assert cli.main(["--help"], commands={}) == 0
    out = capsys.readouterr().out
    assert "serve" in out and "bench" in out and "catalog" in out


def test_the_product_never_imports_the_lab():
    """No module of grserve names grserve_bench in an import; the whole command line builds without loading it."""
    for path in (ROOT / "src" / "grserve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "grserve_bench" for n in names), (path, ast.unparse(node))
    code = ("import sys; from grserve import cli; cli.build_parser({}); "
            "assert not any(m.startswith('grserve_bench') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
