"""The draft head (EAGLE-style self-draft on the target's hidden states): the states it reads are
the model's own, training raises its agreement and leaves the model alone, and decoding with it
is lossless, greedy and sampled."""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_llama
from rag_spec.drafters import feature_drafter
from rag_spec.drafters.draft_head import load_head, save_head
from rag_spec.drafters.feature_drafter import FeatureDrafter
from rag_spec.drafters.merged_drafter import MergedDrafter, _extensions, _merged
from rag_spec.drafters.model_drafter import EarlyExitDrafter
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.errors import RagSpecError
from rag_spec.policy.expansion import Expansion
from rag_spec.target.transformers.prefill import prefill
from rag_spec.target.transformers.runner import Runner
from rag_spec.target.transformers.step_inputs import tree_step
from rag_spec.target.tree import TokenTree
from rag_spec.training.train_head import train_head
from rag_spec_kernels.onednn_linear import OneDNNLinear
from rag_spec_kernels.streamed import streamed_available
from test_decoder_greedy import hf_greedy, repetitive_prompt
from test_sampling import KNOBS, PROMPT, assert_plain_sampling


def sequences(count: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [repetitive_prompt(int(s), length=48)
            for s in torch.randint(0, 999, (count,), generator=g)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4)


@pytest.fixture(scope="module")
def head(target):
    return train_head(target, sequences(), vocabulary=48, epochs=8, lr=5e-3, progress=False)


def test_roots_carry_the_models_last_hidden_state_before_them(target):
    runner = Runner.of(target)
    prompts = [repetitive_prompt(s, length=9 + 5 * s) for s in range(3)]
    trees = [TokenTree.from_paths([[7, 8]]), TokenTree.empty(), TokenTree.from_paths([[3]])]
    with torch.inference_mode():
        cache = prefill(runner, prompts)
        runner.forward(cache, tree_step(cache, trees, runner.dtype), features=True)
        cache.keep([[0, 1], [], [0]], [11, 12, 13])  # rows accept 2, 0 and 1 draft tokens
        reference = tiny_llama(seed=0, layers=4)  # the target's twin: hidden states install
        # hooks on the model asked for them, and later tests check the target has none
        for b, (prompt, path) in enumerate(zip(prompts, ([7, 8], [], [3]))):
            sequence = torch.tensor([prompt + path])
            states = reference(sequence, output_hidden_states=True).hidden_states[-1][0]
            torch.testing.assert_close(cache.root_features[b], states[-1], atol=1e-5, rtol=1e-5)
        cache.keep_rows([2, 0])  # finished rows leave: the others' states follow
    assert cache.root_features.shape[0] == 2


def test_a_head_is_made_and_trained_without_drawing_from_torchs_global_rng(target):
    state = torch.random.get_rng_state()
    train_head(target, sequences(12), vocabulary=48, epochs=1, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_training_raises_agreement_and_leaves_the_model_alone(target, head, tmp_path):
    before, after = head.agreement["untrained"], head.agreement["trained"]
    assert after["top4"] > before["top4"] + 0.1 and after["top1"] > before["top1"]
    config = target.config.to_dict()
    assert all(p.grad is None for p in target.parameters())
    # asking transformers for hidden states installs hooks: on rag-spec's copy, not the model
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in target.modules())
    assert target.config.to_dict() == config
    save_head(head, tmp_path / "head.safetensors")
    loaded = load_head(target, tmp_path / "head.safetensors")
    assert loaded.agreement == head.agreement and torch.equal(loaded.subset, head.subset)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def kept_with_generates_tokens(decoder, target) -> int:
    """Draft tokens ``decoder`` kept over three prompts, each answer asserted ``generate``'s."""
    kept = 0
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        result = decoder.generate(prompt, 30)
        assert result.token_ids == hf_greedy(target, prompt, 30)
        kept += sum(result.stats.accepted_per_step)
    return kept


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_greedy_matches_generate_and_drafts_are_kept(target, head, budget):
    config = LookaheadConfig(budget=budget)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    for merged in (False, True):
        feature = FeatureDrafter(head)
        drafter = MergedDrafter(feature, eager=True) if merged else feature
        decoder = ablated(target, config=config, drafter=drafter, adaptive=False)
        # acceptance was exercised, not only rejection
        assert kept_with_generates_tokens(decoder, target) > 0
        # the head drafted from its own copy: 8-bit where the streamed kernel runs
        stacks = {m.stack for m in feature.head_for(decoder.runner).modules()
                  if isinstance(m, OneDNNLinear)}
        if decoder.runner.stacks and streamed_available(torch.float32):
            assert stacks and all(stack.stored == torch.int8 for stack in stacks)
    # steps asked for hidden states on rag-spec's copy of the model, never on the model itself
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in target.modules())
    # and the caller's head keeps its layers, weights and precision
    assert not any(isinstance(m, OneDNNLinear) for m in head.modules())
    after = head.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_a_single_row_sizes_the_heads_trees_and_carries_their_costs_over(target, head,
                                                                         monkeypatch):
    """The first tree is verified whole (a wide pass's cost is not known yet); later steps
    verify what pays, as for any drafter; a steady drafter's measured pass costs carry over
    the decoder's generations."""
    cuts = []  # (nodes proposed, nodes verified) per step
    first = TokenTree.first
    monkeypatch.setattr(TokenTree, "first", lambda tree, n: cuts.append(
        (len(tree), min(n, len(tree)))) or first(tree, n))
    decoder = LookaheadDecoder(target, drafter=FeatureDrafter(head))
    drafted = 0
    for seed in range(3):
        cuts.clear()
        prompt = repetitive_prompt(seed)
        result = decoder.generate(prompt, 30)
        assert result.token_ids == hf_greedy(target, prompt, 30)
        if seed == 0:  # the first tree (after a step that gave the head its features)
            proposed, verified = next(cut for cut in cuts if cut[0])
            assert verified == proposed
        drafted += result.stats.drafted
    assert drafted > 0
    carried = decoder._policy.costs(decoder.runner, 1, "eager", steady=True)
    assert carried.target  # the pass costs measured, carried over to the next batch


