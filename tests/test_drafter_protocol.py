"""The Drafter seam: the decoder drives any drafter, a batch at a time, and reads nothing but
the trees it returns; the verify seam picks the rule and names what it kept."""


import pytest
import torch

from rag_spec.drafters.drafter import (
    Capabilities,
    Drafter,
    DraftRequest,
    TargetView,
    propose_each,
)
from rag_spec.engine.decoder import LookaheadDecoder, ablated
from rag_spec.engine.verify.verify import verify
from rag_spec.errors import RagSpecError
from rag_spec.target.sampling import RowSampler, SamplingParams
from rag_spec.target.tree import TokenTree
from test_decoder_greedy import hf_greedy, repetitive_prompt


class OracleSession:
    """Drafts the known answer (right) or its tokens shifted by one (wrong), as a chain plus a
    decoy branch."""

    def __init__(self, answer, wrong):
        self.answer, self.wrong, self.observed = answer, wrong, []

    def propose(self, context, budget):
        msg = "the decoder must call the drafter's batch propose"
        raise AssertionError(msg)

    def observe(self, context, new_from):
        self.observed.append(len(context) - new_from)

    def finish(self, output):
        pass

    def add_documents(self, documents):
        pass


class OracleDrafter(Drafter):
    def __init__(self, answers, wrong=False):
        self.answers, self.wrong, self.calls = answers, wrong, []
        self.prompts, self.events = [], []

    def begin(self, target):
        self.events.append(("begin", id(target)))

    def end(self, target):
        self.events.append(("end", id(target)))

    def session(self, prompt, extra_context=()):
        self.prompts.append(list(prompt))
        answer = self.answers[tuple(prompt)]
        return OracleSession(answer, self.wrong)

    def propose(self, requests, target):
        assert isinstance(target, TargetView)
        assert target.cache.valid.shape[0] == len(requests)  # the whole batch, one call
        self.calls.append(len(requests))
        trees = []
        for b, r in enumerate(requests):
            done = len(r.context) - len(self.prompts[b])
            chain = [(t + self.wrong) % 64 for t in r.session.answer[done:done + 4]]
            decoy = [(chain[0] + 1) % 64] if chain else []
            trees.append(TokenTree.from_paths([chain, decoy])
                         if chain and r.budget else TokenTree.empty())
        return trees


@pytest.mark.parametrize("wrong", [False, True])
def test_decoder_runs_on_a_fake_drafter_one_call_per_step_for_the_batch(model, wrong):
    prompts = [repetitive_prompt(s, length=20 + 5 * s) for s in range(3)]
    answers = {tuple(p): hf_greedy(model, p, 24) for p in prompts}
    drafter = OracleDrafter(answers, wrong=wrong)
    # trees at their full size: the measured step costs, noisy under load, do not size them
    decoder = ablated(model, drafter=drafter, adaptive=False)
    results = decoder.generate(prompts, 24)
    assert [r.token_ids for r in results] == [answers[tuple(p)] for p in prompts]
    assert set(drafter.calls) == {3}  # every step asked once, for all rows
    (begin, batch), (end, same) = drafter.events  # one batch, begun and ended once
    assert (begin, end) == ("begin", "end") and batch == same
    steps = max(r.stats.steps for r in results)
    assert len(drafter.calls) == steps
    if wrong:
        assert all(sum(r.stats.accepted_per_step) == 0 for r in results)
    else:
        assert all(r.stats.steps <= 24 // 5 + 1 for r in results)  # 4 drafts + 1 per step


def test_a_drafter_that_drafts_row_by_row_declares_the_protocol_or_is_refused(model):
    prompt = repetitive_prompt(2)
    expected = hf_greedy(model, prompt, 15)

    class Session:
        def propose(self, context, budget):
            return TokenTree.from_paths([expected[len(context) - len(prompt):][:3]])

        def observe(self, context, new_from):
            pass

        def finish(self, output):
            pass

        def add_documents(self, documents):
            pass

    class SessionsOnly:  # duck-typed, declaring nothing
        def session(self, prompt, extra_context=()):
            return Session()

    with pytest.raises(RagSpecError, match="is not a Drafter: subclass rag_spec.Drafter"):
        LookaheadDecoder(model, drafter=SessionsOnly())

    class RowByRow(Drafter):
        capabilities = Capabilities(draws_drafts=False)

        def session(self, prompt, extra_context=()):
            return Session()

        def propose(self, requests, target):
            return propose_each(requests)

    result = LookaheadDecoder(model, drafter=RowByRow()).generate(prompt, 15)
    assert result.token_ids == expected
    assert max(result.stats.accepted_per_step) == 3


def test_propose_each_skips_rows_with_no_budget():
    class Session:
        def propose(self, context, budget):
            return TokenTree.from_paths([[1, 2]])

    trees = propose_each([DraftRequest(Session(), [5], 4), DraftRequest(Session(), [5], 0)])
    assert [len(t) for t in trees] == [2, 0]


def logits_for(choices, vocab=8):
    """Logits whose argmax at row i is choices[i]."""
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_verify_names_accepted_recovered_and_bonus():
    tree = TokenTree.from_paths([[5, 6], [5, 7]])  # nodes: 0=5, 1=6, 2=7
    greedy = RowSampler(SamplingParams())
    # the target wants 5, then 4: node 0 accepted, 4 recovered (6 and 7 were checked)
    verdict = verify(logits_for([5, 4, 0, 0]), tree, greedy, [1], 0)
    assert (verdict.path, verdict.accepted, verdict.next_token, verdict.kind) == (
        [0], [5], 4, "recovered")
    # 5 then 7 (node 2, a leaf), then 3: a bonus token
    verdict = verify(logits_for([5, 7, 0, 3]), tree, greedy, [1], 0)
    assert (verdict.path, verdict.tokens, verdict.kind) == ([0, 2], [5, 7, 3], "bonus")
    # an empty draft: the one token is a bonus
    assert verify(logits_for([2]), TokenTree.empty(), greedy, [1], 0).kind == "bonus"


def test_greedy_decoding_draws_nothing_from_torchs_global_rng(model):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    LookaheadDecoder(model).generate(repetitive_prompt(0), 10)
    assert torch.equal(torch.rand(3), expected)


def test_seeded_sampling_leaves_torchs_global_rng_alone(model):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    LookaheadDecoder(model).generate(repetitive_prompt(0), 10, do_sample=True, seed=3)
    assert torch.equal(torch.rand(3), expected)


def test_draft_probs_must_have_one_row_per_node():
    TokenTree((1, 2), (-1, 0), draft_probs=torch.full((2, 8), 0.125))
    with pytest.raises(ValueError, match="one row per token"):
        TokenTree((1, 2), (-1, 0), draft_probs=torch.full((3, 8), 0.125))


def test_drafts_with_probabilities_are_verified_by_speculative_sampling():
    # The draft's q equals the target's p: multi-step speculative sampling accepts every draw
    # (p / q = 1), where matching the target's own samples would keep a 0.3 token 30% of the time.
    logits = torch.log(torch.tensor([[0.3, 0.7, 0.0 + 1e-9]] * 2))
    p = torch.softmax(logits, -1)
    tree = TokenTree((0,), (-1,), draft_probs=p[:1])
    kinds = []
    for seed in range(40):
        sampler = RowSampler(SamplingParams(do_sample=True), seed=seed)
        verdict = verify(logits, tree, sampler, [1], 0)
        assert verdict.path == [0]
        kinds.append(verdict.kind)
    assert set(kinds) == {"bonus"}
