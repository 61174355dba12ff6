"""Sampling parameters and the sampler: greedy (temperature 0), temperature, top-p, per-request seed.

A request with a seed owns a ``torch.Generator`` seeded once, so its samples do not depend on which other
requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass
class SamplerState:
    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    def __post_init__(self) -> None:
        if self.params.temperature > 0:
            self.generator = torch.Generator()
            seed = self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            self.generator.manual_seed(seed)


def sample(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    """logits [B, V] (one row per request, fp32 or lower) → one token id per row."""
    out = logits.argmax(dim=-1).tolist()
    for i, st in enumerate(states):
        p = st.params
        if p.temperature == 0:
            continue
        probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sp, idx = probs.sort(descending=True)
            keep = (sp.cumsum(0) - sp) < p.top_p  # always keeps the top token
            sp = sp * keep
            out[i] = int(idx[torch.multinomial(sp / sp.sum(), 1, generator=st.generator)].item())
        else:
            out[i] = int(torch.multinomial(probs, 1, generator=st.generator).item())
    return out
