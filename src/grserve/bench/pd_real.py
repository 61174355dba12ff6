"""Part 'real' of ``grserve bench pd`` (bench/pd.py). Not written yet."""

from __future__ import annotations

from dataclasses import dataclass

from grserve.flags import Checked


@dataclass(frozen=True)
class PartConfig(Checked):
    """The flags of this part (none yet)."""


def run_part(cfg: PartConfig) -> dict:
    """Run this part; return its keys for the JSON line."""
    return {}
