"""Token-level radix-tree prefix cache (SGLang ``RadixCache`` semantics) with a pluggable eviction policy.

The tree records *which token spans are cached* and one opaque value per token (e.g. KV slot / block ids);
it builds no tensors. Operations:

* ``match_prefix(tokens)`` — longest cached prefix; a match ending inside a node splits it so the matched part is
  whole nodes (lockable). Every node on the path is a policy hit; if the prompt is not fully matched, the policy is
  told about the miss (LARU's prediction-induced-miss test).
* ``insert(tokens, values)`` — cache the part of ``tokens`` beyond the cached prefix as a new leaf, evicting first
  if the capacity (in tokens) would be exceeded. Returns the length that was already cached.
* ``lock(node)`` / ``unlock(node)`` — reference counts on the path to the root; nodes in use are never evicted.
* ``evict(n_tokens)`` — leaf-only eviction via the policy until ``n_tokens`` are freed (a parent whose last
  child goes becomes an evictable leaf).

Mapping onto Algorithm 1 (digest §11.13–11.14, decided here): an *item* is a tree node (a token span); the
policy's k is the number of nodes, capacity is counted in tokens. A node's policy key is content-addressed:
(start + 1, hash of the token prefix up to and including its first token). The key survives eviction, so when a
prompt's unmatched part starts exactly where a node was evicted, ``on_miss`` names that node — the "miss for item
x" of Line 14. A split keeps the head's key; the tail is a new key that inherits the head's history
(``policy.on_split``). Only unlocked leaves are evictable (``policy.set_evictable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from grserve.eviction.policy import EvictionPolicy, make_policy

_B = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier: invertible mod 2^64
_POW = np.ones(1, dtype=np.uint64)


def _powers(n: int) -> np.ndarray:
    global _POW
    if len(_POW) < n:
        m = max(n, 2 * len(_POW))
        p = np.empty(m, dtype=np.uint64)
        p[0] = 1
        with np.errstate(over="ignore"):
            for i in range(1, m):  # only grows O(log) times
                p[i] = p[i - 1] * _B
        _POW = p
    return _POW[:n]


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """H[i] = Σ_{j<i} (tok_j + 1)·B^j mod 2^64 for i = 0..n: segmentation-independent prefix fingerprints."""
    t = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = np.cumsum((t + np.uint64(1)) * _powers(len(t)), dtype=np.uint64)
    return np.concatenate([np.zeros(1, dtype=np.uint64), h])


def _span_key(start: int, h_after_first: int) -> tuple[int, int]:
    return (start + 1, int(h_after_first))


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "ident", "start")

    def __init__(self, key: np.ndarray, value: Any, parent: "TreeNode | None", start: int, ident: Hashable):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids of this span
        self.value = value  # one opaque value per token (sliceable)
        self.lock_ref = 0
        self.ident = ident
        self.start = start  # depth of the first token

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass
class MatchResult:
    length: int  # cached prefix length in tokens
    values: np.ndarray  # the cached values of that prefix
    last_node: TreeNode  # deepest matched node (root if nothing matched)


class RadixCache:
    def __init__(self, capacity_tokens: int, policy: EvictionPolicy | str = "lru",
                 on_evict: Callable[[Any], None] | None = None, **policy_kw: Any):
        if capacity_tokens < 1:
            raise ValueError("capacity_tokens must be ≥ 1")
        self.capacity = capacity_tokens
        self.policy = policy if isinstance(policy, EvictionPolicy) else make_policy(policy, capacity_tokens,
                                                                                      **policy_kw)
        self.on_evict = on_evict
        self.on_evict_node: Callable[[TreeNode], None] | None = None  # hook: sees the node (parent still linked)
        self.root = TreeNode(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), None, 0, ("root",))
        self.root.lock_ref = 1  # never evicted
        self.nodes: dict[Hashable, TreeNode] = {}
        self.size = 0  # cached tokens
        self.clock = 0
        self.stats = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "evicted_tokens": 0, "splits": 0}

    # ---- evictability --------------------------------------------------------------------------------------
    def _refresh(self, node: TreeNode) -> None:
        if node is not self.root:
            self.policy.set_evictable(node.ident, node.lock_ref == 0 and not node.children)

    # ---- structure -----------------------------------------------------------------------------------------
    def _split(self, node: TreeNode, m: int, h: np.ndarray, now: int) -> TreeNode:
        """Keep node as the head (first m tokens); move the rest to a new tail child. Returns the head."""
        pos = node.start + m
        first = int(node.key[m])
        with np.errstate(over="ignore"):
            h_tail = h[pos] + np.uint64(first + 1) * _powers(pos + 1)[pos]
        tail = TreeNode(node.key[m:], node.value[m:], node, pos, _span_key(pos, h_tail))
        tail.children = node.children
        for ch in tail.children.values():
            ch.parent = tail
        tail.lock_ref = node.lock_ref
        node.children = {first: tail}
        node.key, node.value = node.key[:m], node.value[:m]
        self.nodes[tail.ident] = tail
        self.policy.on_split(node.ident, tail.ident, now)
        self._refresh(tail)
        self._refresh(node)
        self.stats["splits"] += 1
        return node

    def _walk(self, tokens: np.ndarray, h: np.ndarray, now: int, touch: bool) -> tuple[TreeNode, int, list]:
        node, pos, vals = self.root, 0, []
        n = len(tokens)
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            m = _common_len(child.key, tokens[pos:])
            if m < len(child.key):
                child = self._split(child, m, h, now)
            if touch:
                self.policy.on_hit(child.ident, now)
            vals.append(child.value)
            node, pos = child, pos + m
        return node, pos, vals

    # ---- API -----------------------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int] | np.ndarray, now: int | None = None) -> MatchResult:
        tokens = np.asarray(tokens, dtype=np.int64)
        now = self._tick(now)
        h = prefix_hashes(tokens)
        node, pos, vals = self._walk(tokens, h, now, touch=True)
        if pos < len(tokens):
            self.policy.on_miss(_span_key(pos, h[pos + 1]), now)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(tokens)
        self.stats["hit_tokens"] += pos
        values = np.concatenate(vals) if vals else np.zeros(0, dtype=np.int64)
        return MatchResult(pos, values, node)

    def _tick(self, now: int | None) -> int:
        if now is None:
            now = self.clock
            self.clock += 1
        else:
            self.clock = max(self.clock, now + 1)
        return now

    def insert(self, tokens: Sequence[int] | np.ndarray,
               values: Sequence[Any] | np.ndarray | Callable[[int, int], np.ndarray] | None = None,
               now: int | None = None) -> int:
        """Cache ``tokens`` (values[i] belongs to tokens[i]); returns how many leading tokens were already cached.

        ``values`` may be a function ``(start, stop) -> values of tokens[start:stop]``, called once, after any
        eviction, for the part actually inserted (a store whose values are slots freed by ``on_evict`` allocates
        them there). If the new part cannot fit even after evicting every evictable leaf, only the prefix that
        fits is inserted (nothing is ever evicted from the path being extended: it is locked during the insert)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        make = values if callable(values) else None
        if make is None:
            values = np.arange(len(tokens), dtype=np.int64) if values is None else np.asarray(values)
            if len(values) != len(tokens):
                raise ValueError("one value per token")
        now = self.clock - 1 if now is None else now
        h = prefix_hashes(tokens)
        node, pos, _ = self._walk(tokens, h, now, touch=False)
        if pos == len(tokens):
            return pos
        need = len(tokens) - pos
        self.lock(node)
        try:
            over = self.size + need - self.capacity
            if over > 0:
                self.evict(over, now)
        finally:
            self.unlock(node)
        room = self.capacity - self.size
        if room <= 0:
            return pos
        end = pos + min(need, room)
        vals = np.asarray(make(pos, end)) if make is not None else values[pos:end]
        if len(vals) != end - pos:
            raise ValueError("one value per token")
        leaf = TreeNode(tokens[pos:end], vals, node, pos, _span_key(pos, h[pos + 1]))
        node.children[int(tokens[pos])] = leaf
        self.nodes[leaf.ident] = leaf
        self.size += end - pos
        self.policy.on_insert(leaf.ident, now)
        self._refresh(leaf)
        self._refresh(node)
        return pos

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self._refresh(node)
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock without lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._refresh(node)
            node = node.parent

    def evict(self, n_tokens: int, now: int | None = None) -> int:
        """Evict unlocked leaves chosen by the policy until ≥ n_tokens are freed (or none is evictable)."""
        now = self.clock if now is None else now
        freed = 0
        while freed < n_tokens and self.policy.n_evictable > 0:
            ident = self.policy.victim(now)
            node = self.nodes.pop(ident)
            if node.children or node.lock_ref:
                raise AssertionError(f"policy {self.policy.name} evicted a non-leaf or locked node")
            parent = node.parent
            del parent.children[int(node.key[0])]
            freed += len(node.key)
            self.size -= len(node.key)
            if self.on_evict_node is not None:
                self.on_evict_node(node)
            if self.on_evict is not None:
                self.on_evict(node.value)
            self._refresh(parent)
        self.stats["evicted_tokens"] += freed
        return freed

    @property
    def hit_rate(self) -> float:
        return self.stats["hit_tokens"] / self.stats["prompt_tokens"] if self.stats["prompt_tokens"] else 0.0

    def check(self) -> None:
        """Structural invariants (tests): sizes, parent links, child keys, policy bookkeeping."""
        total = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            for first, ch in n.children.items():
                assert ch.parent is n and int(ch.key[0]) == first and len(ch.key) == len(ch.value) > 0
                assert ch.start == n.end
                assert ch.ident in self.nodes and self.nodes[ch.ident] is ch
                assert ch.ident in self.policy
                total += len(ch.key)
                stack.append(ch)
        assert total == self.size <= self.capacity
        assert len(self.nodes) == len(self.policy)
