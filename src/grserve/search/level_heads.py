"""The per-level LM head of a SID layout on the device: which vocabulary rows a level's logits come from, and which
token each chosen code feeds back to the model.

A level's logits are computed over its codes only, in code order (column c = code c), so masks, tries and the beam
state stay in code space whatever the token ids are. For a level whose token ids are a contiguous ascending range
(the arithmetic layout, and e.g. OneRec's ``<s_a_0>`` … ``<s_a_8191>`` added in order) the head is a slice of the
LM-head weight and the next token is code + start: exactly the arithmetic path. Any other id set (MiniOneRec's
``<a_N>`` tokens added in order of first use) is a gather of the level's rows and of its code → token table.
"""

from __future__ import annotations

import torch

from grserve.catalog.layout import SidLayout


class LevelHeads:
    """``rows[l]``: ``(start, end)`` or an int64 device tensor of token ids [C_l] (``Decoder.logits``' rows);
    ``to_tokens(l, codes, out)``: the token id of each code, written into ``out`` (no allocation)."""

    def __init__(self, layout: SidLayout, device: torch.device | str):
        self.rows: list[tuple[int, int] | torch.Tensor] = []
        self._start: list[torch.Tensor | None] = []  # 0-dim (a Python scalar operand allocates a wrapper per call)
        self._table: list[torch.Tensor | None] = []
        for level in range(layout.depth):
            rows = layout.head_rows(level)
            if isinstance(rows, tuple):
                self.rows.append(rows)
                self._start.append(torch.tensor(rows[0], dtype=torch.int64, device=device))
                self._table.append(None)
            else:
                ids = torch.as_tensor(rows, dtype=torch.int64).to(device)
                self.rows.append(ids)
                self._start.append(None)
                self._table.append(ids)

    def to_tokens(self, level: int, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        start = self._start[level]
        if start is not None:
            return torch.add(codes, start, out=out)
        return torch.index_select(self._table[level], 0, codes, out=out)


def level_heads(layout: SidLayout, device: torch.device | str) -> LevelHeads:
    """The layout's ``LevelHeads`` on ``device``, built once per (layout, device) and kept on the layout."""
    cache = layout.__dict__.setdefault("_level_heads", {})
    key = str(torch.device(device))
    heads = cache.get(key)
    if heads is None:
        heads = cache[key] = LevelHeads(layout, device)
    return heads
