"""Bipartite Attention prompt layouts (BAT §4): user-as-prefix (UP) and item-as-prefix (IP).

Every layout is three parts, in this order:

- ``head``: causal over itself, positions ``0 .. n_head-1``. UP: the user profile 𝒰. IP: the fixed notation
  tokens (e.g. "Candidate items:"), usually empty.
- ``items``: the N candidates. Item i sees the whole head and itself (causal), **never another item**, and every
  item starts at the same position ``item_start = n_head`` (n_u in UP; 0 or after the notation in IP). Each
  item's token list ends with its identifier token v_i.
- ``tail``: sees the head, every item and itself (causal); positions start after the longest item,
  ``tail_start = item_start + max_i n_i``, contiguous. UP: the instruction tokens. IP: 𝒰 then the instruction.

Consequences (tested in ``tests/grserve/ranking/test_ranking_layouts.py``): in IP an item's K/V depend only on its own tokens and
the fixed notation, so they are precomputable once per item; in UP the head's K/V depend only on the user; and
the last token's output is invariant to the order of the candidates in both layouts.

``visibility()`` is the explicit boolean mask used by the reference path; the fast path in
``grserve.attention.bipartite`` realises the same visibility from the three-part structure without a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

USER_PREFIX = "user_prefix"
ITEM_PREFIX = "item_prefix"
LAYOUTS = (USER_PREFIX, ITEM_PREFIX)

_EMPTY = np.zeros(0, dtype=np.int64)


def _tokens(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class BipartitePrompt:
    layout: str  # USER_PREFIX | ITEM_PREFIX
    head: np.ndarray  # int64 [n_head]
    items: tuple[np.ndarray, ...]  # N int64 arrays, each [n_i >= 1]
    tail: np.ndarray  # int64 [n_tail >= 1]; its last token is the discriminant token

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {LAYOUTS}")
        if not self.items:
            raise ValueError("a ranking prompt needs at least one candidate item")
        if any(len(t) == 0 for t in self.items):
            raise ValueError("every candidate item needs at least one token (its identifier token)")
        if len(self.tail) == 0:
            raise ValueError("the tail (instruction tokens) must not be empty: its last token is the discriminant")

    # ---- sizes and positions ------------------------------------------------------------------------------
    @property
    def item_start(self) -> int:
        return int(len(self.head))

    @property
    def max_item_len(self) -> int:
        return max(len(t) for t in self.items)

    @property
    def tail_start(self) -> int:
        return self.item_start + self.max_item_len

    @property
    def item_lengths(self) -> list[int]:
        return [len(t) for t in self.items]

    @property
    def num_tokens(self) -> int:
        return len(self.head) + sum(self.item_lengths) + len(self.tail)

    @property
    def identifier_tokens(self) -> np.ndarray:
        return np.asarray([int(t[-1]) for t in self.items], dtype=np.int64)

    def head_positions(self) -> np.ndarray:
        return np.arange(len(self.head), dtype=np.int64)

    def item_positions(self, i: int) -> np.ndarray:
        return np.arange(self.item_start, self.item_start + len(self.items[i]), dtype=np.int64)

    def tail_positions(self) -> np.ndarray:
        return np.arange(self.tail_start, self.tail_start + len(self.tail), dtype=np.int64)

    # ---- the flat sequence (reference path) ---------------------------------------------------------------
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.head, *self.items, self.tail])

    def positions(self) -> np.ndarray:
        return np.concatenate([self.head_positions(), *(self.item_positions(i) for i in range(len(self.items))),
                               self.tail_positions()])

    def segment_ids(self) -> np.ndarray:
        """Per token: -1 head, i for item i, N for the tail."""
        n = len(self.items)
        parts = [np.full(len(self.head), -1)] + [np.full(len(t), i) for i, t in enumerate(self.items)]
        parts.append(np.full(len(self.tail), n))
        return np.concatenate(parts).astype(np.int64)

    def visibility(self) -> np.ndarray:
        """allowed[q, k] (bool [T, T]): the Bipartite Attention mask over the flat sequence."""
        seg = self.segment_ids()
        n = len(self.items)
        idx = np.arange(len(seg))
        same = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
        q_item = (seg >= 0) & (seg < n)
        q_tail = seg == n
        k_head = seg == -1
        k_item = (seg >= 0) & (seg < n)
        return same | ((q_item | q_tail)[:, None] & k_head[None, :]) | (q_tail[:, None] & k_item[None, :])


def build_prompt(layout: str, user: np.ndarray, items: list[np.ndarray] | tuple[np.ndarray, ...],
                 instruction: np.ndarray, notation: np.ndarray | None = None) -> BipartitePrompt:
    """Lay out one ranking request. ``notation`` (IP only) is the fixed shared head, e.g. "Candidate items:"."""
    user, instruction = _tokens(user), _tokens(instruction)
    items_t = tuple(_tokens(t) for t in items)
    if layout == USER_PREFIX:
        return BipartitePrompt(USER_PREFIX, user, items_t, instruction)
    if layout == ITEM_PREFIX:
        head = _EMPTY if notation is None else _tokens(notation)
        return BipartitePrompt(ITEM_PREFIX, head, items_t, np.concatenate([user, instruction]))
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
