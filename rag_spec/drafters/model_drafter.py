"""Drafters that compute: a smaller model of the same vocabulary (SpecInfer's SSM), or the
target's own first layers (``assistant_early_exit``), growing token trees with probabilities.

A draft model keeps a KV cache of its own per batch, in step with what the target committed:
after a step it keeps the slots of the draft tokens the target accepted and feeds only what it
has not seen (at least the newest token), never the whole context again. Its prefill is put off
until its drafts pay: it first reads only the last ``TRIAL_CONTEXT`` tokens of each context, and
reads them whole once its drafts on that window pay (``policy.plan.trial_paid``) (a draft that
keeps missing so never costs a prefill of a long prompt). An early exit keeps
none: its layers are the target's first layers, so it drafts on the target's own cache. A round
is one forward pass for the pending tokens and one per further depth, for every row of the
batch at once.

Greedy decoding: each node's children are its likeliest tokens. Sampling: they are drawn
without replacement from the node's draft distribution (processed like the target's:
repetition penalty, temperature, top-k, top-p) with the row's ``draft_generator``, in draw
order; multi-step speculative sampling then verifies them against ``draft_probs``.
"""

from __future__ import annotations

import abc
import copy
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rag_spec.drafters.drafter import Drafter, DraftRequest, TargetView
from rag_spec.drafters.exit_adapter import ExitAdapter
from rag_spec.errors import RagSpecError
from rag_spec.policy.expansion import Expansion
from rag_spec.policy.plan import RowPlan, trial_paid
from rag_spec.policy.step_costs import prior_cost
from rag_spec.target.sampling import SamplingParams, processed_logits
from rag_spec.target.transformers.passes import ModuleRunner
from rag_spec.target.transformers.prefill import prefill
from rag_spec.target.transformers.runner import Runner, RunnerSettings
from rag_spec.target.transformers.step_inputs import round_step
from rag_spec.target.transformers.tree_cache import TreeKVCache
from rag_spec.target.tree import TokenTree
from rag_spec_kernels import SparseView

_GREEDY = SamplingParams()
TRIAL_CONTEXT = 64  # tokens of each context a draft model reads until its drafts pay


class _Stateless:
    """A request's session: a computing drafter reads everything from the committed context."""

    def propose(self, context: Sequence[int], budget: int) -> TokenTree:
        msg = "model drafters propose a batch at a time: call DraftModelDrafter.propose"
        raise RagSpecError(msg)

    def observe(self, context: Sequence[int], new_from: int) -> None:
        pass

    def finish(self, output: Sequence[int]) -> None:
        pass

    def add_documents(self, documents: Sequence[Sequence[int]]) -> None:
        pass


@dataclass
class _Row:
    """One row's draft round: what was fed, what was drafted, and where it lies in the cache."""

    chain: list[int] = field(default_factory=list)  # pending tokens fed first (the root last)
    tokens: list[int] = field(default_factory=list)  # draft nodes
    parents: list[int] = field(default_factory=list)
    slots: list[int | None] = field(default_factory=list)  # round slot of each node (None: leaf)

    def accepted(self, context: Sequence[int], root: int) -> list[int]:
        """The drafted nodes the target accepted, drafted below the token at ``root`` of
        ``context`` (committed since, but for the newest token)."""
        tree = TokenTree(tuple(self.tokens), tuple(self.parents))
        return tree.follow(context[root + 1:len(context) - 1])

    def clear(self) -> None:
        """End the round: forget the drafts (what the target kept is the policy's to learn)."""
        self.chain, self.tokens, self.parents, self.slots = [], [], [], []

    def kept(self, context: Sequence[int], base: int) -> list[int]:
        """Round slots to commit: the chain, then the drafted nodes the target accepted (not the
        newest token, which the next round feeds)."""
        accepted = self.accepted(context, base + len(self.chain) - 1)
        slots = list(range(len(self.chain)))
        for node in accepted:
            if self.slots[node] is None:  # a leaf no pass wrote
                break
            slots.append(self.slots[node])
        self.clear()
        return slots


