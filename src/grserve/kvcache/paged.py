"""A small paged KV block store: one logical entry per key (a user or an item), physically fixed-size pages.

BAT §5.1: "KV entries are stored at user/item granularity: all prefix tokens of a given user or item form one
logical entry that is physically organized into fixed-size pages compatible with PagedAttention". The page pool
is preallocated once (``[num_pages, L, 2, page_size, Hkv, D]``); an entry owns ``ceil(n / page_size)`` pages and
its length. Reads gather pages with one ``index_select`` (``get_concat`` gathers many entries at once).
Sizes are accounted in whole pages (what the memory really holds).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence

import torch


class PagedKVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_pages: int, page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_pages < 0 or page_size < 1:
            raise ValueError(f"num_pages must be >= 0 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size = page_size
        self.pages = torch.empty(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim, dtype=dtype,
                                 device=device)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._entries: dict[Hashable, tuple[torch.Tensor, int]] = {}  # key → (page ids, tokens)
        self._lock = threading.RLock()

    @classmethod
    def with_capacity_bytes(cls, capacity_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, *,
                            page_size: int = 16, dtype: torch.dtype = torch.float32, device="cpu") -> "PagedKVStore":
        per_page = 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        return cls(num_layers, num_kv_heads, head_dim, num_pages=int(capacity_bytes // per_page),
                   page_size=page_size, dtype=dtype, device=device)

    # ---- sizes --------------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[0])

    @property
    def bytes_per_page(self) -> int:
        return self.pages[0].numel() * self.pages.element_size() if self.num_pages else \
            2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self.pages.element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_page // self.page_size

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.bytes_per_page

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def entry_pages(self, key: Hashable) -> int:
        return int(self._entries[key][0].numel())

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def length(self, key: Hashable) -> int:
        return self._entries[key][1]

    def grow(self, num_pages: int) -> None:
        """``num_pages`` more pages (a new pool holding the old one's pages; entries keep their page ids)."""
        with self._lock:
            old = self.pages
            self.pages = old.new_empty(old.shape[0] + num_pages, *old.shape[1:])
            self.pages[:old.shape[0]] = old
            self._free[:0] = range(self.pages.shape[0] - 1, old.shape[0] - 1, -1)

    # ---- writes -------------------------------------------------------------------------------------------
    def put(self, key: Hashable, kv: torch.Tensor) -> bool:
        """Store kv [L, 2, n, Hkv, D] under key (replacing it). False (nothing stored) when pages run out."""
        n = int(kv.shape[2])
        need = self.pages_for(n)
        with self._lock:
            if key in self._entries:
                self.remove(key)
            if need > len(self._free):
                return False
            ids = [self._free.pop() for _ in range(need)]
        pad = need * self.page_size - n
        if pad:
            kv = torch.cat([kv, kv.new_zeros(kv.shape[0], 2, pad, *kv.shape[3:])], dim=2)
        blocks = kv.reshape(kv.shape[0], 2, need, self.page_size, *kv.shape[3:]).permute(2, 0, 1, 3, 4, 5)
        idx = torch.tensor(ids, dtype=torch.int64, device=self.pages.device)
        self.pages.index_copy_(0, idx, blocks.to(self.pages.dtype))
        with self._lock:
            self._entries[key] = (idx, n)
        return True

    def remove(self, key: Hashable) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._free.extend(entry[0].tolist())
            return True

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self.remove(key)

    # ---- reads --------------------------------------------------------------------------------------------
    def get(self, key: Hashable) -> torch.Tensor:
        """[L, 2, n, Hkv, D] (a copy). KeyError when absent."""
        return self.get_concat([key])

    def get_concat(self, keys: Sequence[Hashable]) -> torch.Tensor:
        """The entries of ``keys`` concatenated along the token axis, in order: [L, 2, Σn, Hkv, D]."""
        with self._lock:
            entries = [self._entries[k] for k in keys]
        if not entries:
            return self.pages.new_zeros(self.num_layers, 2, 0, self.num_kv_heads, self.head_dim)
        idx = torch.cat([e[0] for e in entries])
        blocks = self.pages.index_select(0, idx)  # [P, L, 2, ps, H, D]
        flat = blocks.permute(1, 2, 0, 3, 4, 5).reshape(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)
        if all(e[1] == e[0].numel() * self.page_size for e in entries):
            return flat
        ps = self.page_size
        rows = torch.cat([torch.arange(n, dtype=torch.int64) + off for off, n in
                          zip(_offsets([e[0].numel() * ps for e in entries]), (e[1] for e in entries))])
        return flat.index_select(2, rows.to(flat.device))


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out