def test_merged_with_the_trie_the_head_is_asked_every_step_copying_or_not(target, head):
    """A draft model is spared while the trie copies; the head's pass costs a few percent of a
    step, and its guesses add to the copies (here they miss: it is asked in probe steps)."""
    steps = []

    class Trie(TrieDrafter):
        def propose(self, requests, view):
            trees = super().propose(requests, view)
            steps.append([len(t) > 0 and int(t.depths.max()) >= 2 for t in trees])
            return trees

    class Head(FeatureDrafter):
        def propose(self, requests, view):
            steps[-1] = [(copying, r.budget > 0) for copying, r in zip(steps[-1], requests)]
            return super().propose(requests, view)

    prompt = repetitive_prompt(5)
    decoder = ablated(target, drafter=MergedDrafter(Head(head), Trie(memory_mb=0)), adaptive=False)
    assert decoder.generate(prompt, 30).token_ids == hf_greedy(target, prompt, 30)
    asked = [row for step in steps for row in step]
    assert asked[0][1]  # from the first step
    assert any(copying and ask for copying, ask in asked)  # and while the trie copied


@pytest.mark.parametrize("depth", [2, 3])
def test_a_deeper_pass_drafts_only_below_a_likely_enough_path(target, head, monkeypatch, depth):
    """``Expansion.grow_prob``: the head drafts a token at ``depth`` only below a path to the
    depth above at least that likely (its cumulative draft probability from the root: the first
    guess's chance for a second token, as the default's four-deep trees use it further down);
    elsewhere the pass's nodes are seldom reached. Greedy output stays ``generate``'s either
    way."""
    trees = []
    propose = FeatureDrafter.propose
    monkeypatch.setattr(FeatureDrafter, "propose", lambda self, requests, view: trees.extend(
        drafted := propose(self, requests, view)) or drafted)

    def drafted_with(grow_prob):
        trees.clear()
        expansion = Expansion(top=4, min_prob=0.0, max_depth=depth, grow_prob=grow_prob,
                              adaptive_depth=False)
        config = LookaheadConfig(budget=8 * (depth - 1))  # room for every depth
        decoder = ablated(target, config=config,
                          drafter=FeatureDrafter(head, expansion=expansion), adaptive=False)
        kept_with_generates_tokens(decoder, target)
        # (the likeliest path's chance a depth above, whether the tree went ``depth`` deep)
        return [(max(p for p, d in zip(t.scores, t.depths) if d == depth - 1),
                 t.depths.max() == depth) for t in trees if len(t) and t.depths.max() >= depth - 1]

    always = drafted_with(0.0)
    assert always and all(deeper for _, deeper in always)
    threshold = sorted(best for best, _ in always)[len(always) // 2]  # the median such path
    gated = drafted_with(threshold)
    assert all(deeper == (best >= threshold) for best, deeper in gated)
    assert {deeper for _, deeper in gated} == {True, False}  # both happened
    with pytest.raises(ValueError, match="grow_prob"):
        Expansion(grow_prob=1.5)


def test_drafting_over_the_heads_columns_drafts_what_the_whole_vocabulary_would(
        target, head, monkeypatch):
    """The head scores a subset of the vocabulary, and drafting ranks, normalises and
    penalises those columns alone: the trees are those drafted over the whole vocabulary
    (-inf outside the subset), repetition penalty included."""
    trees = []
    propose = FeatureDrafter.propose
    monkeypatch.setattr(FeatureDrafter, "propose", lambda self, requests, view: trees.extend(
        drafted := propose(self, requests, view)) or drafted)

    def drafted():
        trees.clear()
        expansion = Expansion(top=4, min_prob=0.0, max_depth=2, adaptive_depth=False)
        decoder = ablated(target, config=LookaheadConfig(budget=8),
                          drafter=FeatureDrafter(head, expansion=expansion), adaptive=False)
        for penalty in (1.0, 1.3):
            decoder.generate(repetitive_prompt(1), 20, repetition_penalty=penalty)
        return [(t.tokens, t.parents, t.scores) for t in trees if len(t)]

    columns = drafted()
    init = feature_drafter._HeadPasses.__init__

    def whole_vocabulary(self, draft_head, view):
        init(self, draft_head, view)
        self.columns, fast = None, self.head
        self.head = SimpleNamespace(advance=fast.advance, lm_head=SimpleNamespace(
            readout=fast.lm_head))  # the full-vocabulary logits, -inf outside the subset

    monkeypatch.setattr(feature_drafter._HeadPasses, "__init__", whole_vocabulary)
    whole = drafted()
    assert len(columns) == len(whole) > 0
    for (tokens, parents, scores), (tokens_, parents_, scores_) in zip(columns, whole):
        assert (tokens, parents) == (tokens_, parents_)
        assert scores == pytest.approx(scores_, rel=1e-5)


def test_a_greedy_rows_head_may_draft_the_whole_budget_a_sampled_rows_half(target, head,
                                                                           monkeypatch):
    """Beside the trie's copies, a greedy row's merged tree is ranked and cut, so the head
    (whose pass costs the same for more nodes) offers a full budget and the ranking chooses;
    a sampled row's tree is not ranked, so the head keeps to what the trie left, or half."""
    budgets = []
    propose = FeatureDrafter.propose
    monkeypatch.setattr(FeatureDrafter, "propose", lambda self, requests, view: budgets.append(
        [r.budget for r in requests]) or propose(self, requests, view))
    decoder = ablated(target, config=LookaheadConfig(budget=16),
                      drafter=MergedDrafter(FeatureDrafter(head)), adaptive=False)
    prompt = repetitive_prompt(5)  # the trie copies most of it
    assert decoder.generate(prompt, 30).token_ids == hf_greedy(target, prompt, 30)
    asked = [b for step in budgets for b in step if b]
    assert asked and set(asked) == {16}
    budgets.clear()
    decoder.generate(prompt, 30, do_sample=True, temperature=0.8, seed=0)
    asked = [b for step in budgets for b in step if b]
    assert asked and min(asked) >= 8 and min(asked) < 16


def test_a_greedy_rows_merged_tree_ranks_every_node_by_its_chance():
    """The sizer verifies a tree's first nodes: a greedy row's are ranked by their chance of
    being accepted (a guess's draft probability, a copy's ``_COPY_CHANCE`` shrinking by
    ``_DEEPER`` a depth and by how often its token followed, never above its parent's; a token
    both drafted, the two chances combined); a sampled row's draws lead, as multi-step
    speculative sampling tries them, then the copies after them and the context's."""
    copy = TokenTree.from_paths([[7, 8, 9]])
    after_five = [((5,), TokenTree.from_paths([[11]]))]
    sure = TokenTree((5, 6), (-1, -1), scores=(0.6, 0.3))
    # 5 (0.6), 7 (0.45), 11 after 5 (0.42), 8 (0.315); 6 (0.3) and 9 (0.22) are cut
    assert _merged(sure, copy, after_five, budget=4).tokens == (5, 7, 11, 8)
    unsure = TokenTree((5, 6), (-1, -1), scores=(0.2, 0.1))
    assert _merged(unsure, copy, after_five, budget=4).tokens == (7, 8, 9, 5)
    # a copy whose 8 followed 7 once in four: 7 (0.45), 5 (0.2), 11 (0.14), 6 (0.1); 8 (0.08) cut
    rare = TokenTree((7, 8, 9), (-1, 0, 1), scores=(1.0, 0.25, 0.25))
    assert _merged(unsure, rare, after_five, budget=4).tokens == (7, 5, 11, 6)
    # a copy that has held three tokens likely goes on: its fourth (0.22) beats a 0.2 guess
    held = TokenTree.from_paths([[7, 8, 9, 10]])
    assert _merged(TokenTree((5,), (-1,), scores=(0.2,)), held, [], budget=4).tokens == (
        7, 8, 9, 10)
    # a guess the context also copies: 7 is 1 - 0.7 * 0.55 = 0.615 likely, its copied 8 0.43,
    # both above the likelier guess 6 (0.35)
    both = TokenTree((6, 7), (-1, -1), scores=(0.35, 0.3))
    assert _merged(both, TokenTree.from_paths([[7, 8]]), [], budget=2).tokens == (7, 8)
    drawn = TokenTree((5, 6), (-1, -1), draft_probs=torch.full((2, 12), 1 / 12),
                      scores=(0.1, 0.1))
    assert _merged(drawn, copy, after_five, budget=4).tokens == (5, 6, 11, 7)
    assert _merged(TokenTree.empty(), copy, [], budget=4) is copy


def test_the_trie_copies_what_follows_the_models_likeliest_guesses():
    """A guess the context has no copy after yet (here 2 after 9) still leads into one: what
    followed the guess in the prompt."""
    session = TrieDrafter(memory_mb=0).session([1, 2, 3, 4, 5])
    guess = TokenTree((2, 7), (-1, -1), scores=(0.5, 0.2))
    assert session.propose([9], 4) == TokenTree.empty()
    assert _extensions(guess, session, [9]) == [((2,), TokenTree.from_paths([[3, 4, 5]])),
                                                ((7,), TokenTree.empty())]


def test_merged_with_the_head_the_rows_budgets_are_steady_as_the_heads(target, head):
    """The head's hits come about independently step to step, and the trie's copies beside
    them cost nothing to draft; a draft model's merged trees keep the trie's reading."""
    assert MergedDrafter(FeatureDrafter(head)).capabilities.steady
    assert FeatureDrafter(head).capabilities.steady
    assert not MergedDrafter(EarlyExitDrafter(1)).capabilities.steady


def test_estimates_carry_to_the_next_greedy_generation_never_to_a_sampled_one(target, head):
    decoder = LookaheadDecoder(target, drafter=FeatureDrafter(head))
    prompt = repetitive_prompt(4)
    def sampled():
        return decoder.generate(prompt, 20, do_sample=True, temperature=0.8, seed=3).token_ids

    first = sampled()  # seeded sampling gives the same tokens whatever ran before it
    for seed in range(3):  # greedy generations teach the next ones, and stay generate's
        assert decoder.generate(repetitive_prompt(seed), 20).token_ids == hf_greedy(
            target, repetitive_prompt(seed), 20)
    assert sampled() == first


def test_a_ragged_batch_gives_each_row_its_tokens_alone(target, head):
    prompts = [repetitive_prompt(s, length=10 + 7 * s) for s in range(4)]
    results = LookaheadDecoder(target, drafter=FeatureDrafter(head)).generate(prompts, 25)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 25) for p in prompts]
    sampled = LookaheadDecoder(target, drafter=FeatureDrafter(head)).generate(
        prompts, 25, do_sample=True, temperature=0.8, seed=5)
    alone = [LookaheadDecoder(target, drafter=FeatureDrafter(head)).generate(
        p, 25, do_sample=True, temperature=0.8, seed=5 + b).token_ids
        for b, p in enumerate(prompts)]
    assert [r.token_ids for r in sampled] == alone