class DraftPasses:
    """The pluggable forward of a model drafter: which passes draft and over whose cache.

    A draft model (``DraftModelDrafter``) runs its own fast path over a cache of its own, kept
    in step with what the target committed. Drafts whose committed entries are the target's
    (an early exit, the target through a sparse view, a draft head on its hidden states)
    ``share`` the target's cache and draft in a round of their own, dropped before the target
    verifies: nothing is prefilled or kept in step, and no KV is stored twice. ``cost`` is a
    pass's cost in target steps (by the weights each reads).
    """

    shares_cache = False
    sparse: SparseView | None = None  # committed slots the passes read (None: all)
    # the token ids of the logits' columns, ascending, on the CPU, out of ``vocab_size``
    # (None: every token): a head that scores a subset of the vocabulary returns that
    # subset's columns alone, so drafting ranks and normalises thousands of columns, not the
    # vocabulary
    columns: torch.Tensor | None = None
    vocab_size = 0

    def __init__(self, runner: ModuleRunner, cost: float) -> None:
        self.runner = runner
        self.cost = cost

    def shape(self, batch: DraftBatch, requests: Sequence[DraftRequest], expansion: Expansion
              ) -> Expansion | None:
        """This round's tree shape (None: no draft this round)."""
        return expansion

    def forward(self, batch: DraftBatch, rows: int,
                feeds: dict[int, list[tuple[int, int, list[int]]]]) -> tuple[torch.Tensor, int]:
        """One pass: ``feeds[b]`` lists row b's (token, position, round slots it sees); other
        rows ride along as padding. Returns the logits [B, W, vocab] (or [B, W, len(columns)])
        and the round slot of each
        row's first token (its j-th token lands at that slot + j)."""
        cache, runner = batch.cache, self.runner
        first = cache.round_length
        width = max(len(f) for f in feeds.values())
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        position_ids = torch.zeros(rows, width, dtype=torch.long)
        sees = torch.zeros(rows, width, first + width, dtype=torch.bool)
        sees[:, torch.arange(width), first + torch.arange(width)] = True  # each sees itself
        for b, fed in feeds.items():
            for j, (token, position, slots) in enumerate(fed):
                input_ids[b, j] = token
                position_ids[b, j] = position
                sees[b, j, slots] = True
        step = round_step(cache, input_ids, position_ids, sees, runner.dtype, self.sparse)
        return runner.forward(cache, step), first

    def end_round(self, batch: DraftBatch) -> None:
        """The round's passes are done."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Only the batch rows ``rows`` go on."""


class SharedPasses(DraftPasses):
    """Passes over the target's own cache (see ``DraftPasses``)."""

    shares_cache = True


