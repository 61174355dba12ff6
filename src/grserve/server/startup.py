"""What the three ``grserve serve`` commands check before anything heavy is built: that the model argument names a
preset or an existing directory, and that a requested CUDA device exists. Each failure is a
:class:`~grserve.flags.UsageError` (one line on stderr, exit 2)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from grserve.config import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    CatalogReloadConfig,
    EdgeConfig,
    ModelConfig,
)
from grserve.flags import ConfigError, UsageError, add_flags, from_args


def add_edge_flags(parser: argparse.ArgumentParser, reload: bool = False) -> None:
    """The API-edge flags every server shares (``EdgeConfig``), plus catalog reload (retrieval)."""
    add_flags(parser, EdgeConfig, title="security and limits (docs/security.md)")
    if reload:
        add_flags(parser, CatalogReloadConfig, title="catalog reload (POST /v1/catalog)")


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
