"""The verification seam: from the target's logits over a token tree to the tokens to commit.

``verify`` picks the rule from the sampler and the draft:
- greedy decoding: exact match, the longest path of argmax tokens;
- sampling, drafts without probabilities (the trie): sample-and-match, the longest path of the
  target's own samples (one uniform number per output position), which has plain sampling's
  distribution whatever the draft was;
- sampling, drafts with ``draft_probs`` (draft models): multi-step speculative sampling
  (SpecInfer), which accepts more of a probabilistic draft at the same distribution.

Vocabulary: the *accepted* tokens are draft nodes the target agreed with; then one more token
comes from the target itself: *recovered* where it disagreed with every child of the last
accepted node, *bonus* where that node had no children to check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rag_spec.engine.verify.acceptance import accept, accept_speculative
from rag_spec.target.sampling import RowSampler, target_probs
from rag_spec.target.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """What one row commits after a step."""

    path: list[int]  # [a] accepted node indices, root's child first
    accepted: list[int]  # [a] their tokens
    next_token: int  # the target's token after the path: recovered or bonus
    kind: Literal["recovered", "bonus"]

    @property
    def tokens(self) -> list[int]:
        """Every token to commit, in order."""
        return [*self.accepted, self.next_token]


def verify(logits: torch.Tensor, tree: TokenTree, sampler: RowSampler, context: Sequence[int],
           position: int) -> Verdict:
    """The accepted path of ``tree`` and the token after it.

    Args:
        logits: [1 + n, vocab] target logits for the root then the n nodes of ``tree``.
        sampler: the row's sampler (greedy or sampling, with its own generator).
        context: committed tokens, the root last (repetition penalty reads them).
        position: how many tokens the row has generated (indexes the sampler's uniforms).
    """
    if sampler.params.do_sample and tree.draft_probs is not None:
        probs = target_probs(logits, context, tree, sampler.params)
        path, next_token = accept_speculative(tree, probs, sampler.fresh)
    else:
        path, next_token = accept(tree, sampler.choices(logits, context, tree, position))
    last = path[-1] if path else -1
    kind: Literal["recovered", "bonus"] = "recovered" if tree.children(last) else "bonus"
    return Verdict(path, tree.path_tokens(path), next_token, kind)