class DraftBatch:
    """One batch's drafting state, whatever drafts: a row per target row, the cache the passes
    read (the draft's own or the target's), and the forward (``DraftPasses``).

    A draft of its own cache is on trial at first: its cache holds only each context's last
    ``TRIAL_CONTEXT`` tokens (``offsets``: where in the context it starts); once its drafts pay
    it is prefilled with whole contexts.
    """

    def __init__(self, passes: DraftPasses, target: TargetView,
                 requests: Sequence[DraftRequest]) -> None:
        self.draft = passes
        self.cost = passes.cost
        self.passes = 0  # forward passes run so far
        self.rows = [_Row() for _ in requests]
        if passes.shares_cache:
            self.cache: TreeKVCache = target.cache
            self.offsets = [0] * len(requests)
            self.roots = [0] * len(requests)  # each row's root position when last drafted for
        else:
            contexts = [r.context for r in requests]
            self.offsets = [max(len(c) - TRIAL_CONTEXT, 0) for c in contexts]
            self.cache = prefill(passes.runner,
                                 [c[o:] for c, o in zip(contexts, self.offsets)])

    @property
    def on_trial(self) -> bool:
        return any(self.offsets)

    def start(self, row: int) -> int:
        """Where in row ``row``'s context its pending tokens begin."""
        return self.offsets[row] + self.cache.positions[row]

    def begin_round(self, requests: Sequence[DraftRequest], expansion: Expansion
                    ) -> Expansion | None:
        """Drop the last round's drafts (an own cache commits what the target accepted, or after
        a trial that paid reads the whole contexts); returns this round's tree shape (None: no
        draft)."""
        if self.draft.shares_cache:
            for b, (row, request) in enumerate(zip(self.rows, requests)):
                row.clear()
                self.roots[b] = len(request.context) - 1
            return self.draft.shape(self, requests, expansion)
        kept = [row.kept(r.context, self.start(b))
                for b, (row, r) in enumerate(zip(self.rows, requests))]
        if self.on_trial and trial_paid([r.plan for r in requests if r.plan is not None]):
            self.cache = prefill(self.draft.runner, [r.context for r in requests])
            self.offsets = [0] * len(requests)
        else:
            self.cache.keep_slots(kept, [r.context[-1] for r in requests])
        return self.draft.shape(self, requests, expansion)

    def forward(self, rows: int, feeds: dict[int, list[tuple[int, int, list[int]]]]
                ) -> tuple[torch.Tensor, int]:
        """One draft pass (``DraftPasses.forward``)."""
        self.passes += 1
        return self.draft.forward(self, rows, feeds)

    def end_round(self) -> None:
        """A shared cache drops the round's KV entries (the target writes its own for what it
        accepts); an own cache keeps them for the next ``begin_round``."""
        if self.draft.shares_cache:
            self.cache.discard_round()
        self.draft.end_round(self)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Only the target's rows ``rows`` go on (the others finished): so do their drafts."""
        self.rows = [self.rows[b] for b in rows]
        self.offsets = [self.offsets[b] for b in rows]
        if self.draft.shares_cache:
            self.roots = [self.roots[b] for b in rows]
        else:
            self.cache.keep_rows(rows)
        self.draft.keep_rows(rows)


class ModelDrafter(Drafter):
    """What drafting with a model takes: per-batch drafting state, rounds, the tree's shape.
    Subclasses say which forward passes draft (``draft_passes``)."""

    def __init__(self, expansion: Expansion | None) -> None:
        self.expansion = expansion or Expansion()
        self._batches: dict[int, DraftBatch] = {}  # per batch, from begin to end: id(target)
        self._lock = threading.Lock()

    def session(self, prompt: Sequence[int], extra_context: Sequence[Sequence[int]] = ()
                ) -> _Stateless:
        return _Stateless()

    @abc.abstractmethod
    def draft_passes(self, target: TargetView, requests: Sequence[DraftRequest]
                     ) -> DraftPasses:
        """The forward that drafts for a new batch of ``target`` (called under the lock)."""

    def propose(self, requests: Sequence[DraftRequest], target: TargetView | None
                ) -> list[TokenTree]:
        if target is None or not any(r.budget > 0 for r in requests):
            return [TokenTree.empty() for _ in requests]
        with self._lock:  # made at the batch's first draft: it prefills every context
            batch = self._batches.get(id(target))
            if batch is None:
                batch = self._batches[id(target)] = DraftBatch(
                    self.draft_passes(target, requests), target, requests)
        return _draft(batch, requests, self.expansion)

    def keep_rows(self, target: TargetView, rows: Sequence[int]) -> None:
        with self._lock:
            batch = self._batches.get(id(target))
        if batch is not None:
            batch.keep_rows(rows)

    def end(self, target: TargetView) -> None:
        with self._lock:
            self._batches.pop(id(target), None)


class DraftModelDrafter(ModelDrafter):
    """Token trees from a draft model that shares the target's vocabulary.

    Args:
        draft_model: a transformers causal LM (e.g. Llama-3.2-1B for Llama-3.1-8B); only read.
        expansion: the trees' shape (dynamic by default).
        onednn_linear: the draft's own fast path (see ``LookaheadConfig.onednn_linear``).

    Examples:
        >>> drafter = DraftModelDrafter(small.model)                         # doctest: +SKIP
        >>> LookaheadDecoder(big.model, big.tokenizer, drafter=drafter)     # doctest: +SKIP
    """

    label = "draft model"

    def __init__(self, draft_model: Any, *, expansion: Expansion | None = None,
                 onednn_linear: bool | Literal["auto"] = "auto") -> None:
        if getattr(draft_model, "config", None) is None or not callable(draft_model):
            msg = "DraftModelDrafter needs a transformers causal LM (AutoModelForCausalLM)."
            raise RagSpecError(msg)
        super().__init__(expansion)
        self.draft_model = draft_model
        self.settings = RunnerSettings(onednn_linear=onednn_linear)

    def draft_passes(self, target: TargetView, requests: Sequence[DraftRequest]
                     ) -> DraftPasses:
        """The draft model's own fast path, over a cache of its own."""
        runner = Runner.of(self.draft_model, self.settings)
        _check_vocabularies(runner.config, target.runner.config)
        return DraftPasses(runner, _weights(runner.module) / _weights(target.runner.module))


