"""What a speculative step's attention reads, given compactly: ``TreeMask`` (which committed
slots each row holds, which of the round's newest slots each query sees), ``SparseView`` (the
only committed slots a draft reads), the pass that carries the mask to attention
(``tree_pass``), and ``reference_attention``, the torch contract every kernel is tested
against. The kernels (``cpu_attention``, ``triton_tree_attention``, ``exact``) and the
dispatcher (``tree_attention``) all import it; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch


class SparseView:
    """Committed slots that a draft reads instead of all of them (e.g. StreamingLLM's attention
    sinks plus a recent window), ``select``: [B, K] slot indices; ``update`` moves it on.

    Our kernels (C++ on the CPU, Triton on a GPU) read the selected slots in place. The torch
    reference keeps, per layer, a buffer of the selected keys and values with room for a
    round's own slots: a round's passes append only their new tokens, and ``update`` refreshes
    only the entries whose slot changed. (Fresh tensors per pass or per round cost more than the
    copies: page faults on first touch.)
    """

    def __init__(self, select: torch.Tensor, present: torch.Tensor | None = None,
                 room: int = 16) -> None:
        self.select = select
        # [B, K] which entries hold a slot (None: all); the others are masked out
        self.present = present
        self.room = room  # round slots a buffer holds before it is regrown
        self._buffers: dict[Any, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._changed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stale: set[Any] = set()  # layers whose buffers miss the changed entries

    def committed(self, valid: torch.Tensor) -> torch.Tensor:
        """[B, K] which entries hold committed tokens, given the cache's [B, S] ``valid``."""
        bits = valid.gather(1, self.select.to(valid.device))
        return bits if self.present is None else bits & self.present.to(valid.device)

    def update(self, select: torch.Tensor, present: torch.Tensor | None = None) -> None:
        """Read ``select`` from now on (same shape); buffers refresh the entries that differ."""
        self._changed = (select != self.select).nonzero(as_tuple=True)
        self.select, self.present = select, present
        self._stale = set(self._buffers)

    def read(self, layer: Any, key: torch.Tensor, value: torch.Tensor, round_length: int,
             new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, kv_heads, K + R, D] keys and values of ``layer``: the selection, then the round's
        slots, of which the last ``new`` were just written by this pass."""
        committed = key.shape[2] - round_length
        width = self.select.shape[1]
        end = width + round_length
        held = self._buffers.get(layer)
        if held is None or held[0] != key.data_ptr() or held[1].shape[2] < end:
            index = self.select.to(key.device)[:, None, :, None].expand(
                -1, key.shape[1], -1, key.shape[3])
            room = max(self.room, round_length)
            keys, values = (torch.cat([tensor[:, :, :committed].gather(2, index),
                                       tensor[:, :, committed:],
                                       tensor.new_empty(*tensor.shape[:2], room,
                                                        tensor.shape[3])], dim=2)
                            for tensor in (key, value))
            self._buffers[layer] = (key.data_ptr(), keys, values)
            self._stale.discard(layer)
            return keys[:, :, :end], values[:, :, :end]
        _, keys, values = held
        if layer in self._stale and self._changed is not None:
            rows, cols = self._changed
            slots = self.select[rows, cols].to(key.device)
            keys[rows, :, cols] = key[rows, :, slots]
            values[rows, :, cols] = value[rows, :, slots]
            self._stale.discard(layer)
        keys[:, :, end - new:end] = key[:, :, key.shape[2] - new:]
        values[:, :, end - new:end] = value[:, :, value.shape[2] - new:]
        return keys[:, :, :end], values[:, :, :end]


@dataclass
class TreeMask:
    """Which keys each query token of one forward pass attends to.

    The pass's keys are ``S`` committed slots followed by ``R`` round slots (the last ``q`` of
    them the pass's own tokens). Every query sees the committed slots marked in ``committed``
    (or, with a ``sparse`` view, only the selected ones that are marked) and the round slots
    marked in its row of ``recent``.

    Args:
        committed: [B, S] bool, or [B, K] with ``sparse``: which (selected) slots hold tokens.
        recent: [B, q, R] bool, which round slots each query token sees.
        sparse: the committed slots to read (None: all ``S``).
    """

    committed: torch.Tensor
    recent: torch.Tensor
    sparse: SparseView | None = None
    _dense: dict[tuple[int, torch.dtype, torch.device], torch.Tensor | None] = field(
        default_factory=dict, repr=False, compare=False)
    _visible: dict[torch.device, list[VisibleKeys]] = field(
        default_factory=dict, repr=False, compare=False)
    _bits: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict, repr=False, compare=False)
    _over: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def select(self) -> torch.Tensor | None:
        """[B, K] the committed slots read, or None for all."""
        return self.sparse.select if self.sparse is not None else None

    @property
    def round_length(self) -> int:
        return self.recent.shape[-1]

    def bias(self, groups: int, dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor | None:
        """[B, 1, groups * q, K + R] additive mask over the keys actually read (selected
        committed slots, then the round), for queries stacked ``groups`` heads deep; built
        once per pass, shared by its layers. None where every key is seen (a one-token step
        without holes: SDPA's unmasked kernel is the faster one)."""
        key = (groups, dtype, device)
        if key not in self._dense:
            batch, q_len, _ = self.recent.shape
            committed = self.committed.to(device)[:, None, :].expand(batch, q_len, -1)
            allowed = torch.cat([committed, self.recent.to(device)], dim=-1)
            allowed = allowed[:, None].expand(-1, groups, -1, -1).reshape(
                batch, 1, groups * q_len, allowed.shape[-1])
            bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
            self._dense[key] = None if bool(allowed.all()) else bias.masked_fill_(
                ~allowed, torch.finfo(dtype).min)
        return self._dense[key]

    def bits(self, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``committed`` and ``recent`` as contiguous uint8 and the selection as contiguous
        int64, on ``device``: what a kernel reads; converted once per pass, shared by its
        layers (on a GPU each conversion is a launch per layer otherwise)."""
        if device not in self._bits:
            select = self.select
            self._bits[device] = (
                self.committed.to(device, torch.uint8).contiguous(),
                self.recent.to(device, torch.uint8).contiguous(),
                None if select is None else select.to(device, torch.int64).contiguous())
        return self._bits[device]

    def visible(self, device: torch.device) -> list[VisibleKeys]:
        """Per row: the keys read (selected committed slots, then the round's) that each query
        sees; built once per pass, shared by its layers."""
        if device not in self._visible:
            self._visible[device] = [VisibleKeys.of(c, r, device)
                                     for c, r in zip(self.committed, self.recent)]
        return self._visible[device]

    def over_cache(self, committed_slots: int) -> torch.Tensor:
        """[B, q, S + R] bool over every slot of the cache (selected committed bits scattered
        back to their slots): the same mask for attention that reads the whole cache; built
        once per pass, shared by its layers (read only)."""
        if committed_slots in self._over:
            return self._over[committed_slots]
        committed = self.committed
        if self.select is not None:
            committed = torch.zeros(committed.shape[0], committed_slots, dtype=torch.bool,
                                    device=committed.device).scatter_(
                1, self.select.to(committed.device), self.committed)
        batch, q_len, _ = self.recent.shape
        self._over[committed_slots] = torch.cat(
            [committed[:, None, :].expand(batch, q_len, -1), self.recent], dim=-1)
        return self._over[committed_slots]


@dataclass(frozen=True)
class VisibleKeys:
    """The keys each query token of one row sees, in order, for attention that reads them one
    query at a time: the ``base`` every query of the row sees (its committed slots), then
    each query's ``tails`` (round slots). Where a query's keys are a prefix of all keys, its
    tail is a count and they are read as a view; otherwise its keys are copied together.
    """

    offset: int  # where the tails' keys begin (the number of committed keys read)
    base: torch.Tensor | None  # indices of the committed keys seen (None: all ``offset``)
    tails: list[int | torch.Tensor]  # per query: keys just after the base (count), or indices

    @property
    def base_length(self) -> int:
        return self.offset if self.base is None else len(self.base)

    @classmethod
    def of(cls, committed: torch.Tensor, recent: torch.Tensor, device: torch.device
           ) -> VisibleKeys:
        """From ``committed`` [K] (the committed keys the row sees) and ``recent`` [q, R] (the
        later keys each query sees), both bool."""
        offset = committed.shape[0]
        index = committed.cpu().nonzero().flatten()
        whole = len(index) == offset  # every committed key: a prefix
        tails: list[int | torch.Tensor] = []
        for bits in recent.cpu():
            tail = bits.nonzero().flatten()
            view = whole and (not len(tail) or int(tail[-1]) == len(tail) - 1)
            tails.append(len(tail) if view else (tail + offset).to(device))
        return cls(offset, None if whole else index.to(device), tails)


def seen_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """A [B, 1, q, kv] dense mask as [B, q, kv] bool, which keys each query sees: a bool mask as
    it is, a float one (rag-spec's own) where it is 0 rather than the dtype's minimum."""
    mask = attention_mask[:, 0]
    return mask if mask.dtype == torch.bool else mask == 0


def gather_keys(key: torch.Tensor, value: torch.Tensor, mask: TreeMask, layer: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a pass reads: the selected committed slots (all of them without a
    selection), then the round's. ``layer`` names the layer (its buffers in a sparse view)."""
    if mask.sparse is None:
        return key, value
    return mask.sparse.read(layer, key, value, mask.round_length, mask.recent.shape[1])


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: TreeMask, scaling: float | None = None, layer: Any = None
                        ) -> torch.Tensor:
    """The contract in torch: [B, heads, q, D] queries over [B, kv_heads, S + R, D] keys and
    values under ``mask``; returns [B, heads, q, D].

    Query heads are stacked per KV head ([B, kv_heads, groups * q, D]) so the KV cache is read
    once per KV head; on a CPU, SDPA runs it with its flash kernel.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    key, value = gather_keys(key, value, mask, layer)
    stacked = query.reshape(batch, kv_heads, groups * q_len, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=mask.bias(groups, query.dtype, query.device),
        scale=scaling)
    return out.reshape(batch, heads, q_len, dim)


@dataclass
class TreePass:
    """A forward pass in progress under a compact mask (``tree_pass``): the mask, and how many
    attention calls applied it."""

    mask: TreeMask
    applied: int = 0


_PASS: ContextVar[TreePass | None] = ContextVar("rag_spec_tree_pass", default=None)


@contextmanager
def tree_pass(mask: TreeMask) -> Iterator[TreePass]:
    """Forward passes inside apply ``mask`` in every tree attention call.

    The mask travels by context, not as a forward keyword: some models' layers do not hand
    keywords on to their attention (StableLM's). ``applied`` counts the calls that took it;
    none means the model computes attention without transformers' attention functions
    (Falcon), so the mask was not applied."""
    state = TreePass(mask)
    token = _PASS.set(state)
    try:
        yield state
    finally:
        _PASS.reset(token)


def pass_mask() -> TreeMask | None:
    """The compact mask of the pass in progress (counted as applied once more), or None; None
    while compiling (compiled steps take dense masks)."""
    if torch.compiler.is_compiling():
        return None
    state = _PASS.get()
    if state is None:
        return None
    state.applied += 1
    return state.mask
