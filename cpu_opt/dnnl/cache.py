"""The primitive cache: compiled oneDNN primitives and partitions, keyed by everything that
shapes them (op, shapes, strides, dtypes, attributes), in LRU order, safe across threads.

oneDNN has a primitive cache of its own, but it still makes us pay for a primitive descriptor
(the dispatch search) on every ``create`` call; this cache returns the ready object and counts
hits, misses and creations so tests can prove a repeated call creates nothing.

Capacity: ``CPU_OPT_PRIMITIVE_CACHE_CAPACITY`` (default 1024) or :func:`set_capacity`.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable


@dataclass
class CacheStats:
    """Counters that add up: every lookup is a hit or a miss; every miss created the object, waited
    for another thread creating the same key (``shared``), or failed (``failures``)."""
    hits: int
    misses: int
    creations: int
    evictions: int
    size: int
    capacity: int
    shared: int = 0
    failures: int = 0


class PrimitiveCache:
    def __init__(self, capacity: int = 1024):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = int(capacity)
        self._items: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.RLock()
        # One lock per key being created, so two threads asking for the same new primitive
        # create it once, while different keys are created concurrently.
        self._creating: dict[Hashable, threading.Lock] = {}
        self.hits = self.misses = self.creations = self.evictions = self.shared = self.failures = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def set_capacity(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"cache capacity must be an int >= 0, got {capacity!r}")
        with self._lock:
            self._capacity = capacity
            self._evict()

    def _evict(self) -> None:
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)
            self.evictions += 1

    def get_or_create(self, key: Hashable, factory: Callable[[], object]):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
            klock = self._creating.setdefault(key, threading.Lock())
        with klock:
            with self._lock:
                if key in self._items:  # created by another thread meanwhile
                    self._items.move_to_end(key)
                    self.shared += 1
                    return self._items[key]
            try:
                obj = factory()
            except BaseException:
                with self._lock:
                    self.failures += 1
                    if self._creating.get(key) is klock:  # the next caller tries afresh
                        self._creating.pop(key, None)
                raise
            with self._lock:
                self.creations += 1
                if self._capacity > 0:
                    self._items[key] = obj
                    self._evict()
                self._creating.pop(key, None)
            return obj

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def reset_stats(self) -> None:
        with self._lock:
            self.hits = self.misses = self.creations = self.evictions = self.shared = self.failures = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.hits, self.misses, self.creations, self.evictions, len(self._items), self._capacity,
                              self.shared, self.failures)

    def __len__(self) -> int:
        return len(self._items)


def _default_capacity() -> int:
    raw = os.environ.get("CPU_OPT_PRIMITIVE_CACHE_CAPACITY", "1024")
    try:
        cap = int(raw)
        if cap < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"CPU_OPT_PRIMITIVE_CACHE_CAPACITY must be an integer >= 0, got {raw!r}") from None
    return cap


CACHE = PrimitiveCache(_default_capacity())


def set_capacity(capacity: int) -> None:
    CACHE.set_capacity(capacity)


def stats() -> CacheStats:
    return CACHE.stats()
