"""The tree KV cache: sliding-window models (every layer, or mixed with full layers), bounded
prefill masks, and refusals that name the fix for caches and attention kinds it cannot handle."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rag_spec.target.transformers.prefill as prefill
import rag_spec.target.transformers.step_inputs as step_inputs
from conftest import TINY_SHAPE, tiny_llama
from rag_spec.engine.decoder import LookaheadDecoder, ablated
from rag_spec.errors import RagSpecError
from rag_spec.policy.budget import AdaptiveBudget
from rag_spec.target.transformers.kv_cache import SlidingWindow, attention_window, cache_argument
from rag_spec.target.transformers.tree_cache import TreeKVCache
from rag_spec.target.tree import TokenTree
from test_decoder_greedy import hf_greedy, repetitive_prompt


def tiny_mistral(window: int = 8):
    """Two layers that attend within a sliding window shorter than the prompts below."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(11)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, sliding_window=window,
                           initializer_range=0.3, pad_token_id=0)
    model = MistralForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("window", [4, 8])
def test_sliding_window_model_matches_generate(window):
    model = tiny_mistral(window)
    decoder = LookaheadDecoder(model)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        expected = hf_greedy(model, prompt, 30)
        assert decoder.generate(prompt, 30).token_ids == expected
    # and the window really matters: full attention would decode something else
    full = tiny_mistral(window)
    full.config.sliding_window = None
    assert any(hf_greedy(full, repetitive_prompt(s), 30) != hf_greedy(model, repetitive_prompt(s),
                                                                     30) for s in range(3))


def test_padded_batch_with_a_window_matches_each_prompt_alone():
    model = tiny_mistral(6)
    prompts = [repetitive_prompt(s, length=15 + 9 * s) for s in range(3)]
    results = LookaheadDecoder(model).generate(prompts, 20)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]


def test_padded_prefill_runs_in_chunks_with_bounded_masks(monkeypatch):
    model = tiny_llama(seed=1)
    prompts = [repetitive_prompt(1, length=12), repetitive_prompt(2, length=40)]
    expected = [hf_greedy(model, p, 15) for p in prompts]
    shapes = []
    forward = prefill.fill

    def spy(runner, tree, ids):
        original = runner.module.forward

        def record(*args, **kwargs):
            mask = kwargs.get("attention_mask")
            shapes.append(None if mask is None else tuple(mask.shape))
            return original(*args, **kwargs)

        runner.module.forward = record  # the runner's private copy, not the user's model
        try:
            forward(runner, tree, ids)
        finally:
            del runner.module.forward

    width = max(len(p) for p in prompts) - 1  # prompt slots before the roots
    monkeypatch.setattr(prefill, "_MASK_ELEMENTS", 2 * width * 10)  # 10 query rows a chunk
    monkeypatch.setattr(prefill, "fill", spy)
    results = LookaheadDecoder(model).generate(prompts, 15)
    assert [r.token_ids for r in results] == expected
    assert len(shapes) == -(-width // 10)
    assert all(s is not None and s[2] <= 10 for s in shapes), shapes


@given(st.lists(st.integers(0, 600), min_size=1, max_size=12))
def test_length_groups_split_rows_only_where_padding_would_cost(lengths):
    groups = prefill.length_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))
    for group in groups:
        tokens = sum(lengths[b] for b in group)
        padding = max(lengths[b] for b in group) * len(group) - tokens
        assert padding <= tokens * prefill._PADDING_SHARE + prefill._PADDING_FREE
    for first, then in zip(groups, groups[1:]):  # the next row would have padded too much
        together = first + then[:1]
        tokens = sum(lengths[b] for b in together)
        padding = max(lengths[b] for b in together) * len(together) - tokens
        assert padding > tokens * prefill._PADDING_SHARE + prefill._PADDING_FREE
    if len(set(lengths)) == 1:
        assert len(groups) == 1


