"""The adaptive budget: drafts stop while they miss, probes back off, a hit restores them."""

from rag_spec.decoding.budget import AdaptiveBudget


def drafting_steps(budget: AdaptiveBudget, steps: int, hits=lambda step: 0) -> list[int]:
    """The steps at which ``budget`` lets a draft through, with ``hits(step)`` accepted."""
    drafted = []
    for step in range(steps):
        nodes = budget.current
        if nodes:
            drafted.append(step)
        budget.update(nodes, hits(step) if nodes else 0)
    return drafted


def test_probes_back_off_while_drafts_keep_missing():
    # Optimistic first steps, then probes at growing intervals: 4, 8, 16, ... up to 64.
    assert drafting_steps(AdaptiveBudget(8), 200) == [0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 192]


def test_a_probe_that_hits_brings_drafting_back():
    drafted = drafting_steps(AdaptiveBudget(8), 80, hits=lambda step: 3 if step == 32 else 0)
    assert 32 in drafted and 33 in drafted  # the hit restored the full budget at once


def test_a_fixed_budget_always_drafts():
    assert len(drafting_steps(AdaptiveBudget(8, adaptive=False), 50)) == 50