class EarlyExitDrafter(ModelDrafter):
    """Drafts with the target's own first ``layers`` layers, final norm and LM head: the weights
    are shared (no copy), and so is the KV cache (the target's entries for those layers are the
    exit's: nothing is prefilled twice). The same draft as transformers'
    ``generate(assistant_early_exit=layers)``.

    Untrained, an early exit agrees with the full model far less often than a trained draft;
    the budget throttles it while it keeps missing. ``adapter`` (``rag-spec draft train``, or
    ``exit_adapter.cached_exit``) adds a trained layer and a smaller head on the exit.
    """

    label = "early exit"

    def __init__(self, layers: int, *, expansion: Expansion | None = None,
                 adapter: ExitAdapter | None = None) -> None:
        if layers < 1:
            msg = f"EarlyExitDrafter needs layers >= 1 (got {layers})."
            raise RagSpecError(msg)
        if adapter is not None and adapter.layers != layers:
            msg = f"The adapter exits after {adapter.layers} layers, not {layers}."
            raise RagSpecError(msg)
        super().__init__(expansion)
        self.layers = layers
        self.adapter = adapter
        self._views: weakref.WeakKeyDictionary[Runner, ModuleRunner] = (
            weakref.WeakKeyDictionary())

    def draft_runner(self, target: TargetView) -> ModuleRunner:
        """A view of the target's runner that stops after ``layers`` layers (built once per
        runner; called under the drafter's lock)."""
        view = self._views.get(target.runner)
        if view is None:
            module = first_layers(target.runner.module, self.layers)
            if self.adapter is not None:
                module = self.adapter.attach(module)
            view = self._views[target.runner] = ModuleRunner(module)
        return view

    def draft_passes(self, target: TargetView, requests: Sequence[DraftRequest]
                     ) -> DraftPasses:
        """The exit's passes on the target's own cache (its first layers' entries are the
        exit's)."""
        runner = self.draft_runner(target)
        return SharedPasses(runner, _weights(runner.module) / _weights(target.runner.module))


def first_layers(module: Any, count: int) -> Any:
    """A view of a causal LM that runs only its first ``count`` decoder layers, then its final
    norm and LM head; modules and weights are shared, the config is a private copy."""
    decoder = module.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        msg = (f"{type(module).__name__} keeps its decoder layers elsewhere than .layers; "
               "use DraftModelDrafter with a separate draft model.")
        raise RagSpecError(msg)
    if not 1 <= count < len(layers):
        msg = f"An early exit needs 1 <= layers < {len(layers)} (got {count})."
        raise RagSpecError(msg)
    config = copy.copy(decoder.config)
    config.num_hidden_layers = count
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:count])

    def shallow(original: Any) -> Any:
        twin = copy.copy(original)
        twin._modules = dict(original._modules)
        if "config" in vars(original):
            vars(twin)["config"] = config
        return twin

    top = shallow(module)
    for name, child in module._modules.items():
        if child is decoder:
            base = shallow(decoder)
            base._modules["layers"] = torch.nn.ModuleList(list(layers)[:count])
            top._modules[name] = base
            return top
    msg = f"{type(module).__name__}'s decoder is not a direct child; use a separate draft model."
    raise RagSpecError(msg)


def _weights(module: Any) -> int:
    """Weights a forward pass multiplies by (shared ones once; embedding tables are only
    looked up, but a head tied to one counts)."""
    seen: dict[int, int] = {}
    for part in module.modules():
        if not isinstance(part, torch.nn.Embedding):
            seen.update((id(p), p.numel()) for p in part.parameters(recurse=False))
    return sum(seen.values())


