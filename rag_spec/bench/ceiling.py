"""How much copying can gain on an answer: the ceiling of drafting by lookup.

A drafter that copies (our trie, transformers' prompt lookup) proposes what followed the last
token somewhere earlier: in the prompt or in the answer so far. ``copy_ceiling`` is the most
tokens per forward pass any such drafter reaches on a given greedy answer: one that always
knew, among every earlier occurrence of the last token, which continuation (of at most
``longest`` tokens) the model would accept. A trie that remembers nothing of other requests
(and is handed no documents beside the prompt) is bounded by it, so a measured
``tokens_per_step`` beside it says how much of what could be copied the trie copied, and
whether a faster answer needs drafts that compute instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from rag_spec.engine.decoder import LookaheadConfig


def copy_ceiling(prompt: Sequence[int], answer: Sequence[int],
                 longest: int = LookaheadConfig.branch_length) -> float:
    """Tokens per forward pass of the best copying drafter on ``answer`` after ``prompt``; the
    prompt's own pass counts, as it commits the answer's first token."""
    return len(answer) / max(copy_passes(prompt, answer, longest), 1)


def copy_passes(prompt: Sequence[int], answer: Sequence[int],
                longest: int = LookaheadConfig.branch_length) -> int:
    """The fewest forward passes that commit ``answer``: each keeps the verifier's own token
    after any prefix of one copied continuation (fewest, not greedy: the longest copy now can
    land where little follows)."""
    tokens = [*prompt, *answer]
    follows: dict[int, list[int]] = {}  # token -> the positions right after it, in order
    for at in range(1, len(tokens)):
        follows.setdefault(tokens[at - 1], []).append(at)
    start, n = len(prompt), len(answer)
    fewest = [0] * (n + 1)  # fewest[i]: passes from answer position i to the end
    for at in range(n - 1, -1, -1):
        now = start + at
        sources = follows.get(tokens[now - 1], []) if now else []
        reach = _longest_copy(tokens, now, sources, min(longest, n - at - 1))
        fewest[at] = 1 + min(fewest[at + 1:at + reach + 2])
    return fewest[0]


def _longest_copy(tokens: list[int], now: int, sources: list[int], most: int) -> int:
    """How many tokens from ``now`` on repeat what followed the same token at one of
    ``sources`` (positions, ascending) before ``now``, at most ``most``."""
    best = 0
    for source in sources:
        if source >= now:
            break
        length = 0
        while (length < most and source + length < now
               and tokens[source + length] == tokens[now + length]):
            length += 1
        best = max(best, length)
    return best