@pytest.mark.slow
def test_sampling_keeps_the_distribution(model):
    small = train_head(model, sequences(), vocabulary=48, epochs=2, lr=5e-3, progress=False)
    knobs = KNOBS["temperature"]
    decoder = ablated(model, drafter=FeatureDrafter(small), adaptive=False)
    results = decoder.generate([PROMPT] * 4000, max_new_tokens=3, do_sample=True, seed=7,
                               **knobs)
    assert sum(sum(r.stats.accepted_per_step) for r in results) > 400  # drafts were kept
    assert_plain_sampling(model, results, knobs)


@pytest.mark.slow
def test_compiled_steps_return_the_states_it_reads_and_give_generates_tokens(target, head):
    config = LookaheadConfig(compile=True, exact=False, budget=5)
    decoder = ablated(target, config=config, drafter=FeatureDrafter(head), adaptive=False)
    assert decoder.runner.compiled.features_split
    assert kept_with_generates_tokens(decoder, target) > 0


def test_compiled_steps_refuse_it_with_the_fix_where_logits_are_more_than_the_head(target,
                                                                                  head):
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):  # as models that scale or cap their logits do
        @functools.wraps(LlamaForCausalLM.forward)  # its parameters, as callers read them
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    scaled = Scaled(target.config).eval()
    scaled.load_state_dict(target.state_dict())
    decoder = LookaheadDecoder(scaled, config=LookaheadConfig(compile=True, exact=False),
                               drafter=FeatureDrafter(head))
    assert not decoder.runner.compiled.features_split
    with pytest.raises(RagSpecError, match="compile=False"):
        decoder.generate(repetitive_prompt(0), 5)