def _check_vocabularies(draft: Any, target: Any) -> None:
    draft_size, target_size = draft.vocab_size, target.vocab_size
    if draft_size != target_size:
        msg = (f"The draft model's vocabulary ({draft_size} tokens) differs from the target's "
               f"({target_size}): drafts must use the target's token ids. Pick a draft of the "
               "same family and tokenizer (e.g. Llama-3.2-1B for Llama-3.1-8B).")
        raise RagSpecError(msg)


@torch.inference_mode()
def _draft(batch: DraftBatch, requests: Sequence[DraftRequest], expansion: Expansion
           ) -> list[TokenTree]:
    """One round for every row: commit what the target accepted, feed the pending tokens, then
    one pass per depth."""
    shape = batch.begin_round(requests, expansion)
    if shape is None:
        return [TokenTree.empty() for _ in requests]
    cache, expansion = batch.cache, shape
    growing = {b: _Growth(r, batch.rows[b], cache.positions[b], batch.start(b), expansion,
                          batch.draft)
               for b, r in enumerate(requests) if r.budget > 0}
    # Pass 0: each drafting row's pending tokens (at least the root) give q at the root.
    logits, _ = batch.forward(len(requests), {
        b: [(token, g.base + i, list(range(i))) for i, token in enumerate(g.row.chain)]
        for b, g in growing.items()})
    for b, g in growing.items():
        g.set_q([-1], logits[b, len(g.row.chain) - 1:len(g.row.chain)])
    # Then one pass per depth, for the rows whose trees still grow.
    for depth in range(1, expansion.max_depth + 1):
        feeds = {b: new for b, g in growing.items()
                 if (new := g.expand(depth)) and g.grows(depth, new)}
        if not feeds:
            break
        logits, first = batch.forward(len(requests), {
            b: [(growing[b].row.tokens[n], growing[b].position(depth), growing[b].sees(n))
                for n in new] for b, new in feeds.items()})
        for b, new in feeds.items():
            growing[b].passes += prior_cost(len(new))
            for j, node in enumerate(new):
                growing[b].row.slots[node] = first + j
            growing[b].set_q(new, logits[b, :len(new)])
    batch.end_round()
    for g in growing.values():
        g.plan.spend(g.passes * g.cost)
    return [growing[b].tree() if b in growing else TokenTree.empty()
            for b in range(len(requests))]


