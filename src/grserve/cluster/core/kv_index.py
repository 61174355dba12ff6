"""The global KV index (xLLM §3.4): which instance holds which prefix block, in which tier.

Instance side, ``KVEventPublisher``: the prefix cache's hooks (its ``listener``) report what it stores or evicts;
the publisher turns that into block keys (``kvcache/block_hash.chained_block_hashes``: block ``b`` is cached iff
the cache holds tokens ``[0, (b+1)·B)``), keeps the instance's true contents ``block → tier`` and appends ordered
``KVEvent``\\ s, each with the instance's incarnation id and a sequence number (0, 1, 2, …). Both prefix caches
report: the copying store (``PrefixKVStore``) spans of its radix tree; the shared-block cache
(``SharedPrefixCache``, the default) the groups it adopts, named by its own block hashes, and evicts by those —
the publisher remembers the index blocks each group stands for (the same keys when the index's block size is the
engine's, the default).

Front end, ``GlobalKVIndex``: block → {instance: tier}. It applies an instance's events in order; a gap in the
sequence (an event lost), a sequence number behind what the instance says it has published (a lost tail) or a
new incarnation (the instance restarted) makes it ask for a full snapshot (``needs_snapshot``); a snapshot
replaces that instance's entries and sets the next expected number. A dead instance's entries are dropped and
every later event from it (a late poll) is ignored until a new incarnation registers.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from grserve.cluster.wire import TIERS, KVEvent, KVSnapshot, Tier
from grserve.kvcache.block_hash import chained_block_hashes


def user_key(user_id: int) -> int:
    """The global-index key of a ranking user's cached KV (stable across processes, disjoint from the LLM's
    chained block hashes by its domain prefix)."""
    digest = hashlib.blake2b(b"grserve-user:" + str(int(user_id)).encode(), digest_size=16).digest()
    return int.from_bytes(digest, "little")


def _block_range(start: int, stop: int, block_size: int) -> range:
    """Blocks whose last token lies in ``[start, stop)``: their coverage changed with that span."""
    return range(start // block_size, stop // block_size)


class KVEventPublisher:
    """One instance's view of its own prefix cache, as block keys and ordered events (thread-safe)."""

    def __init__(self, instance: int, incarnation: str, block_size: int, tier: Tier = "dram"):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}")
        self.instance, self.incarnation, self.block_size, self.tier = instance, incarnation, block_size, tier
        self.contents: dict[int, Tier] = {}
        self._of_group: dict[int, list[int]] = {}  # a shared-block cache's group → the index blocks it stands for
        self._groups_of: dict[int, int] = {}  # index block → how many held groups stand for it (two paths that
        #                                       part within a group share the index blocks ending before they part)
        self.next_seq = 0
        self._pending: list[KVEvent] = []
        self._lock = threading.Lock()

    # ---- the prefix cache's listener interface -----------------------------------------------------------
    def stored(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """The cache now holds ``tokens[start:stop]`` (``tokens[:start]`` was cached already)."""
        self._emit("store", tokens, start, stop)

    def evicted(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """The cache dropped ``tokens[start:stop]`` (``tokens`` is the whole path from position 0)."""
        self._emit("evict", tokens, start, stop)

    def stored_blocks(self, tokens: Sequence[int], groups: list[tuple[int, int, int]]) -> None:
        """A shared-block cache adopted ``groups`` — (its key, start, stop) — of the path ``tokens``."""
        last = _block_range(0, max(stop for _, _, stop in groups), self.block_size).stop
        path = chained_block_hashes(np.asarray(tokens[:last * self.block_size]), self.block_size)  # hashed once
        keys: list[int] = []
        for group, start, stop in groups:
            rng = _block_range(start, stop, self.block_size)
            self._of_group[group] = path[rng.start:rng.stop]
            for k in self._of_group[group]:
                self._groups_of[k] = self._groups_of.get(k, 0) + 1
                if self._groups_of[k] == 1:
                    keys.append(k)
        if keys:
            self.publish("store", keys)

    def evicted_blocks(self, groups: list[int]) -> None:
        """A shared-block cache dropped the groups with these keys."""
        keys: list[int] = []
        for g in groups:
            for k in self._of_group.pop(g, ()):
                self._groups_of[k] -= 1
                if not self._groups_of[k]:
                    del self._groups_of[k]
                    keys.append(k)
        if keys:
            self.publish("evict", keys)

    def _emit(self, kind: Literal["store", "evict"], tokens: Sequence[int], start: int, stop: int) -> None:
        keys = self._keys(tokens, start, stop)
        if keys:
            self.publish(kind, keys)

    def _keys(self, tokens: Sequence[int], start: int, stop: int) -> list[int]:
        """The keys of the index blocks whose last token lies in ``tokens[start:stop]``."""
        rng = _block_range(start, stop, self.block_size)
        if not len(rng):
            return []
        return chained_block_hashes(np.asarray(tokens[:rng.stop * self.block_size]), self.block_size)[rng.start:]

    def publish(self, kind: Literal["store", "evict"], keys: Iterable[int]) -> None:
        """Record a change of the instance's contents as one event (also used directly by tests)."""
        with self._lock:
            for k in keys:
                if kind == "store":
                    self.contents[k] = self.tier
                else:
                    self.contents.pop(k, None)
            self._pending.append(KVEvent(self.instance, self.incarnation, self.next_seq, kind, tuple(keys),
                                         self.tier))
            self.next_seq += 1

    # ---- what the front end reads ---------------------------------------------------------------------------
    def take_events(self) -> tuple[list[KVEvent], int]:
        """The events since the last call, and the next sequence number (tells a lost tail)."""
        with self._lock:
            out, self._pending = self._pending, []
            return out, self.next_seq

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self.instance, self.incarnation, self.next_seq, dict(self.contents))


@dataclass
class _InstanceState:
    incarnation: str | None = None
    expected: int = 0
    alive: bool = True
    needs_snapshot: bool = True  # nothing known yet
    blocks: set = field(default_factory=set)


class GlobalKVIndex:
    """block key → {instance: tier}, kept from ordered events and snapshots (thread-safe)."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[int, Tier]] = {}
        self._inst: dict[int, _InstanceState] = {}
        self._lock = threading.RLock()
        self.stats = {"events": 0, "ignored_events": 0, "gaps": 0, "snapshots": 0, "dropped_instances": 0}

    def register(self, instance: int, incarnation: str) -> None:
        """A (re)started instance: until its first snapshot it has no entries."""
        with self._lock:
            self._clear(instance)
            self._inst[instance] = _InstanceState(incarnation=incarnation)

    def _clear(self, instance: int) -> None:
        st = self._inst.get(instance)
        if st is None:
            return
        for key in st.blocks:
            holders = self.blocks.get(key)
            if holders is not None:
                holders.pop(instance, None)
                if not holders:
                    del self.blocks[key]
        st.blocks = set()

    def drop_instance(self, instance: int) -> None:
        """A dead (or fenced) instance: its entries go, its late events are ignored."""
        with self._lock:
            self._clear(instance)
            st = self._inst.setdefault(instance, _InstanceState())
            st.alive, st.needs_snapshot = False, False
            self.stats["dropped_instances"] += 1

    def needs_snapshot(self, instance: int) -> bool:
        with self._lock:
            st = self._inst.get(instance)
            return st is not None and st.alive and st.needs_snapshot

    def apply(self, instance: int, events: list[KVEvent], next_seq: int | None = None) -> bool:
        """Apply one instance's events in order; ``next_seq``: what the instance says it has published.
        Returns True when the index needs a snapshot of that instance before it can trust its entries."""
        with self._lock:
            st = self._inst.get(instance)
            if st is None or not st.alive:
                self.stats["ignored_events"] += len(events)
                return False
            for ev in events:
                if ev.incarnation != st.incarnation:  # a restart we did not see: start over from a snapshot
                    self.register(instance, ev.incarnation)
                    st = self._inst[instance]
                if st.needs_snapshot or ev.seq < st.expected:
                    self.stats["ignored_events"] += 1
                    continue
                if ev.seq > st.expected:
                    self.stats["gaps"] += 1
                    st.needs_snapshot = True
                    continue
                self._apply_one(instance, st, ev)
            if next_seq is not None and not st.needs_snapshot and next_seq > st.expected:
                self.stats["gaps"] += 1  # the tail was lost: nothing after it would tell us
                st.needs_snapshot = True
            return st.needs_snapshot

    def _apply_one(self, instance: int, st: _InstanceState, ev: KVEvent) -> None:
        for key in ev.blocks:
            if ev.kind == "store":
                self.blocks.setdefault(key, {})[instance] = ev.tier
                st.blocks.add(key)
            else:
                holders = self.blocks.get(key)
                if holders is not None:
                    holders.pop(instance, None)
                    if not holders:
                        del self.blocks[key]
                st.blocks.discard(key)
        st.expected = ev.seq + 1
        self.stats["events"] += 1

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        with self._lock:
            st = self._inst.get(snap.instance)
            if st is None or not st.alive:
                return
            if st.incarnation != snap.incarnation:
                self.register(snap.instance, snap.incarnation)
                st = self._inst[snap.instance]
            self._clear(snap.instance)
            for key, tier in snap.contents.items():
                self.blocks.setdefault(key, {})[snap.instance] = tier
            st.blocks = set(snap.contents)
            st.expected, st.needs_snapshot = snap.next_seq, False
            self.stats["snapshots"] += 1

    # ---- queries --------------------------------------------------------------------------------------------
    def contents_of(self, instance: int) -> dict[int, Tier]:
        with self._lock:
            return {k: self.blocks[k][instance] for k in self._inst[instance].blocks} if instance in self._inst \
                else {}

    def prefix_match(self, keys: Sequence[int], instances: Iterable[int]) -> dict[int, dict[Tier, int]]:
        """Per instance, how many leading blocks of ``keys`` it holds, counted per tier (the longest common
        block prefix: a block counts only if every block before it is held there too)."""
        out: dict[int, dict[Tier, int]] = {}
        with self._lock:
            for i in instances:
                tiers: dict[Tier, int] = {}
                for key in keys:
                    tier = self.blocks.get(key, {}).get(i)
                    if tier is None:
                        break
                    tiers[tier] = tiers.get(tier, 0) + 1
                out[i] = tiers
        return out

