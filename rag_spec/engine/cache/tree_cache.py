"""The KV cache of a batch under speculative decoding: which slots hold committed tokens, each
row's pending token and position, the inputs of a tree step, and compaction to accepted paths.

The cache's layers are ``length`` slots long for every row. Rows accept different numbers of
tokens, so a row's slots can hold stale entries ("holes"); ``valid[b, s]`` says whether slot
``s`` of row ``b`` holds a committed token. Holes are masked out of attention and never shift
position ids, which count committed tokens only. A row's *root* is its newest committed token,
not yet in the cache: every step feeds it first, then the row's draft tree.

A cache made with a ``capacity`` holds a ``StaticCache`` instead (``compiled_step``): its
passes take a dense mask over every slot, through the runner's compiled step where it has one
(one-token passes, or every pass where that step is ``wide``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rag_spec.engine.cache.kv_cache import (
    SlidingWindow,
    attention_window,
    cache_argument,
    crop,
    fill_only,
    keep_batch_rows,
    layers,
    new_cache,
)
from rag_spec.engine.forward.compiled_step import rewind
from rag_spec.engine.verify.tree import TokenTree
from rag_spec.errors import RagSpecError
from rag_spec_kernels import SparseView, TreeMask, tree_pass, whole_rows

# Padded prefills run in chunks whose additive mask stays under this many elements (a single
# pass over a 16 x 4096 batch would need a [16, 1, 4096, 4096] float mask: 1 GB).
_MASK_ELEMENTS = 2**24
# A padded prefill's rows are grouped so that each group's padding stays within this share of
# its tokens plus this many slots (``length_groups``).
_PADDING_SHARE, _PADDING_FREE = 0.25, 64


@dataclass(frozen=True)
class TreeBatch:
    """One forward pass over a root token plus a tree per row (or a draft pass of a round)."""

    input_ids: torch.Tensor  # [B, N] root token, then the tree's tokens, then padding
    position_ids: torch.Tensor  # [B, N] committed length + depth
    # full attention: the compact mask (committed bits, the round's bits per token)
    mask: TreeMask | None
    # sliding-window models: [B, 1, N, cache_len + N] additive float mask, or one per layer
    # kind where only some layers slide (``_dense``)
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None


class TreeKVCache:
    """A DynamicCache of full-length layers plus the bookkeeping that makes it a tree cache.

    Args:
        cache: the transformers cache holding ``valid.shape[1]`` slots per row.
        valid: [B, slots] bool, which slots hold committed tokens.
        roots: [B] each row's pending token.
        window: sliding attention window of the model (None: full attention).
        capacity: the slots of a static ``cache`` (None: a DynamicCache that grows).
    """

    def __init__(self, cache: Any, valid: torch.Tensor, roots: Sequence[int],
                 window: SlidingWindow | None, capacity: int | None = None) -> None:
        layers(cache)  # refuses caches whose layers evict entries
        self.cache = cache
        self.capacity = capacity
        self.valid = valid
        self.roots = list(roots)
        self.positions = valid.sum(dim=1).tolist()  # [B] position id of each root
        # [B, hidden] the target's last hidden state before each root, kept by ``keep`` after
        # passes that asked for it (``forward(features=True)``; drafters that read the
        # target's states); None until then
        self.root_features: torch.Tensor | None = None
        self._step_features: torch.Tensor | None = None  # [B, W, hidden] of the last pass
        self.window = window
        # [B, round] position ids of the slots written since the last keep (-1: padding)
        self._round_positions = torch.zeros(valid.shape[0], 0, dtype=torch.long,
                                            device=valid.device)

    @classmethod
    def prefill(cls, model: Any, prompts: Sequence[Sequence[int]], capacity: int | None = None
                ) -> TreeKVCache:
        """Run every prompt but its last token; the last tokens become roots. Rows of very
        different lengths run in groups of similar length (``length_groups``), joined
        left-padded into one cache: a padded pass spends on padding what it spends on tokens
        (docs/concepts.md, "Why the defaults").
        With ``capacity``, into a static cache of that many slots lent by the runner's compiled
        step (prompts of one length); ``give_back`` returns it."""
        prefixes = [list(p[:-1]) for p in prompts]
        roots = [p[-1] for p in prompts]
        groups = length_groups([len(p) for p in prefixes])
        if capacity is not None or len(groups) == 1:
            return cls._padded(model, prefixes, roots, capacity)
        parts = [cls._padded(model, [prefixes[i] for i in group], [roots[i] for i in group])
                 for group in groups]
        where = {b: (g, r) for g, group in enumerate(groups) for r, b in enumerate(group)}
        cache, valid = _joined([(part.cache, part.valid) for part in parts],
                               [where[b] for b in range(len(prompts))])
        return cls(cache, valid, roots, attention_window(model.config))

    @classmethod
    def _padded(cls, model: Any, prefixes: Sequence[list[int]], roots: Sequence[int],
                capacity: int | None = None) -> TreeKVCache:
        """``prefixes`` run as one pass, left-padded to the longest."""
        device = model.device
        width = max(len(p) for p in prefixes)
        valid = torch.zeros(len(prefixes), width, dtype=torch.bool, device=device)
        ids = torch.zeros(len(prefixes), width, dtype=torch.long)
        for b, p in enumerate(prefixes):
            if p:
                ids[b, width - len(p):] = torch.tensor(p)
                valid[b, width - len(p):] = True
        window = attention_window(model.config)
        if capacity is None:
            tree = cls(new_cache(), valid, roots, window)
        elif window is None and bool(valid.all()):
            tree = cls(model.compiled.lend(len(prefixes), capacity), valid, roots, window,
                       capacity)
        else:
            msg = "A static cache holds prompts of one length for full-attention models."
            raise ValueError(msg)
        if width:
            tree._fill(model, ids.to(device))
        return tree

    def give_back(self, runner: Any) -> None:
        """Return a static cache to the compiled step that lent it (its CUDA graphs replay
        over it in the next generation); the cache is not used after this."""
        if self.capacity is not None:
            runner.compiled.give_back(self.cache, self.valid.shape[0], self.capacity)

    @classmethod
    def prefill_whole(cls, model: Any, prompts: Sequence[Sequence[int]]
                      ) -> tuple[TreeKVCache, torch.Tensor]:
        """Run every prompt whole and alone, as ``generate`` runs a prompt, so that the cache
        and the logits after it are bit for bit ``generate``'s (exact decoding); rows are then
        left-padded into one cache. Returns it and the logits [B, vocab] the first tokens
        come from; the caller sets them as ``roots``."""
        caches, logits = [], []
        for prompt in prompts:
            cache = new_cache()
            with whole_rows():
                out = model(input_ids=torch.tensor([list(prompt)], device=model.device),
                            use_cache=True, **cache_argument(model, cache), **fill_only(model))
            caches.append(cache)
            logits.append(out.logits[0, -1])
        whole = [torch.ones(1, len(p), dtype=torch.bool, device=model.device) for p in prompts]
        cache, valid = _joined(list(zip(caches, whole)), [(b, 0) for b in range(len(prompts))])
        tree = cls(cache, valid, [0] * len(prompts), attention_window(model.config))
        return tree, torch.stack(logits)

    @classmethod
    def of_row(cls, cache: Any, root: int, window: SlidingWindow | None) -> TreeKVCache:
        """A view of a one-row cache a caller manages, every slot committed."""
        length = cache.get_seq_length()
        return cls(cache, torch.ones(1, length, dtype=torch.bool), [root], window)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def _fill(self, model: Any, ids: torch.Tensor) -> None:
        positions = (self.valid.long().cumsum(-1) - 1).clamp(min=0)
        if self.valid.all():  # no padding: the model's own causal (and sliding-window) mask
            model(input_ids=ids, position_ids=positions, use_cache=True,
                  **cache_argument(model, self.cache), **fill_only(model))
            return
        batch, width = ids.shape
        chunk = max(1, _MASK_ELEMENTS // (batch * width))
        slot_positions = self._slot_positions()
        for start in range(0, width, chunk):
            end = min(width, start + chunk)
            keys = torch.arange(end, device=ids.device)[None, :]
            queries = torch.arange(start, end, device=ids.device)[:, None]
            allowed = (keys <= queries)[None] & self.valid[:, None, :end]
            allowed |= (keys == queries)[None]  # padding sees itself: no NaN rows
            mask = self._dense(allowed, slot_positions[:, start:end], slot_positions[:, :end],
                               model.dtype)
            model(input_ids=ids[:, start:end], position_ids=positions[:, start:end],
                  attention_mask=mask, use_cache=True, **cache_argument(model, self.cache),
                  **fill_only(model))

    def step(self, trees: Sequence[TokenTree], dtype: torch.dtype) -> TreeBatch:
        """Inputs for verifying ``trees`` (one per row, empty for none) below each root. Built
        in numpy: a step's own work is a few microseconds, not dozens of tensor operators
        (on a GPU, whose steps are short, that is a visible share of each)."""
        batch = len(trees)
        width = 1 + max(len(t) for t in trees)
        input_ids = np.zeros((batch, width), dtype=np.int64)
        position_ids = np.zeros((batch, width), dtype=np.int64)
        local = np.zeros((batch, width, width), dtype=bool)
        local[:, np.arange(width), np.arange(width)] = True  # padding sees itself
        for b, (tree, root, pos) in enumerate(zip(trees, self.roots, self.positions)):
            n = len(tree)
            input_ids[b, 0] = root
            input_ids[b, 1:1 + n] = tree.tokens
            position_ids[b, 0] = pos
            position_ids[b, 1:1 + n] = pos + tree.depths
            local[b, 1:1 + n, 0] = True  # every node sees the root
            local[b, 1:1 + n, 1:1 + n] = tree.ancestor_mask
        return self.grow(torch.from_numpy(input_ids), torch.from_numpy(position_ids),
                         torch.from_numpy(local), dtype)

    def grow(self, input_ids: torch.Tensor, position_ids: torch.Tensor, sees: torch.Tensor,
             dtype: torch.dtype, sparse: SparseView | None = None) -> TreeBatch:
        """Inputs for one more pass of the current round: ``W`` uncommitted tokens per row that
        see every committed slot plus what ``sees`` marks.

        A round is every pass since the last ``keep`` (a verification step is one pass; a draft
        model's round is one pass per tree depth); its slots follow the committed ones, in the
        order the passes wrote them.

        Args:
            input_ids: [B, W] tokens (padding where a row has fewer).
            position_ids: [B, W] their position ids.
            sees: [B, W, round + W] bool, which of the round's slots (those written by earlier
                passes, then this pass's tokens) each token attends to.
            sparse: the only committed slots to attend to (e.g. ``SinkWindow``'s view); None:
                all of them. Full-attention models only.
        """
        device = self.valid.device
        batch, width = input_ids.shape
        position_ids = position_ids.to(device)
        sees = sees.to(device)
        self._round_positions = torch.cat([self._round_positions, position_ids], dim=1)
        if self.window is None:
            committed = self.valid if sparse is None else sparse.committed(self.valid)
            return TreeBatch(input_ids.to(device), position_ids, TreeMask(committed, sees, sparse))
        if sparse is not None:
            msg = "A sparse view of the cache needs a full-attention model (this one slides)."
            raise ValueError(msg)
        prefix = self.valid[:, None, :].expand(batch, width, self.length)
        allowed = torch.cat([prefix, sees], dim=-1)
        kv_positions = torch.cat([self._slot_positions(), self._round_positions], dim=1)
        return TreeBatch(input_ids.to(device), position_ids, None,
                         self._dense(allowed, position_ids, kv_positions, dtype))

    def forward(self, runner: Any, batch: TreeBatch, features: bool = False) -> torch.Tensor:
        """Logits [B, W, vocab] of one pass over ``batch``, its KV entries written to the round.
        The compact mask goes to runners whose attention is ``tree_attention`` (``tree_pass``);
        others (a user's wrapped module) get it spelled out as a dense mask. With ``features``
        the pass also keeps the model's last hidden states, and ``keep`` the ones before the
        new roots.
        """
        if self.capacity is not None:
            return self._forward_static(runner, batch, features)
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids,
                  **cache_argument(runner, self.cache)}
        if batch.mask is None:
            return self._eager(runner, features, attention_mask=batch.attention_mask, **inputs)
        if not runner.tree_attention:
            allowed = batch.mask.over_cache(self.length)
            return self._eager(runner, features, attention_mask=_additive(allowed, runner.dtype),
                               **inputs)
        with tree_pass(batch.mask) as current:
            logits = self._eager(runner, features, **inputs)
        if not current.applied:
            msg = (f"{type(runner.module).__name__} computes attention without transformers' "
                   "attention functions, so rag-spec's tree masks cannot reach it; use "
                   "model.generate for this model.")
            raise RagSpecError(msg)
        return logits

    def _eager(self, runner: Any, features: bool, **inputs: Any) -> torch.Tensor:
        """A pass through ``runner`` itself; with ``features``, its last hidden states kept
        (asked for only then: a user's wrapped module need not take the keyword)."""
        if features:
            inputs["output_hidden_states"] = True
        out = runner(use_cache=True, **inputs)
        self._step_features = out.hidden_states[-1] if features else None
        return out.logits

    def _forward_static(self, runner: Any, batch: TreeBatch, features: bool) -> torch.Tensor:
        """``forward`` on a static cache: the pass writes after the round's earlier slots and
        attends through a dense mask over all ``capacity`` slots. Where the runner has a compiled
        step, one-token passes (plain steps) run compiled, and every pass where the step is
        ``wide`` (CUDA graphs on a GPU, oneDNN products on a CPU); with ``features`` too, where
        the model's logits are its LM head over its last hidden states
        (``CompiledStep.features_split``)."""
        assert self.capacity is not None and batch.mask is not None
        end = self.length + self.round_length
        if end > self.capacity:
            msg = (f"This pass needs {end} slots, more than the static cache's {self.capacity}: "
                   "a drafter wrote a larger round than the decoder's budget provides for.")
            raise RagSpecError(msg)
        rewind(self.cache, end - batch.input_ids.shape[1])
        mask = _additive(batch.mask.over_cache(self.length), runner.dtype, self.capacity)
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids,
                  "attention_mask": mask, **cache_argument(runner, self.cache)}
        step = runner.compiled
        if features and step is not None and not step.features_split:
            msg = (f"{type(runner.module).__name__} turns its last hidden states into logits "
                   "with more than its LM head, which a compiled step cannot return apart: "
                   "drafts that read the target's hidden states (FeatureDrafter) need "
                   "LookaheadConfig(compile=False) with this model.")
            raise RagSpecError(msg)
        width = batch.input_ids.shape[1]
        if step is not None and (step.wide or width == 1):
            padded = step.bucket(width)
            if end - width + padded > self.capacity:  # no slots for the padding: as it is
                padded = width
            out = step(**_padded(inputs, padded), features=features)
            logits, features_out = out if features else (out, None)
            self._step_features = None if features_out is None else features_out[:, :width]
            return logits[:, :width]
        return self._eager(runner, features, **inputs)

    @property
    def round_length(self) -> int:
        """Slots written by the current round's passes so far."""
        return self._round_positions.shape[1]

    def keep(self, paths: Sequence[Sequence[int]], next_roots: Sequence[int]) -> None:
        """After a step: keep each row's root and accepted path ``paths[b]`` (node indices of
        its tree), compacted to the front of the step's slots; ``next_roots`` become pending
        (and, after a pass with ``features``, the hidden states their tokens came from)."""
        if self._step_features is not None:
            last = torch.tensor([1 + path[-1] if path else 0 for path in paths],
                                device=self._step_features.device)
            rows = torch.arange(len(paths), device=last.device)
            self.root_features = self._step_features[rows, last]
            self._step_features = None
        self.keep_slots([[0] + [1 + node for node in path] for path in paths], next_roots)

    def keep_slots(self, slots: Sequence[Sequence[int]], next_roots: Sequence[int]) -> None:
        """End the round: commit ``slots[b]`` (indices into the round's slots, in sequence
        order) of each row, compacted to the front of the round; ``next_roots`` become pending.
        """
        start = self.length
        width = max(len(k) for k in slots)
        # kept slots already at the front of the round (a root alone, an accepted chain): no
        # entry moves, the round is only cut
        in_place = all(list(k) == list(range(len(k))) for k in slots)
        if not in_place:
            index = torch.tensor([list(k) + [k[-1] if k else 0] * (width - len(k))
                                  for k in slots], device=self.valid.device) + start  # [B, width]
        for layer in layers(self.cache):
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # [B, heads, slots, head_dim]
                if not in_place:
                    gather = index[:, None, :, None].expand(-1, tensor.shape[1], -1,
                                                            tensor.shape[3])
                    tensor[:, :, start:start + width] = tensor.gather(2, gather)
                if self.capacity is None:
                    setattr(layer, name, tensor[:, :, :start + width])
        lengths = np.array([len(k) for k in slots])
        new_valid = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None])
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device)], dim=1)
        self.positions = [p + len(k) for p, k in zip(self.positions, slots)]
        self.roots = list(next_roots)
        self._round_positions = self._round_positions[:, :0]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Go on with only the batch rows ``rows``, in that order (the others have finished):
        passes stop reading and computing theirs. The kept rows' entries are copied once,
        with a slab layer's spare room; a round in progress is kept too."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.valid.device)
        keep_batch_rows(self.cache, index)
        self.valid = self.valid.index_select(0, index)
        self.roots = [self.roots[b] for b in rows]
        self.positions = [self.positions[b] for b in rows]
        self._round_positions = self._round_positions.index_select(0, index)
        if self.root_features is not None:
            self.root_features = self.root_features.index_select(0, index)

    def discard_round(self) -> None:
        """Drop every slot the current round wrote (a self-draft's passes, whose entries were
        computed with a sparse view and must not be kept)."""
        if self.capacity is None:
            crop(self.cache, self.length)
        self._round_positions = self._round_positions[:, :0]

    def _slot_positions(self) -> torch.Tensor:
        """[B, slots] position id of each slot's token (-1 for holes and padding)."""
        positions = self.valid.long().cumsum(-1) - 1
        return positions.masked_fill(~self.valid, -1)

    def _dense(self, allowed: torch.Tensor, query_positions: torch.Tensor,
               key_positions: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive ``attention_mask`` of a pass whose queries see the keys ``allowed``
        ([B, q, kv]), within the sliding window where layers slide (a key's position greater
        than the query's minus the window, transformers' rule): one mask where every layer
        attends alike, else one per layer kind, which transformers' models take as such."""
        if self.window is None:
            return _additive(allowed, dtype)
        windowed = allowed & (key_positions[:, None, :]
                              > query_positions[:, :, None] - self.window.size)
        if not self.window.mixed:
            return _additive(windowed, dtype)
        return {"full_attention": _additive(allowed, dtype),
                "sliding_attention": _additive(windowed, dtype)}


def _additive(allowed: torch.Tensor, dtype: torch.dtype, slots: int | None = None
              ) -> torch.Tensor:
    """[B, q, kv] bool -> [B, 1, q, slots] additive float mask (0 or the dtype's minimum; the
    slots after ``kv``, if ``slots`` is more, masked)."""
    batch, queries, keys = allowed.shape
    mask = torch.full((batch, 1, queries, slots or keys), torch.finfo(dtype).min, dtype=dtype,
                      device=allowed.device)
    mask[:, 0, :, :keys].masked_fill_(allowed, 0.0)
    return mask


def _padded(inputs: dict[str, Any], width: int) -> dict[str, Any]:
    """A static pass's ``inputs`` padded to ``width`` tokens: each row's last token repeated,
    at its position, seeing what it sees. No real token sees the padding's slots (they lie after
    the round's), and the next pass or round overwrites them."""
    extra = width - inputs["input_ids"].shape[1]
    if extra <= 0:
        return inputs

    def repeat_last(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        last = tensor.narrow(dim, tensor.shape[dim] - 1, 1)
        return torch.cat([tensor, *[last] * extra], dim)

    return {**inputs, "input_ids": repeat_last(inputs["input_ids"], 1),
            "position_ids": repeat_last(inputs["position_ids"], 1),
            "attention_mask": repeat_last(inputs["attention_mask"], 2)}


def length_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Row indices in groups to prefill as one padded pass each, shortest rows first: a group
    takes the next row while its padding stays within ``_PADDING_SHARE`` of its tokens plus
    ``_PADDING_FREE`` (a few padded slots cost less than a pass of their own). Rows of one
    length are one group."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    tokens = 0  # in the last group
    for b in order:
        if groups:
            padding = lengths[b] * (len(groups[-1]) + 1) - (tokens + lengths[b])
            if padding <= (tokens + lengths[b]) * _PADDING_SHARE + _PADDING_FREE:
                groups[-1].append(b)
                tokens += lengths[b]
                continue
        groups.append([b])
        tokens = lengths[b]
    return groups


def _joined(parts: Sequence[tuple[Any, torch.Tensor]], rows: Sequence[tuple[int, int]]
            ) -> tuple[Any, torch.Tensor]:
    """One cache and its ``valid`` [B, width] from rows of others: ``rows`` names each row as
    (part, row in it) of ``parts``, (cache, valid) pairs; each row is right-aligned, holes
    before it. The parts' layers are released as they are copied (they are not used after),
    so the join needs little more memory than the cache it makes."""
    width = max(parts[p][1].shape[1] for p, _ in rows)
    valid = parts[0][1].new_zeros(len(rows), width)
    for b, (p, r) in enumerate(rows):
        valid[b, width - parts[p][1].shape[1]:] = parts[p][1][r]
    held = [layers(cache) if mask.shape[1] else None for cache, mask in parts]  # none if empty
    cache = new_cache()
    shapes = next(h for h in held if h is not None)
    for index in range(len(shapes)):
        joined = []
        for name in ("keys", "values"):
            like = getattr(shapes[index], name)
            out = like.new_zeros(len(rows), like.shape[1], width, like.shape[3])
            for b, (p, r) in enumerate(rows):
                if held[p] is not None:
                    row = getattr(held[p][index], name)[r]
                    out[b, :, width - row.shape[1]:] = row
            joined.append(out)
        for h in held:
            if h is not None:
                h[index] = None  # the part's layer list is its cache's: this frees the layer
        cache.update(*joined, index)
    return cache, valid