@pytest.mark.parametrize("make", [lambda: tiny_llama(seed=2), lambda: tiny_mistral(6)],
                         ids=["full attention", "sliding window"])
def test_rows_of_very_different_lengths_prefill_in_groups_with_each_rows_tokens(make,
                                                                                 monkeypatch):
    model = make()
    prompts = [(repetitive_prompt(s) * 5)[:n] for s, n in enumerate((4, 160, 30, 170))]
    passes = []
    padded = prefill.padded_prefill
    monkeypatch.setattr(prefill, "padded_prefill", lambda runner, prefixes, *rest: passes.append(
        sorted(map(len, prefixes))) or padded(runner, prefixes, *rest))
    results = LookaheadDecoder(model).generate(prompts, 20)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]
    assert passes == [[3, 29], [159, 169]]


def test_a_group_of_one_token_prompts_has_no_prefix_and_joins_the_others():
    model = tiny_llama(seed=2)
    prompts = [[5], (repetitive_prompt(1) * 5)[:170], [7]]
    assert prefill.length_groups([len(p) - 1 for p in prompts]) == [[0, 2], [1]]
    results = LookaheadDecoder(model).generate(prompts, 20)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]


def tiny_mixed(kind: str, window: int = 6):
    """Sliding-window layers (a window shorter than most prompts below) mixed with full ones:
    Gemma 3's pattern, or Qwen2's first layers full (``max_window_layers``); the same weights
    whatever the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(11)
    if kind == "gemma3":
        kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        config = Gemma3TextConfig(**{**TINY_SHAPE, "num_hidden_layers": 4}, head_dim=16,
                                  sliding_window=window, layer_types=kinds)
        model = Gemma3ForCausalLM(config)
    else:
        config = Qwen2Config(**TINY_SHAPE, use_sliding_window=True, sliding_window=window,
                             max_window_layers=1)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_models_mixing_sliding_and_full_layers_match_generate(kind, monkeypatch):
    model = tiny_mixed(kind)
    assert attention_window(model.config) == SlidingWindow(6, mixed=True)
    per_kind = []
    dense = step_inputs.dense_mask

    def spy(*args):
        per_kind.append(out := dense(*args))
        return out

    for module in (step_inputs, prefill):  # tree steps and padded prefills
        monkeypatch.setattr(module, "dense_mask", spy)
    prompts = [(repetitive_prompt(s) * 2)[:n] for s, n in enumerate((40, 25, 5, 70))]
    expected = [hf_greedy(model, p, 30) for p in prompts]
    decoder = LookaheadDecoder(model)
    assert [decoder.generate(p, 30).token_ids for p in prompts] == expected
    results = decoder.generate(prompts, 30)  # ragged: padded prefills, then one batch
    assert [r.token_ids for r in results] == expected
    # every pass with a dense mask gave one per layer kind, and the kinds' masks differed
    assert per_kind and all(set(masks) == {"full_attention", "sliding_attention"}
                            for masks in per_kind)
    assert any(not torch.equal(masks["full_attention"], masks["sliding_attention"])
               for masks in per_kind)
    # and the window matters: the same weights attending in full decode something else
    full = tiny_mixed(kind, window=256)
    assert [hf_greedy(full, p, 30) for p in prompts] != expected


@pytest.mark.slow
def test_a_model_mixing_sliding_and_full_layers_samples_as_plain_sampling():
    from test_sampling import KNOBS, PROMPT, N, assert_plain_sampling

    model = tiny_mixed("gemma3")  # its window (6) is shorter than the prompt (9 tokens)
    decoder = ablated(model, adaptive=False)
    decoder.drafter.remember(PROMPT + decoder.generate(PROMPT, max_new_tokens=3).token_ids)
    results = decoder.generate([PROMPT] * N, max_new_tokens=2, do_sample=True, seed=99,
                               **KNOBS["temperature"])
    assert sum(sum(r.stats.accepted_per_step) for r in results) > N // 10  # drafts were kept
    assert_plain_sampling(model, results, KNOBS["temperature"])


def test_attention_the_masks_cannot_reach_or_express_is_refused_with_the_reason():
    from transformers import (
        FalconConfig,
        FalconForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
    )

    for model in (Gemma2ForCausalLM(Gemma2Config(**TINY_SHAPE, head_dim=8)),  # soft-capping
                  GptOssForCausalLM(GptOssConfig(**TINY_SHAPE, head_dim=8,
                                                 num_local_experts=2))):  # attention sinks
        with pytest.raises(RagSpecError, match="not what SDPA computes"):
            LookaheadDecoder(model.eval())
    falcon = FalconForCausalLM(FalconConfig(**TINY_SHAPE)).eval()  # its own attention
    with pytest.raises(RagSpecError, match="without transformers' attention functions"):
        LookaheadDecoder(falcon).generate(repetitive_prompt(0), 5)
    chunked = SimpleNamespace(layer_types=["chunked_attention", "full_attention"],
                              sliding_window=None)
    with pytest.raises(RagSpecError, match="cannot mask yet .chunked_attention."):
        attention_window(chunked)
    assert attention_window(SimpleNamespace(sliding_window=8)) == SlidingWindow(8)  # Mistral
    assert attention_window(SimpleNamespace(layer_types=["full_attention"] * 2,
                                            sliding_window=8)) is None


def test_a_cache_whose_layers_evict_entries_is_refused_with_the_fix():
    from transformers import DynamicCache

    model = tiny_mistral(8)
    decoder = LookaheadDecoder(model)
    evicting = DynamicCache(config=model.config)  # sliding-window layers drop old entries
    model(input_ids=torch.tensor([repetitive_prompt(0)[:-1]]), **cache_argument(model, evicting))
    with pytest.raises(RagSpecError, match="new_cache"):
        decoder.extend(evicting, repetitive_prompt(0), 5, decoder.drafter.session([]),
                       AdaptiveBudget(4))


def test_keep_compacts_each_rows_accepted_path():
    from rag_spec.target.transformers.kv_cache import new_cache

    cache = new_cache()
    layer_keys = torch.arange(2 * 6, dtype=torch.float).reshape(2, 1, 6, 1)  # 2 rows, 6 slots
    cache.update(layer_keys.clone(), layer_keys.clone(), 0)
    tree = TreeKVCache(cache, torch.ones(2, 2, dtype=torch.bool), [7, 8], None)
    # slots 2..5 are a step: root plus a 3-node chain; row 0 keeps 2 nodes, row 1 none
    tree.keep([[0, 1], []], [9, 10])
    keys = cache.layers[0].keys[:, 0, :, 0]
    assert keys[0].tolist() == [0, 1, 2, 3, 4]  # root and nodes 0, 1
    assert keys[1, :3].tolist() == [6, 7, 8]  # root only (then a repeat, masked as a hole)
    assert tree.valid.tolist() == [[True] * 5, [True, True, True, False, False]]
    assert tree.positions == [5, 3] and tree.roots == [9, 10]


@st.composite
def steps(draw):
    """A batch's old slots, a tree per row and an accepted path per row (root to some node)."""
    batch = draw(st.integers(1, 4))
    old = draw(st.integers(0, 5))
    valid = [draw(st.lists(st.booleans(), min_size=old, max_size=old)) for _ in range(batch)]
    trees, paths = [], []
    for _ in range(batch):
        size = draw(st.integers(0, 6))
        parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
        tree = TokenTree(tuple(range(size)), tuple(parents))
        node = draw(st.integers(-1, size - 1))
        path = []
        while node >= 0:
            path.insert(0, node)
            node = tree.parents[node]
        trees.append(tree)
        paths.append(path)
    return valid, trees, paths