class _Growth:
    """One row's tree as it grows this round, with each frontier node's draft distribution."""

    def __init__(self, request: DraftRequest, row: _Row, base: int, start: int,
                 expansion: Expansion, passes: DraftPasses) -> None:
        self.row = row
        self.base = base  # position of the first pending token in the draft's cache
        row.chain = list(request.context[start:])  # from ``start`` of the context
        self.context = request.context  # committed tokens (read for repetition penalty)
        self.plan = request.plan or RowPlan(request.budget, request.budget)
        self.budget = request.budget
        sampler = request.sampler
        self.params = sampler.params if sampler is not None else _GREEDY
        self.generator = sampler.draft_generator if sampler is not None else None
        self.expansion = expansion
        self.cost = passes.cost
        self.columns, self.vocab_size = passes.columns, passes.vocab_size
        self.frontier: list[int] = []  # nodes (-1: the root) whose children come next
        # [len(frontier), columns] the draft distribution after each, over the passes' columns
        self.frontier_q: torch.Tensor | None = None
        self.cumulative: dict[int, float] = {-1: 1.0}
        self.draft_rows: list[torch.Tensor] = []  # per node: the distribution it was drawn from
        # one-token draft passes this row's feeds cost, about (the first: its pending tokens)
        self.passes = prior_cost(len(row.chain))

    def position(self, depth: int) -> int:
        return self.base + len(self.row.chain) - 1 + depth

    def grows(self, depth: int, new: list[int]) -> bool:
        """Whether the ``new`` nodes just added at ``depth`` get a pass (their children come
        next)."""
        return self.plan.grows(self.expansion, depth, len(self.row.tokens),
                               max(self.cumulative[n] for n in new), self.cost)

    def sees(self, node: int) -> list[int]:
        """Round slots ``node`` attends to: the pending tokens and its ancestors."""
        slots = list(range(len(self.row.chain)))
        ancestors = []
        parent = self.row.parents[node]
        while parent >= 0:
            ancestors.append(self.row.slots[parent])
            parent = self.row.parents[parent]
        return slots + ancestors[::-1]

    def set_q(self, nodes: list[int], logits: torch.Tensor) -> None:
        """The draft distributions after ``nodes`` (processed like the target's)."""
        penalised = self.params.repetition_penalty != 1.0  # only then is the context read
        seen = [self._column_of([*self.context, *self._path(node)]) for node in nodes
                ] if penalised else []
        self.frontier_q = torch.softmax(processed_logits(logits, seen, self.params), dim=-1)
        self.frontier = list(nodes)

    def expand(self, depth: int) -> list[int]:
        """Add the frontier's children at ``depth`` as the expansion plans them."""
        room = self.budget - len(self.row.tokens)
        frontier, self.frontier = self.frontier, []
        if not frontier or room <= 0:
            return []
        q_all = self.frontier_q
        assert q_all is not None
        # the whole frontier's likeliest tokens at once (a few calls a pass, not a few a node)
        top = q_all.topk(min(self.expansion.children_per_node, q_all.shape[-1]))
        ranked, indices = top.values.tolist(), top.indices.cpu()
        likeliest = (indices if self.columns is None else self.columns[indices]).tolist()
        counts = self.expansion.plan([self.cumulative[n] for n in frontier], ranked, room, depth)
        new = []
        for f, (node, count, probs) in enumerate(zip(frontier, counts, ranked)):
            count = min(count, sum(p > 0 for p in probs))  # tokens q can draw
            if count <= 0:
                continue
            q = q_all[f]
            # greedy: the likeliest, in order; sampling: draws from q, in draw order
            children = (zip(likeliest[f][:count], probs[:count]) if self.generator is None
                        else self._drawn(q, count))
            for token, p in children:
                index = len(self.row.tokens)
                self.row.tokens.append(token)
                self.row.parents.append(node)
                self.row.slots.append(None)
                self.draft_rows.append(q)
                self.cumulative[index] = self.cumulative[node] * p
                new.append(index)
        return new

    def tree(self) -> TokenTree:
        sampled = self.params.do_sample and self.draft_rows
        probs = torch.stack(self.draft_rows) if sampled else None
        if probs is not None and self.columns is not None:  # rows over the whole vocabulary
            full = probs.new_zeros(len(probs), self.vocab_size)
            full[:, self.columns.to(probs.device)] = probs
            probs = full
        scores = tuple(self.cumulative[i] for i in range(len(self.row.tokens)))
        tree = TokenTree(tuple(self.row.tokens), tuple(self.row.parents), draft_probs=probs,
                         scores=scores)
        if sampled:  # siblings stay in draw order, as multi-step speculative sampling tries them
            return tree
        # greedy: likeliest paths first, so the sizer's cut to the first nodes keeps the best
        return tree.ranked(scores)

    def _drawn(self, q: torch.Tensor, count: int) -> list[tuple[int, float]]:
        """``count`` draws without replacement from q in draw order (Gumbel top-k with the
        row's draft generator, drawn on the CPU: a seed draws alike on any device): each
        token and its draft probability."""
        assert self.generator is not None
        uniform = torch.rand(q.shape, generator=self.generator, dtype=torch.float64).to(q.device)
        keys = q.double().log() - (-uniform.clamp(min=1e-300).log()).log()
        columns = keys.topk(count).indices
        tokens = columns if self.columns is None else self.columns[columns.cpu()]
        return list(zip(tokens.tolist(), q[columns].tolist()))

    def _column_of(self, tokens: list[int]) -> list[int]:
        """The columns of ``tokens`` (those the passes score)."""
        if self.columns is None:
            return tokens
        ids = torch.as_tensor(tokens, dtype=torch.long)
        where = torch.searchsorted(self.columns, ids).clamp(max=len(self.columns) - 1)
        return where[self.columns[where] == ids].tolist()

    def _path(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(self.row.tokens[node])
            node = self.row.parents[node]
        return path[::-1]