def test_a_published_head_is_the_default_drafter_for_its_model_only(target, head, tmp_path,
                                                                    monkeypatch):
    from rag_spec.drafters.draft_head import find_head, model_fingerprint, publish_head

    monkeypatch.setenv("RAG_SPEC_CACHE", str(tmp_path))  # this test's heads only
    assert LookaheadDecoder(target).drafter.label == "trie"  # nothing trained yet
    path = publish_head(target, head)
    assert path is not None and path.stem == model_fingerprint(target)
    decoder = LookaheadDecoder(target)
    assert decoder.drafter.label == "draft head + trie"
    prompt = repetitive_prompt(3)
    result = decoder.generate(prompt, 24)
    assert result.token_ids == hf_greedy(target, prompt, 24)
    assert result.stats.drafts == "draft head + trie"
    assert LookaheadDecoder(target, drafter=TrieDrafter()).drafter.label == "trie"  # as asked
    # another model (other weights, same shape) finds none; so does this one fine-tuned
    assert find_head(tiny_llama(seed=1, layers=4)) is None
    tuned = tiny_llama(seed=0, layers=4)
    with torch.no_grad():
        tuned.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    assert LookaheadDecoder(tuned).drafter.label == "trie"


def test_a_head_published_under_the_older_fingerprint_is_found_and_renamed(target, head,
                                                                          tmp_path, monkeypatch):
    """Heads published before the fingerprint read each weight's first values (so as not to
    page a file-loaded model's weights in) were named by values spread over each weight."""
    from rag_spec.drafters.draft_head import _spread_fingerprint, find_head, model_fingerprint

    monkeypatch.setenv("RAG_SPEC_CACHE", str(tmp_path))
    older = _spread_fingerprint(target)
    assert older != model_fingerprint(target)
    published = copy.deepcopy(head)  # the fixture's head is shared
    published.trained_for = older
    path = tmp_path / "heads" / f"{older}.safetensors"
    path.parent.mkdir()
    save_head(published, path)
    found = find_head(target)
    assert found is not None and found.trained_for == model_fingerprint(target)
    assert not path.exists()
    assert (tmp_path / "heads" / f"{model_fingerprint(target)}.safetensors").is_file()
    assert LookaheadDecoder(target).drafter.label == "draft head + trie"