@settings(max_examples=60, deadline=None)
@given(steps())
def test_keep_matches_a_row_by_row_reference(case):
    from rag_spec.target.transformers.kv_cache import new_cache

    valid_rows, trees, paths = case
    batch, old = len(trees), len(valid_rows[0])
    width = 1 + max(len(t) for t in trees)
    values = torch.arange(batch * (old + width), dtype=torch.float).reshape(batch, 1, -1, 1)
    cache = new_cache()
    cache.update(values.clone(), values.clone(), 0)
    valid = torch.tensor(valid_rows, dtype=torch.bool).reshape(batch, old)
    tree = TreeKVCache(cache, valid, [0] * batch, None)
    before = list(tree.positions)
    tree.keep(paths, list(range(batch)))
    keys = cache.layers[0].keys[:, 0, :, 0]
    for b, path in enumerate(paths):
        kept = [0] + [1 + n for n in path]
        assert keys[b, :old].tolist() == values[b, 0, :old, 0].tolist()  # old slots untouched
        assert keys[b, old:old + len(kept)].tolist() == [values[b, 0, old + k, 0].item()
                                                         for k in kept]
        assert tree.valid[b, old:].tolist() == [i < len(kept) for i in range(tree.length - old)]
        assert tree.positions[b] == before[b] + len(kept)
    assert tree.length == old + max(1 + len(p) for p in paths)


