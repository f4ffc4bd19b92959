"""Prompt prefixes already prefilled, kept so that a later prompt that begins the same way
(a conversation's next turn, an agent's next step, a served stride, a shared system prompt)
reads their KV entries instead of computing them again.

Lossless only where a token's entries do not depend on the pass that computed them
(``Runner.row_invariant``: the GGUF path, whose products and attention work row by row): there
a prompt prefilled from a stored prefix gets, bit for bit, the entries of its own whole pass.
Elsewhere a chunked prefill rounds otherwise than a whole one, so the decoder keeps no store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StoredPrefix:
    """The first ``length`` tokens of a stored prompt: per layer, their keys and values
    [1, kv_heads, length, head_dim] (views of the store's copies: read, never written)."""

    length: int
    entries: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


_NOTHING = StoredPrefix(0)


class PrefixStore:
    """Prefilled prompts' KV entries, least recently used first out past ``max_bytes``.
    A prompt that extends a stored one replaces it, so a conversation holds one entry.
    Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[np.ndarray, StoredPrefix]] = (
            OrderedDict())
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, tokens: Sequence[int]) -> StoredPrefix:
        """The longest stored prefix of ``tokens`` (length 0: none)."""
        query = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            best, key = _NOTHING, None
            for stored_key, (ids, prefix) in self._entries.items():
                common = _common_length(query, ids)
                if common > best.length:
                    best, key = _cut(prefix, common), stored_key
            if key is not None:
                self._entries.move_to_end(key)
        return best

    def keep(self, tokens: Sequence[int], entries: Sequence[tuple[torch.Tensor, torch.Tensor]]
             ) -> None:
        """Store a copy of ``tokens``' entries (per layer, keys and values [kv_heads,
        len(tokens), head_dim]); stored prompts it extends are dropped."""
        if not tokens:
            return
        copies = tuple((k.detach().clone()[None], v.detach().clone()[None]) for k, v in entries)
        size = sum(k.nbytes + v.nbytes for k, v in copies)
        if size > self.max_bytes:
            return
        ids = np.asarray(tokens, dtype=np.int64)
        key = tuple(tokens)
        with self._lock:
            for stored_key, (stored, prefix) in list(self._entries.items()):
                if stored_key == key or (len(stored) <= len(ids)
                                         and _common_length(ids, stored) == len(stored)):
                    del self._entries[stored_key]
                    self.nbytes -= _nbytes(prefix)
            self._entries[key] = (ids, StoredPrefix(len(ids), copies))
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (_, oldest) = self._entries.popitem(last=False)
                self.nbytes -= _nbytes(oldest)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _cut(prefix: StoredPrefix, length: int) -> StoredPrefix:
    if length == prefix.length:
        return prefix
    return StoredPrefix(length, tuple((k[:, :, :length], v[:, :, :length])
                                      for k, v in prefix.entries))


def _nbytes(prefix: StoredPrefix) -> int:
    return sum(k.nbytes + v.nbytes for k, v in prefix.entries)
