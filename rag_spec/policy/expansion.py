"""How a draft model's token tree grows, one depth per forward pass, within the node budget:
how many children each node gets, and whether a depth gets a pass at all.

Two policies, compared by ``rag-spec bench draft``:
- *dynamic* (EAGLE-2, SuffixDecoding): at each depth, the new nodes are the ``top`` child slots
  of the whole frontier with the highest cumulative draft probability, down to ``min_prob``;
- *fixed* (SpecInfer's expansion configs): every frontier node gets ``widths[depth - 1]``
  children.

A slot's score is its parent's cumulative probability times the parent's ``j``-th largest draft
probability, known before the child is drawn. That matters for sampling: which children exist
must not depend on the tokens drawn for them, or multi-step speculative sampling would see
children that are not draws from q.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rag_spec.policy.budget import depth_pays


@dataclass(frozen=True)
class Expansion:
    """The shape of a draft model's trees.

    Examples:
        >>> Expansion().plan([1.0], [[0.6, 0.3, 0.1]], budget=8, depth=1)     # dynamic
        [3]
        >>> Expansion(widths=(1, 1, 3)).plan([0.5, 0.2], [[0.9, 0.05, 0.01]] * 2, budget=4, depth=3)
        [3, 1]
    """

    widths: tuple[int, ...] | None = None  # fixed: children per node at each depth; None: dynamic
    top: int = 4  # dynamic: most new nodes per depth (and children per node)
    min_prob: float = 0.02  # dynamic: slots whose cumulative draft probability is lower stay out
    max_depth: int = 6  # deepest draft
    # grow a depth only while the path there is likelier to be accepted (as measured) than the
    # draft pass costs in target steps; False: always draft max_depth deep
    adaptive_depth: bool = True
    # and only past a node this likely by its draft probabilities (0: any): where the drafter
    # is unsure even of its best path, a deeper pass's nodes are seldom reached
    grow_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.widths is not None and (not self.widths or min(self.widths) < 1):
            msg = "Expansion widths need at least one depth, each with at least one child."
            raise ValueError(msg)
        if self.top < 1 or self.max_depth < 1:
            msg = "Expansion needs top >= 1 and max_depth >= 1."
            raise ValueError(msg)
        if not 0.0 <= self.grow_prob <= 1.0:
            msg = f"Expansion needs 0 <= grow_prob <= 1 (a probability), not {self.grow_prob}."
            raise ValueError(msg)

    @property
    def children_per_node(self) -> int:
        """Most children any node gets: how many ranked draft probabilities ``plan`` reads."""
        return max(self.widths) if self.widths is not None else self.top

    def grows(self, depth: int, nodes: int, budget: int, likeliest: float,
              mean_accepted: float, cost: float) -> bool:
        """Whether the nodes just added at ``depth`` get a pass (their children come next):
        within ``max_depth`` and the ``budget`` (``nodes`` drafted so far), below a node at
        least ``grow_prob`` likely (``likeliest``: the new nodes' best path probability), and
        where the depth pays for a pass at ``cost`` target steps while ``mean_accepted`` of a
        round's draft tokens are kept (``budget.depth_pays``)."""
        return (depth < self.max_depth and nodes < budget and likeliest >= self.grow_prob
                and (not self.adaptive_depth or depth_pays(mean_accepted, depth, cost)))

    def plan(self, cumulative: Sequence[float], ranked: Sequence[Sequence[float]], budget: int,
             depth: int) -> list[int]:
        """How many children each frontier node gets at ``depth``.

        Args:
            cumulative: [F] each frontier node's cumulative draft probability (1 for the root).
            ranked: [F][<= children_per_node] each node's largest draft probabilities,
                descending.
            budget: most nodes this depth may add.
            depth: the depth of the children (1 below the root).
        """
        if self.widths is not None:
            width = self.widths[depth - 1] if depth <= len(self.widths) else 1
            counts = []
            for probs in ranked:
                counts.append(max(0, min(width, len(probs), budget)))
                budget -= counts[-1]
            return counts
        slots = sorted(((c * p, node) for node, (c, probs) in enumerate(zip(cumulative, ranked))
                        for p in probs[:self.top]), reverse=True)
        counts = [0] * len(ranked)
        for score, node in slots[:min(self.top, budget)]:
            if score < self.min_prob:
                break
            counts[node] += 1  # a node's slots are taken best first: its largest draws
        return counts