def test_finished_rows_leave_the_cache_and_appends_stay_in_place():
    from rag_spec.target.transformers.kv_cache import new_cache

    cache = new_cache()
    values = torch.arange(3 * 4, dtype=torch.float).reshape(3, 1, 4, 1)  # 3 rows, 4 slots
    cache.update(values.clone(), values.clone(), 0)
    valid = torch.tensor([[False, True, True, True], [True] * 4, [False, False, True, True]])
    tree = TreeKVCache(cache, valid, [7, 8, 9], None)
    tree.keep_rows([2, 0])  # row 1 finished; the others go on, in this order
    layer = cache.layers[0]
    assert layer.keys[:, 0, :, 0].tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]
    assert layer.values[:, 0, :, 0].tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]
    assert tree.valid.tolist() == [valid[2].tolist(), valid[0].tolist()]
    assert tree.roots == [9, 7] and tree.positions == [2, 3]
    slab = layer.slabs[0].data_ptr()
    cache.update(torch.ones(2, 1, 1, 1), torch.ones(2, 1, 1, 1), 0)  # the next pass appends
    assert layer.slabs[0].data_ptr() == slab and layer.keys.shape == (2, 1, 5, 1)


@pytest.mark.parametrize("drafter", ["trie", "early exit", "self-spec", "merged"])
def test_a_batch_whose_rows_finish_apart_gives_each_row_its_tokens(monkeypatch, drafter,
                                                                   flat_step_costs):
    from rag_spec.drafters.merged_drafter import MergedDrafter
    from rag_spec.drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
    from rag_spec.drafters.self_drafter import SelfSpecDrafter

    left = []
    keep_rows = TreeKVCache.keep_rows
    monkeypatch.setattr(TreeKVCache, "keep_rows", lambda cache, rows: left.append(
        cache.valid.shape[0] - len(rows)) or keep_rows(cache, rows))
    model = tiny_llama()
    make = {"trie": lambda: None, "early exit": lambda: EarlyExitDrafter(1),
            "self-spec": lambda: SelfSpecDrafter(budget=8),
            "merged": lambda: MergedDrafter(DraftModelDrafter(tiny_llama(seed=3)), eager=True)}
    decoder = LookaheadDecoder(model, drafter=make[drafter]())
    prompts = [repetitive_prompt(s, length=12 + 5 * s) for s in range(8)]
    results = decoder.generate(prompts, max_new_tokens=30)
    assert left and min(left) > 0  # rows that finished first left the batch (and drafts)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 30) for p in prompts]
