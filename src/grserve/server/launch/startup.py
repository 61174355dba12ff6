"""What the three ``grserve serve`` commands check before anything heavy is built: that the model argument names a
preset or an existing directory, and that a requested CUDA device exists. Each failure is a
:class:`~grserve.flags.UsageError` (one line on stderr, exit 2)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from grserve.config import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    CatalogReloadConfig,
    EdgeConfig,
    ModelConfig,
)
from grserve.flags import ConfigError, UsageError, add_flags, from_args


# ServerConfig flags only /v1/recommend reads (the LLM and ranking servers leave them out of their --help)
RECOMMEND_ONLY = ("max_prompt_tokens", "max_top_n", "max_exclude_items", "max_include_items", "max_history_entries",
                  "truncate")

# ClusterConfig flags of the LLM cluster that retrieval/ranking instances have no use for (no prefix blocks, no
# decode phase, no KV snapshots: a request is recomputed when its instance dies)
GR_CLUSTER_SKIP = ("kv_block_size", "decode_weight", "kv_snapshot")


def add_edge_flags(parser: argparse.ArgumentParser, admin_routes: str | None, reload: bool = False) -> None:
    """The API-edge flags every server shares (``EdgeConfig``), plus catalog reload (retrieval). ``admin_routes``:
    the mode's routes that change state, named in ``--admin-api-key``'s help (None: the mode has none, no flag)."""
    add_flags(parser, EdgeConfig, title="security and limits (docs/security.md)",
              skip=() if admin_routes else ("admin_api_key",))
    if admin_routes:
        reword(parser, "admin_api_key", f"the key of the routes that change state ({admin_routes}); default: "
                                        f"${ADMIN_API_KEY_ENV}; unset: those routes are off (403)")
    if reload:
        add_flags(parser, CatalogReloadConfig, title="catalog reload (POST /v1/catalog)")


def add_state_flags(parser: argparse.ArgumentParser, state: Any, writes: str) -> None:
    """``--state-dir``, its help naming what this mode keeps (``writes``)."""
    add_flags(parser, state, title="state across restarts (docs/security.md)")
    reword(parser, "state_dir", f"directory of the SQLite store that keeps {writes} across restarts and kills, "
                                "one server per directory (created if missing; unset: memory only, a restart "
                                "loses them)")


def reword(parser: argparse.ArgumentParser, dest: str, help: str) -> None:
    """Say what a shared flag means in this mode (its ``--help`` line)."""
    for action in parser._actions:
        if action.dest == dest:
            action.help = help
            return
    raise KeyError(dest)


def edge_from_args(ns: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> EdgeConfig:
    """``EdgeConfig`` from the flags; a key not given on the command line comes from ``$GRSERVE_API_KEY`` /
    ``$GRSERVE_ADMIN_API_KEY`` (preferred: a command line is visible to every local user in ``ps``). A variable
    that is set but empty is an error, not "no authentication" (fail closed)."""
    keys = {}
    for name, env in (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_API_KEY_ENV)):
        value = getattr(ns, name, None)
        keys[name] = value if value is not None else environ.get(env)
    try:
        return from_args(EdgeConfig, ns, **keys)
    except ConfigError as exc:
        if getattr(ns, exc.field, None) is None and exc.field in ("api_key", "admin_api_key"):
            env = API_KEY_ENV if exc.field == "api_key" else ADMIN_API_KEY_ENV
            raise UsageError(f"${env}: {str(exc).partition(': ')[2]}") from None
        raise


def check_catalog_dir(reload: CatalogReloadConfig) -> None:
    if reload.catalog_dir is not None and not os.path.isdir(reload.catalog_dir):
        raise UsageError(f"--catalog-dir {reload.catalog_dir}: not a directory")


def check_model(model: ModelConfig) -> None:
    from grserve.model.spec import PRESETS

    if not os.path.isdir(os.path.expanduser(model.source)) and model.source not in PRESETS:
        raise UsageError(f"unknown model {model.source!r}: not a preset ({', '.join(sorted(PRESETS))}) "
                         "and not an existing directory")
    if model.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {model.device}: no CUDA device is available (use --device cpu)")
    if model.quantization != "none":  # refused here, in the front end, not in a dying engine process
        from grserve.model.quantized_linear import check_config

        check_config(model)