def test_the_fingerprint_reads_a_model_alike_in_float32_and_bfloat16(target):
    from rag_spec.drafters.draft_head import model_fingerprint

    half = tiny_llama(seed=0, layers=4).to(torch.bfloat16)
    assert model_fingerprint(half) == model_fingerprint(target)


def test_a_damaged_or_foreign_head_leaves_the_trie_to_draft(target, head, tmp_path, monkeypatch,
                                                             caplog):
    from rag_spec.drafters.draft_head import model_fingerprint

    monkeypatch.setenv("RAG_SPEC_CACHE", str(tmp_path))
    path = tmp_path / "heads" / f"{model_fingerprint(target)}.safetensors"
    path.parent.mkdir()
    path.write_bytes(b"not a safetensors file")
    assert LookaheadDecoder(target).drafter.label == "trie"
    assert "could not be read" in caplog.text
    other = tiny_llama(seed=2, layers=4)
    save_head(train_head(other, sequences(12), vocabulary=48, epochs=1, progress=False), path)
    with pytest.raises(RagSpecError, match="trained for another model"):
        load_head(target, path)
    assert LookaheadDecoder(target).drafter.label == "trie"


def test_a_head_saved_in_half_precision_loads_into_the_models_dtype(target, head, tmp_path):
    path = tmp_path / "half.safetensors"
    save_head(head, path, dtype=torch.float16)
    loaded = load_head(target, path)
    assert loaded.fc.weight.dtype == target.dtype
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight, atol=1e-3, rtol=1e-3)


