"""The machine a benchmark's numbers were measured on: the ``"machine"`` field of every JSON line (CPU model, ISA,
whether bf16 is fast; ``grserve.model.cpu_support``). Imported lazily, so ``grserve bench ... --help`` stays
torch-free."""

from __future__ import annotations


def machine_info() -> dict:
    from grserve.model.cpu_support import cpu_support

    return cpu_support().to_dict()
