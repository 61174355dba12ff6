"""Users and items as pre-encoded token lists (BAT §5.1: "The user profile, item description, and system
instructions are pre-encoded into tokens and stored").

- A user is a profile token list 𝒰 (history + attributes), keyed by an integer user id.
- An item is a token list whose **last token is its identifier token** v_i (fixed per item, so it sits inside
  the cached item span and the item KV stays request-independent; digest ambiguity 3). Identifier tokens are
  unique across items: candidates are scored by the softmax over their identifier tokens' logits, so two items
  sharing one would always score the same (``IdentifierCollision``).
- The instruction tokens (the tail's end; the last one is the discriminant token) and the optional IP notation
  tokens are fixed for the registry.

Listeners (``on_change``) are told when a user's or an item's tokens are replaced, so caches drop stale KV.
Files: JSON lines, ``{"user_id": 1, "tokens": [...]}`` / ``{"item_id": 7, "tokens": [...]}``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np


class RegistryError(ValueError):
    """Invalid user/item data; the message names the record."""


class IdentifierCollision(RegistryError):
    """An item's identifier token is already another item's."""

    def __init__(self, item_id: int, token: int, other: int) -> None:
        self.item_id, self.token, self.other = item_id, token, other
        super().__init__(f"item {item_id}: identifier token {token} is already the identifier of item {other}")


class RankingRegistry:
    def __init__(self, vocab_size: int, instruction: Iterable[int], notation: Iterable[int] = ()):
        self.vocab_size = int(vocab_size)
        self.instruction = self._check(list(instruction), "instruction")
        if len(self.instruction) == 0:
            raise RegistryError("instruction tokens must not be empty (the last one is the discriminant token)")
        self.notation = self._check(list(notation), "notation")
        self._users: dict[int, np.ndarray] = {}
        self._items: dict[int, np.ndarray] = {}
        self._by_identifier: dict[int, int] = {}  # identifier token -> item id
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str, int], None]] = []

    # ---- validation ---------------------------------------------------------------------------------------
    def _check(self, tokens, what: str) -> np.ndarray:
        try:
            arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        except (OverflowError, ValueError, TypeError):
            raise RegistryError(f"{what}: tokens must be integers") from None
        bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise RegistryError(f"{what}: token {int(arr[i])} at [{i}] is out of range [0, {self.vocab_size})")
        return arr

    def on_change(self, fn: Callable[[str, int], None]) -> None:
        """fn("user" | "item", id) after a user's or item's tokens are replaced (not on first insertion)."""
        self._listeners.append(fn)

    def _notify(self, kind: str, key: int) -> None:
        for fn in self._listeners:
            fn(kind, key)

    # ---- users --------------------------------------------------------------------------------------------
    def add_user(self, user_id: int, tokens) -> bool:
        """Register or replace a user; True when it replaced different tokens."""
        arr = self._check(tokens, f"user {user_id}")
        if arr.size == 0:
            raise RegistryError(f"user {user_id}: profile tokens must not be empty")
        with self._lock:
            old = self._users.get(int(user_id))
            self._users[int(user_id)] = arr
        changed = old is not None and not np.array_equal(old, arr)
        if changed:
            self._notify("user", int(user_id))
        return changed

    def has_user(self, user_id: int) -> bool:
        return int(user_id) in self._users

    def user_tokens(self, user_id: int) -> np.ndarray:
        return self._users[int(user_id)]

    @property
    def num_users(self) -> int:
        return len(self._users)

    def user_ids(self) -> list[int]:
        return list(self._users)

    # ---- items --------------------------------------------------------------------------------------------
    def add_item(self, item_id: int, tokens) -> bool:
        """Register or replace an item; True when it replaced different tokens. ``IdentifierCollision`` when its
        identifier (last) token is another item's."""
        arr = self._check(tokens, f"item {item_id}")
        if arr.size == 0:
            raise RegistryError(f"item {item_id}: tokens must not be empty (the last token is the identifier)")
        with self._lock:
            ident = int(arr[-1])
            other = self._by_identifier.get(ident)
            if other is not None and other != int(item_id):
                raise IdentifierCollision(int(item_id), ident, other)
            old = self._items.get(int(item_id))
            if old is not None:
                self._by_identifier.pop(int(old[-1]), None)
            self._items[int(item_id)] = arr
            self._by_identifier[ident] = int(item_id)
        changed = old is not None and not np.array_equal(old, arr)
        if changed:
            self._notify("item", int(item_id))
        return changed

    def update(self, kind: str, entries: Iterable[tuple[int, object]], notify: bool = True) -> list[int]:
        """Register or replace many users or items (``kind``) as one change: a restart's replay, a cluster
        broadcast. Only the identifiers of the result must be unique, so items may hand identifier tokens over
        among themselves. Returns the ids that were new; listeners hear of the replaced ones (``notify``)."""
        new: dict[int, np.ndarray] = {}
        for key, tokens in entries:
            new[int(key)] = arr = self._check(tokens, f"{kind} {key}")
            if arr.size == 0:
                raise RegistryError(f"{kind} {key}: tokens must not be empty")
        table = self._users if kind == "user" else self._items
        with self._lock:
            if kind == "item":
                self._check_handover(new)
            old = {key: table.get(key) for key in new}
            for key in new:  # every replaced item's identifier is freed before any is taken
                if kind == "item" and old[key] is not None:
                    self._by_identifier.pop(int(old[key][-1]), None)  # type: ignore[index]
            for key, arr in new.items():
                table[key] = arr
                if kind == "item":
                    self._by_identifier[int(arr[-1])] = key
        for key, arr in new.items():
            if notify and old[key] is not None and not np.array_equal(old[key], arr):
                self._notify(kind, key)
        return [key for key in new if old[key] is None]

    def _check_handover(self, new: dict[int, np.ndarray]) -> None:
        """``IdentifierCollision`` unless the items after ``update(new)`` have unique identifiers (lock held)."""
        taken: dict[int, int] = {}
        for key, arr in new.items():
            ident = int(arr[-1])
            if ident in taken:
                owner: int | None = taken[ident]  # another item of this change
            else:  # a registered item being replaced frees its identifier (its new one is checked on its turn)
                owner = self._by_identifier.get(ident)
                owner = None if owner in new else owner
            if owner is not None and owner != key:
                raise IdentifierCollision(key, ident, owner)
            taken[ident] = key

    def has_item(self, item_id: int) -> bool:
        return int(item_id) in self._items

    def item_tokens(self, item_id: int) -> np.ndarray:
        return self._items[int(item_id)]

    def identifier(self, item_id: int) -> int:
        return int(self._items[int(item_id)][-1])

    def item_with_identifier(self, token: int) -> int | None:
        """The item whose identifier token is ``token``, or None."""
        return self._by_identifier.get(int(token))

    @property
    def num_items(self) -> int:
        return len(self._items)

    def item_ids(self) -> list[int]:
        return list(self._items)

    # ---- files --------------------------------------------------------------------------------------------
    def load_jsonl(self, path: str | Path, kind: str) -> int:
        """Load ``kind`` ("user" | "item") records; errors name the file and line. Returns the record count."""
        key = f"{kind}_id"
        add = self.add_user if kind == "user" else self.add_item
        n = 0
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    rid, toks = rec[key], rec["tokens"]
                    if not isinstance(rid, int) or isinstance(rid, bool):
                        raise RegistryError(f"{key} must be an integer")
                    add(rid, toks)
                except (json.JSONDecodeError, KeyError, RegistryError, TypeError) as e:
                    what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                    raise RegistryError(f"{path}:{lineno}: {what}") from None
                n += 1
        return n


