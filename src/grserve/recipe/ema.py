"""An exponential moving average of a model's weights (Polyak averaging), the weights a run validates and keeps.

After every optimiser step ``update`` blends the weights into the average with decay ``min(decay, (1+n)/(10+n))``
(n = updates so far: the early average follows the weights closely instead of remembering the random init).
``swapped(model)`` puts the average into the model for a block (validation, saving) and restores the raw weights
after, so training continues from them. Tied weights appear twice in a state dict; both copies get the same
updates, so the average stays tied.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(d).add_(v, alpha=1.0 - d)

    @contextmanager
    def swapped(self, model: nn.Module):
        raw = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.shadow)
        try:
            yield model
        finally:
            model.load_state_dict(raw)