def test_every_shipped_head_is_small_and_names_the_model_it_was_trained_for():
    from safetensors import safe_open

    from rag_spec.drafters.draft_head import SHIPPED

    shipped = sorted(SHIPPED.glob("*.safetensors"))
    assert shipped  # the embedded model's (python -m lab.ship_head)
    for path in shipped:
        assert path.stat().st_size < 10 * 2**20
        with safe_open(str(path), framework="pt") as file:
            assert file.metadata()["trained_for"] == path.stem


def test_training_that_stopped_goes_on_from_its_last_epoch_to_the_same_head(target, tmp_path,
                                                                            monkeypatch, capsys):
    import rag_spec.training.train_head as training

    texts = sequences(20)
    whole = train_head(target, texts, vocabulary=48, epochs=3, lr=5e-3, progress=False)
    real, calls = training._loss, []

    def loss(*args):
        calls.append(1)
        if stop and len(calls) == 25:  # in the second epoch (18 texts each, 2 held out)
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(training, "_loss", loss)
    checkpoint, stop = tmp_path / "head.partial", True
    with pytest.raises(KeyboardInterrupt):
        train_head(target, texts, vocabulary=48, epochs=3, lr=5e-3, progress=False,
                   checkpoint=checkpoint)
    assert checkpoint.is_file()
    stop, calls[:] = False, []
    resumed = train_head(target, texts, vocabulary=48, epochs=3, lr=5e-3, progress=False,
                         checkpoint=checkpoint)
    assert len(calls) == 2 * 18  # the first epoch was kept
    assert not checkpoint.exists()
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    checkpoint.write_bytes(b"cut short")  # unreadable: said, trained afresh, the same head
    calls[:] = []
    again = train_head(target, texts, vocabulary=48, epochs=3, lr=5e-3, progress=False,
                       checkpoint=checkpoint)
    assert len(calls) == 3 * 18
    assert "could not be taken up" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                 again.state_dict().values()))