def synthetic_registry(vocab_size: int, num_items: int, item_len_range: tuple[int, int],
                       user_lengths: Iterable[int], seed: int = 0, instruction_len: int = 4,
                       token_offset: int = 16) -> RankingRegistry:
    """Random token content; item ``i`` ends with the unique identifier token ``vocab_size - num_items + i``.

    User ``u`` (0-based) gets ``user_lengths[u]`` random tokens. Content tokens are drawn from
    ``[token_offset, vocab_size - num_items)`` so they never collide with identifiers.
    """
    id_base = vocab_size - num_items
    if id_base <= token_offset + instruction_len:
        raise RegistryError(f"{num_items} items need {num_items} identifier tokens; vocab {vocab_size} is too small")
    rng = np.random.default_rng(seed)
    instr = rng.integers(token_offset, id_base, size=instruction_len)
    reg = RankingRegistry(vocab_size, instr)
    lo, hi = item_len_range
    lens = rng.integers(lo, hi + 1, size=num_items)
    for i in range(num_items):
        body = rng.integers(token_offset, id_base, size=int(lens[i]) - 1)
        reg.add_item(i, np.append(body, id_base + i))
    for u, n in enumerate(user_lengths):
        reg.add_user(u, rng.integers(token_offset, id_base, size=int(n)))
    return reg
