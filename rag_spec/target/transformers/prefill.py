"""Prefill: the passes that fill a new ``TreeKVCache`` with the prompts (every token but each
prompt's last, which becomes the row's root), grouped by length so padding stays cheap; each
prompt whole and alone where output must be ``generate``'s bit for bit; or from a stored
prefix where a token's entries do not depend on the pass (``prefill_reusing``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rag_spec.target.transformers.kv_cache import (
    SlidingWindow,
    attention_window,
    cache_argument,
    fill_only,
    layers,
    new_cache,
)
from rag_spec.target.transformers.passes import ModuleRunner
from rag_spec.target.transformers.prefix_store import PrefixStore, StoredPrefix
from rag_spec.target.transformers.step_inputs import dense_mask
from rag_spec.target.transformers.tree_cache import TreeKVCache, joined
from rag_spec_kernels import whole_rows

# Padded prefills run in chunks whose additive mask stays under this many elements (a single
# pass over a 16 x 4096 batch would need a [16, 1, 4096, 4096] float mask: 1 GB).
_MASK_ELEMENTS = 2**24
# A padded prefill's rows are grouped so that each group's padding stays within this share of
# its tokens plus this many slots (``length_groups``).
_PADDING_SHARE, _PADDING_FREE = 0.25, 64


def prefill(runner: ModuleRunner, prompts: Sequence[Sequence[int]],
            capacity: int | None = None) -> TreeKVCache:
    """Run every prompt but its last token; the last tokens become roots. Rows of very
    different lengths run in groups of similar length (``length_groups``), joined left-padded
    into one cache: a padded pass spends on padding what it spends on tokens (docs/concepts.md,
    "Why the defaults"). With ``capacity``, into a static cache of that many slots lent by the
    runner's compiled step (written in place for prompts of one length, else copied there
    left-padded, the padding masked as any hole is); ``ModuleRunner.release`` returns it."""
    prefixes = [list(p[:-1]) for p in prompts]
    roots = [p[-1] for p in prompts]
    if capacity is not None and len({len(p) for p in prefixes}) == 1:
        return padded_prefill(runner, prefixes, roots, capacity)
    groups = length_groups([len(p) for p in prefixes])
    if len(groups) == 1:
        tree = padded_prefill(runner, prefixes, roots)
    else:
        parts = [padded_prefill(runner, [prefixes[i] for i in group], [roots[i] for i in group])
                 for group in groups]
        where = {b: (g, r) for g, group in enumerate(groups) for r, b in enumerate(group)}
        cache, valid = joined([(part.cache, part.valid) for part in parts],
                              [where[b] for b in range(len(prompts))])
        tree = TreeKVCache(cache, valid, roots, attention_window(runner.config))
    return tree if capacity is None else _lent(runner, tree, capacity)


def prefill_reusing(runner: ModuleRunner, prompts: Sequence[Sequence[int]],
                    store: PrefixStore, capacity: int | None = None
                    ) -> tuple[TreeKVCache, list[int]]:
    """``prefill``, each prompt's longest prefix in ``store`` read rather than computed (only
    where a token's entries do not depend on the pass: ``Runner.row_invariant``); what it
    computes is kept there. Returns the cache and how many tokens of each prompt were read."""
    prefixes = [list(p[:-1]) for p in prompts]
    found = [store.longest(p) for p in prefixes]
    if not any(f.length for f in found):  # nothing to read: ``prefill`` (in place, compiled)
        tree = prefill(runner, prompts, capacity)
        _keep(store, prefixes, found, [(tree.cache, tree.valid)],
              {b: (0, b) for b in range(len(prompts))})
        return tree, [0] * len(prompts)
    fresh = [b for b, f in enumerate(found) if not f.length]
    parts: list[tuple[Any, torch.Tensor]] = []
    where: dict[int, tuple[int, int]] = {}
    if fresh:
        part = prefill(runner, [prompts[b] for b in fresh])
        parts.append((part.cache, part.valid))
        where.update((b, (0, r)) for r, b in enumerate(fresh))
    for b, stored in enumerate(found):
        if stored.length:  # a pass of its own, after what was read
            cache = new_cache()
            for index, (keys, values) in enumerate(stored.entries):
                cache.update(keys, values, index)
            if len(prefixes[b]) > stored.length:
                append(runner, cache, prefixes[b][stored.length:])
            where[b] = (len(parts), 0)
            parts.append((cache, torch.ones(1, len(prefixes[b]), dtype=torch.bool,
                                            device=runner.device)))
    _keep(store, prefixes, found, parts, where)
    cache, valid = joined(parts, [where[b] for b in range(len(prompts))])
    tree = TreeKVCache(cache, valid, [p[-1] for p in prompts], attention_window(runner.config))
    return (tree if capacity is None else _lent(runner, tree, capacity)), \
        [f.length for f in found]


def _keep(store: PrefixStore, prefixes: Sequence[list[int]], found: Sequence[StoredPrefix],
          parts: Sequence[tuple[Any, torch.Tensor]], where: dict[int, tuple[int, int]]) -> None:
    """Store each prompt prefix that computed more than it read: ``where`` names its row as
    (part, row) of ``parts``, (cache, valid) pairs whose rows end at their ``valid`` width
    (a static cache's later slots are not read)."""
    for b, prefix in enumerate(prefixes):
        if len(prefix) > found[b].length:
            p, r = where[b]
            width = parts[p][1].shape[1]
            store.keep(prefix, [(layer.keys[r, :, width - len(prefix):width],
                                 layer.values[r, :, width - len(prefix):width])
                                for layer in layers(parts[p][0])])


def regroup(runner: ModuleRunner, parts: Sequence[tuple[TreeKVCache, Sequence[int]]],
            capacity: int | None = None) -> TreeKVCache:
    """One cache of the rows ``parts`` names, (cache, its rows to keep) in order: a batch in
    flight with rows that joined it (continuous batching), its finished rows left out. Each
    row's committed slots are copied right-aligned, holes before them: holes are masked and
    never shift positions, so every row goes on as it would have. With ``capacity``, into a
    static cache lent by the runner's compiled step. The parts' caches are only read: the
    caller releases them after. Their rounds must be closed (between steps); the rows'
    ``root_features`` are not kept (the next step drafts without a draft head's features)."""
    rows = [(p, r) for p, (_, kept) in enumerate(parts) for r in kept]
    cache, valid = joined([(part.cache, part.valid) for part, _ in parts], rows, release=False)
    tree = TreeKVCache(cache, valid, [parts[p][0].roots[r] for p, r in rows], parts[0][0].window)
    return tree if capacity is None else _lent(runner, tree, capacity)


def _lent(runner: ModuleRunner, tree: TreeKVCache, capacity: int) -> TreeKVCache:
    """``tree``'s entries copied into a static cache of ``capacity`` slots lent by the
    runner's compiled step, so that a batch of prompts of several lengths decodes compiled
    too (its rows left-padded: ``valid`` masks the padding)."""
    static = _static(runner, len(tree.roots), capacity, tree.window)
    for index, layer in enumerate(layers(tree.cache)):
        static.update(layer.keys, layer.values, index)  # its first slots, as a pass writes
    return TreeKVCache(static, tree.valid, tree.roots, tree.window, capacity)


def _static(runner: ModuleRunner, rows: int, capacity: int, window: SlidingWindow | None
            ) -> Any:
    """A static cache of ``capacity`` slots for ``rows`` rows, lent by the runner's compiled
    step: only full-attention models' steps are compiled on one."""
    if window is not None or runner.compiled is None:
        msg = "A static cache holds full-attention models' prompts, for a compiled step."
        raise ValueError(msg)
    return runner.compiled.lend(rows, capacity)


def padded_prefill(runner: ModuleRunner, prefixes: Sequence[list[int]], roots: Sequence[int],
                   capacity: int | None = None) -> TreeKVCache:
    """``prefixes`` run as one pass, left-padded to the longest."""
    device = runner.device
    width = max(len(p) for p in prefixes)
    valid = torch.zeros(len(prefixes), width, dtype=torch.bool, device=device)
    ids = torch.zeros(len(prefixes), width, dtype=torch.long)
    for b, p in enumerate(prefixes):
        if p:
            ids[b, width - len(p):] = torch.tensor(p)
            valid[b, width - len(p):] = True
    window = attention_window(runner.config)
    if capacity is None:
        tree = TreeKVCache(new_cache(), valid, roots, window)
    elif bool(valid.all()):  # prompts of several lengths are copied there (``_lent``)
        tree = TreeKVCache(_static(runner, len(prefixes), capacity, window), valid, roots,
                           window, capacity)
    else:
        msg = "A static cache is written in place only by prompts of one length."
        raise ValueError(msg)
    if width:
        fill(runner, tree, ids.to(device))
    return tree


def fill(runner: ModuleRunner, tree: TreeKVCache, ids: torch.Tensor) -> None:
    """Write the KV entries of ``ids`` [B, width] (left-padded as ``tree.valid`` says) into
    ``tree``'s empty cache; padded batches in chunks of bounded mask size."""
    positions = (tree.valid.long().cumsum(-1) - 1).clamp(min=0)
    if tree.valid.all():  # no padding: the model's own causal (and sliding-window) mask
        runner(input_ids=ids, position_ids=positions, use_cache=True,
               **cache_argument(runner, tree.cache), **fill_only(runner))
        return
    batch, width = ids.shape
    chunk = max(1, _MASK_ELEMENTS // (batch * width))
    slot_positions = tree.slot_positions()
    for start in range(0, width, chunk):
        end = min(width, start + chunk)
        keys = torch.arange(end, device=ids.device)[None, :]
        queries = torch.arange(start, end, device=ids.device)[:, None]
        allowed = (keys <= queries)[None] & tree.valid[:, None, :end]
        allowed |= (keys == queries)[None]  # padding sees itself: no NaN rows
        mask = dense_mask(tree.window, allowed, slot_positions[:, start:end],
                          slot_positions[:, :end], runner.dtype)
        runner(input_ids=ids[:, start:end], position_ids=positions[:, start:end],
               attention_mask=mask, use_cache=True, **cache_argument(runner, tree.cache),
               **fill_only(runner))


def prefill_whole(runner: ModuleRunner, prompts: Sequence[Sequence[int]]
                  ) -> tuple[TreeKVCache, torch.Tensor]:
    """Run every prompt whole and alone, as ``generate`` runs a prompt, so that the cache and
    the logits after it are bit for bit ``generate``'s (exact decoding); rows are then
    left-padded into one cache. Returns it and the logits [B, vocab] the first tokens come
    from; the caller sets them as ``roots``."""
    caches, logits = [], []
    for prompt in prompts:
        cache = new_cache()
        with whole_rows():
            out = runner(input_ids=torch.tensor([list(prompt)], device=runner.device),
                         use_cache=True, **cache_argument(runner, cache), **fill_only(runner))
        caches.append(cache)
        logits.append(out.logits[0, -1])
    whole = [torch.ones(1, len(p), dtype=torch.bool, device=runner.device) for p in prompts]
    cache, valid = joined(list(zip(caches, whole)), [(b, 0) for b in range(len(prompts))])
    tree = TreeKVCache(cache, valid, [0] * len(prompts), attention_window(runner.config))
    return tree, torch.stack(logits)


def append(runner: ModuleRunner, cache: Any, tokens: list[int]) -> None:
    """Append ``tokens`` to a one-row transformers ``cache`` a caller manages (positions
    continue from its length)."""
    runner(input_ids=torch.tensor([tokens], device=runner.device), use_cache=True,
           **cache_argument(runner, cache), **fill_only(runner))


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
