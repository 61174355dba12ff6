"""What the three ``grserve serve`` commands check before anything heavy is built: that the model argument names a
preset or an existing directory, and that a requested CUDA device exists. Each failure is a
:class:`~grserve.flags.UsageError` (one line on stderr, exit 2)."""

from __future__ import annotations

import os

from grserve.config import ModelConfig
from grserve.flags import UsageError


def check_model(model: ModelConfig) -> None:
    from grserve.model.spec import PRESETS

    if not os.path.isdir(os.path.expanduser(model.source)) and model.source not in PRESETS:
        raise UsageError(f"unknown model {model.source!r}: not a preset ({', '.join(sorted(PRESETS))}) "
                         "and not an existing directory")
    if model.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {model.device}: no CUDA device is available (use --device cpu)")
