"""Bounded memos: what a call builds once per shape (plans, compiled traces, kernels, schedules)
is kept in an ``LRU`` of documented size, so that calls of ever new shapes do not grow resident
memory without bound."""

from __future__ import annotations

from collections import OrderedDict


class LRU(OrderedDict):
    """A dict of at most ``size`` entries: storing one more forgets the least recently used.

    ``get_or_build(key, build)`` is the memo's one lookup: the entry (now the most recently
    used), else ``build()`` stored under ``key``. An ``mx.compile``d function or a custom
    function dropped from it frees its traces with it."""

    def __init__(self, size: int):
        super().__init__()
        if size < 1:
            raise ValueError(f"an LRU holds at least one entry, got size {size}")
        self.size = size

    def get_or_build(self, key, build):
        try:
            value = self[key]
        except KeyError:
            value = self[key] = build()
            return value
        self.move_to_end(key)
        return value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
