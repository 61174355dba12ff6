"""How semantic IDs map onto model vocabulary tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SidLayout:
    """SID token layout: token(level l, code c) = token_offset + sum(codebook_sizes[:l]) + c."""

    depth: int
    codebook_sizes: tuple[int, ...]
    token_offset: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "codebook_sizes", tuple(int(c) for c in self.codebook_sizes))
        if int(self.depth) < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if len(self.codebook_sizes) != self.depth:
            raise ValueError(f"codebook_sizes has {len(self.codebook_sizes)} levels, depth is {self.depth}")
        if any(c < 1 for c in self.codebook_sizes):
            raise ValueError(f"codebook sizes must be >= 1, got {self.codebook_sizes}")
        if int(self.token_offset) < 0:
            raise ValueError(f"token_offset must be >= 0, got {self.token_offset}")
        starts = self.token_offset + np.concatenate([[0], np.cumsum(self.codebook_sizes)[:-1]])
        object.__setattr__(self, "_starts", starts.astype(np.int64))

    def level_range(self, level: int) -> tuple[int, int]:
        """Token ids [start, end) of one level."""
        if not 0 <= level < self.depth:
            raise ValueError(f"level {level} out of range for depth {self.depth}")
        start = int(self._starts[level])
        return start, start + self.codebook_sizes[level]

    @property
    def num_tokens(self) -> int:
        """One past the last SID token id."""
        return self.token_offset + sum(self.codebook_sizes)

    def sids_to_tokens(self, sids: np.ndarray) -> np.ndarray:
        """[n, depth] codes -> flat int64 tokens, item after item."""
        sids = np.asarray(sids, dtype=np.int64).reshape(-1, self.depth)
        return (sids + self._starts).reshape(-1)

    def tokens_to_sids(self, tokens: np.ndarray) -> np.ndarray:
        """Flat tokens -> [n, depth] codes; ValueError on partial items or a token at the wrong level."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size % self.depth:
            raise ValueError(f"{tokens.size} tokens is not a whole number of {self.depth}-token items")
        codes = tokens.reshape(-1, self.depth) - self._starts
        bad = (codes < 0) | (codes >= np.asarray(self.codebook_sizes))
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            lo, hi = self.level_range(i % self.depth)
            raise ValueError(f"token {int(tokens[i])} at position {i} is not a level-{i % self.depth} token [{lo}, {hi})")
        return codes

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if the SID tokens do not fit in a vocabulary of vocab_size."""
        if self.num_tokens > vocab_size:
            raise ValueError(f"SID layout needs {self.num_tokens} tokens (offset {self.token_offset} + "
                             f"{sum(self.codebook_sizes)} codes) but the model vocab has {vocab_size}")
