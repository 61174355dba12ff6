"""How semantic IDs map onto model vocabulary tokens: one interface, two layouts.

* **arithmetic** (models grserve trains): token(level l, code c) = ``token_offset + sum(codebook_sizes[:l]) + c``;
* **tokenizer-native** (published GR checkpoints: each level's codes are added tokens of the model's tokenizer,
  ``<s_a_12>`` or ``<a_47>``): token(l, c) = ``level_tokens[l][c]``, any ids, neither contiguous nor ordered, −1 for
  a code no item uses and the tokenizer lacks. ``sid_begin`` / ``sid_end`` optionally wrap an item's tokens in a
  prompt (``<|sid_begin|> … <|sid_end|>``); the beam search itself only ever emits the level tokens.

Everything downstream works on a level's token-id set: ``head_rows(level)`` is either a contiguous ``(start, end)``
range of LM-head rows (the arithmetic layout, and any level whose ids happen to be contiguous and ascending) or the
level's ids to gather (``search/level_heads.py``). Codes, tries and masks stay in code space.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class SidLayout:
    """SID token layout of ``depth`` levels with ``codebook_sizes`` codes each (see the module docstring).

    ``level_tokens`` None: the arithmetic layout from ``token_offset``. Else one int64 array per level, of length
    ``codebook_sizes[l]``: the token id of each code (−1: the code has no token; no catalog item may use it)."""

    depth: int
    codebook_sizes: tuple[int, ...]
    token_offset: int = 16
    level_tokens: tuple[np.ndarray, ...] | None = None
    sid_begin: int | None = None
    sid_end: int | None = None
    _starts: np.ndarray = field(init=False, repr=False)
    _ranges: tuple = field(init=False, repr=False)

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
        if self.level_tokens is None:
            ranges = tuple((int(s), int(s) + c) for s, c in zip(starts, self.codebook_sizes))
        else:
            ranges = self._check_level_tokens()
        object.__setattr__(self, "_ranges", ranges)
        for name in ("sid_begin", "sid_end"):
            v = getattr(self, name)
            if v is not None and int(v) < 0:
                raise ValueError(f"{name} must be a token id >= 0, got {v}")

    def _check_level_tokens(self) -> tuple:
        """Validate ``level_tokens``; the contiguous (start, end) range of each level whose ids are exactly
        start, start+1, … (None for the others)."""
        if len(self.level_tokens) != self.depth:
            raise ValueError(f"level_tokens has {len(self.level_tokens)} levels, depth is {self.depth}")
        tables, ranges = [], []
        for level, (ids, c) in enumerate(zip(self.level_tokens, self.codebook_sizes)):
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            if ids.size != c:
                raise ValueError(f"level {level} has {ids.size} token ids for {c} codes")
            if (ids < -1).any():
                raise ValueError(f"level {level}: token ids must be >= 0 (or -1 for a code without a token)")
            if not (ids >= 0).any():
                raise ValueError(f"level {level}: no code has a token")
            ids.setflags(write=False)
            tables.append(ids)
            contiguous = ids[0] >= 0 and bool((np.diff(ids) == 1).all())
            ranges.append((int(ids[0]), int(ids[0]) + c) if contiguous else None)
        object.__setattr__(self, "level_tokens", tuple(tables))
        return tuple(ranges)

    # ---- identity -------------------------------------------------------------------------------------------
    @property
    def is_arithmetic(self) -> bool:
        return self.level_tokens is None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SidLayout):
            return NotImplemented
        if (self.depth, self.codebook_sizes, self.sid_begin, self.sid_end) != \
                (other.depth, other.codebook_sizes, other.sid_begin, other.sid_end):
            return False
        if self.is_arithmetic or other.is_arithmetic:
            return self.is_arithmetic and other.is_arithmetic and self.token_offset == other.token_offset
        return all(np.array_equal(a, b) for a, b in zip(self.level_tokens, other.level_tokens))

    def __hash__(self) -> int:
        return hash((self.depth, self.codebook_sizes, self.token_offset, self.sid_begin, self.sid_end))

    def describe(self) -> str:
        """One line for start-up messages."""
        if self.is_arithmetic:
            return f"arithmetic SID tokens from id {self.token_offset} (codebooks {list(self.codebook_sizes)})"
        spans = []
        for level in range(self.depth):
            ids = self.level_tokens[level][self.level_tokens[level] >= 0]
            kind = "contiguous" if self._ranges[level] is not None else "gathered"
            spans.append(f"L{level}: {ids.size} ids in [{int(ids.min())}, {int(ids.max())}] ({kind})")
        wrap = f", wrapped by ids {self.sid_begin}/{self.sid_end}" if self.sid_begin is not None else ""
        return "tokenizer SID tokens: " + "; ".join(spans) + wrap

    # ---- per level ------------------------------------------------------------------------------------------
    def head_rows(self, level: int) -> tuple[int, int] | np.ndarray:
        """The LM-head rows of a level in code order: a contiguous ``(start, end)`` range, or the level's token
        ids (int64 [C_l]; a code without a token maps to the level's first token — the masks never let it win)."""
        self._check_level(level)
        rng = self._ranges[level]
        if rng is not None:
            return rng
        ids = self.level_tokens[level]
        return np.where(ids >= 0, ids, ids[ids >= 0][0])

    def level_range(self, level: int) -> tuple[int, int]:
        """Token ids [start, end) of a level whose ids are contiguous (the arithmetic layout always is)."""
        rows = self.head_rows(level)
        if not isinstance(rows, tuple):
            raise ValueError(f"level {level}'s SID tokens are not a contiguous id range (use head_rows)")
        return rows

    def code_tokens(self, level: int) -> np.ndarray:
        """Token id of every code of a level (int64 [C_l], −1 where a code has no token)."""
        self._check_level(level)
        if self.level_tokens is not None:
            return self.level_tokens[level]
        a, b = self._ranges[level]
        return np.arange(a, b, dtype=np.int64)

    def _check_level(self, level: int) -> None:
        if not 0 <= level < self.depth:
            raise ValueError(f"level {level} out of range for depth {self.depth}")

    # ---- whole SIDs ----------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """One past the largest token id the layout uses (SID tokens and the wrappers)."""
        if self.level_tokens is None:
            top = self.token_offset + sum(self.codebook_sizes)
        else:
            top = max(int(t.max()) for t in self.level_tokens) + 1
        wrappers = [w + 1 for w in (self.sid_begin, self.sid_end) if w is not None]
        return max([top, *wrappers])

    def sids_to_tokens(self, sids: np.ndarray) -> np.ndarray:
        """[n, depth] codes -> flat int64 SID tokens, item after item (no wrappers)."""
        sids = np.asarray(sids, dtype=np.int64).reshape(-1, self.depth)
        if self.level_tokens is None:
            return (sids + self._starts).reshape(-1)
        out = np.empty(sids.shape, dtype=np.int64)
        for level in range(self.depth):
            out[:, level] = self.level_tokens[level][sids[:, level]]
        if (out < 0).any():
            r, level = np.argwhere(out < 0)[0]
            raise ValueError(f"code {int(sids[r, level])} at level {level} has no token in this layout")
        return out.reshape(-1)

    def items_to_tokens(self, sids: np.ndarray) -> np.ndarray:
        """[n, depth] codes -> flat tokens of n items as a prompt writes them: ``sid_begin`` SID ``sid_end`` each
        (the wrappers the layout has)."""
        sids = np.asarray(sids, dtype=np.int64).reshape(-1, self.depth)
        body = self.sids_to_tokens(sids).reshape(-1, self.depth)
        cols = ([np.full((body.shape[0], 1), self.sid_begin)] if self.sid_begin is not None else []) + [body] + \
            ([np.full((body.shape[0], 1), self.sid_end)] if self.sid_end is not None else [])
        return np.concatenate(cols, axis=1).astype(np.int64).reshape(-1)

    def tokens_to_sids(self, tokens: np.ndarray) -> np.ndarray:
        """Flat SID tokens -> [n, depth] codes; ValueError on partial items or a token at the wrong level."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size % self.depth:
            raise ValueError(f"{tokens.size} tokens is not a whole number of {self.depth}-token items")
        grid = tokens.reshape(-1, self.depth)
        codes = np.empty_like(grid)
        for level in range(self.depth):
            codes[:, level] = self.codes_of(level, grid[:, level])
        bad = codes < 0
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            raise ValueError(f"token {int(tokens[i])} at position {i} is not a level-{i % self.depth} SID token"
                             + (f" [{self._ranges[i % self.depth][0]}, {self._ranges[i % self.depth][1]})"
                                if self._ranges[i % self.depth] is not None else ""))
        return codes

    def codes_of(self, level: int, tokens: np.ndarray) -> np.ndarray:
        """Code of each token (int64 array) at a level, −1 where the token is not one of the level's."""
        ids = self.code_tokens(level)
        order = np.argsort(ids, kind="stable")
        pos = np.minimum(np.searchsorted(ids[order], tokens), ids.size - 1)
        code = order[pos]
        return np.where((ids[code] == tokens) & (tokens >= 0), code, -1)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if the SID tokens do not fit in a vocabulary of vocab_size."""
        if self.num_tokens > vocab_size:
            what = (f"offset {self.token_offset} + {sum(self.codebook_sizes)} codes" if self.is_arithmetic
                    else f"its largest token id is {self.num_tokens - 1}")
            raise ValueError(f"SID layout needs {self.num_tokens} tokens ({what}) but the model vocab has "
                             f"{vocab_size}")
