"""The runner computes on a private copy: the user's model is never written, concurrent decoders
with different settings do not disturb each other, and the weight copy is bounded."""

import copy
import gc
import threading
import weakref

import pytest
import torch

from conftest import tiny_llama
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.target.transformers.runner import Runner, RunnerSettings
from rag_spec_kernels import OneDNNLinear, onednn_available
from test_decoder_greedy import hf_greedy, repetitive_prompt


def module_state(model):
    """Every module's attribute names and child ids, and the config's full dict."""
    return ({name: (sorted(vars(m)), [id(c) for c in m.children()])
             for name, m in model.named_modules()}, copy.deepcopy(model.config.to_dict()),
            model.config._attn_implementation)


def test_decoders_leave_the_users_model_as_it_was():
    model = tiny_llama(seed=2)
    before = module_state(model)
    prompt = repetitive_prompt(0)
    for config in (LookaheadConfig(onednn_linear=True), LookaheadConfig(onednn_linear=False)):
        LookaheadDecoder(model, config=config).generate(prompt, 20)
    ablated(model, cpu_attention=False).generate(prompt, 20)
    assert module_state(model) == before


def test_two_decoders_and_plain_generate_in_three_threads_match_their_solo_runs():
    model = tiny_llama(seed=3)
    before = module_state(model)
    prompts = [repetitive_prompt(s) for s in range(3)]
    decoders = [LookaheadDecoder(model, config=LookaheadConfig(budget=16, onednn_linear=True)),
                LookaheadDecoder(model, config=LookaheadConfig(budget=4, onednn_linear=False),
                                 drafter=TrieDrafter(mode="chains"))]
    jobs = [lambda p: decoders[0].generate(p, 30).token_ids,
            lambda p: decoders[1].generate(p, 30).token_ids,
            lambda p: hf_greedy(model, p, 30)]
    alone = [[job(p) for p in prompts] for job in jobs]
    assert alone[0] == alone[1] == alone[2]  # all three are greedy decoding of one model
    together: list[list] = [[] for _ in jobs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def run(i):
        try:
            start.wait()
            for _ in range(3):
                together[i].append([jobs[i](p) for p in prompts])
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert together == [[alone[i]] * 3 for i in range(len(jobs))]
    assert module_state(model) == before


def test_a_users_linear_wrapper_is_kept_and_still_runs():
    model = tiny_llama(seed=4)
    prompt = repetitive_prompt(1)
    expected = hf_greedy(model, prompt, 20)
    layer = model.model.layers[0].mlp.down_proj
    calls = []
    original = layer.forward

    def wrapper(x):
        calls.append(x.shape)
        return original(x)

    layer.forward = wrapper
    result = LookaheadDecoder(model, config=LookaheadConfig(onednn_linear=True)).generate(
        prompt, 20)
    assert result.token_ids == expected
    assert calls  # the wrapper ran inside rag-spec's decoding too
    assert vars(layer)["forward"] is wrapper


def test_a_wrapped_decoder_layer_gets_dense_masks_and_stays_lossless():
    # The wrapped layer is not copied, so its attention keeps the user's config (stock SDPA),
    # which cannot read a compact tree mask: the runner spells masks out for it.
    model = tiny_llama(seed=4)
    prompts = [repetitive_prompt(s, length=12 + 9 * s) for s in range(3)]
    expected = [hf_greedy(model, p, 20) for p in prompts]
    layer = model.model.layers[1]
    original = layer.forward
    layer.forward = lambda *args, **kwargs: original(*args, **kwargs)
    decoder = LookaheadDecoder(model)
    assert not decoder.runner.tree_attention
    assert [r.token_ids for r in decoder.generate(prompts, 20)] == expected
    assert LookaheadDecoder(tiny_llama(seed=4)).runner.tree_attention  # unwrapped: compact


def test_runner_shares_weights_and_its_attention_config_is_private():
    model = tiny_llama(seed=5)
    runner = Runner.of(model, RunnerSettings(onednn_linear=False))
    assert runner.module is not model
    assert runner.config is not model.config
    assert runner.config._attn_implementation == "rag_spec_tree"
    assert model.config._attn_implementation != "rag_spec_tree"
    ours = dict(runner.module.named_parameters())
    for name, param in model.named_parameters():
        assert ours[name] is param  # shared, not copied
    assert Runner.of(model, RunnerSettings(onednn_linear=False)) is runner  # built once


def test_runner_does_not_keep_the_model_alive():
    model = tiny_llama(seed=6)
    LookaheadDecoder(model).generate(repetitive_prompt(2), 5)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_onednn_copy_is_bounded_by_the_memory_policy(monkeypatch):
    model = tiny_llama(seed=7)
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    linear_bytes = sum(m.weight.numel() * 4 for m in model.modules()
                       if isinstance(m, torch.nn.Linear))
    import rag_spec.target.transformers.runner as runner_module

    monkeypatch.setattr(runner_module, "available_memory", lambda: 3 * linear_bytes)
    small = Runner(model, RunnerSettings(onednn_memory_share=0.25))  # needs 4x the copy
    assert small.extra_bytes == 0
    assert not any(isinstance(m, OneDNNLinear) for m in small.module.modules())
    roomy = Runner(model, RunnerSettings(onednn_memory_share=0.5))
    assert roomy.extra_bytes == linear_bytes
    forced = Runner(model, RunnerSettings(onednn_linear=True, onednn_memory_share=0.01))
    assert forced.extra_bytes == linear_bytes
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())  # the user's tree


def test_a_replaced_layer_is_seen_by_the_next_generation():
    model = tiny_llama(seed=9)
    decoder = LookaheadDecoder(model)
    prompt = repetitive_prompt(3)
    decoder.generate(prompt, 10)
    torch.manual_seed(1)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight.data.normal_(0, 0.5)
    model.lm_head = head  # a new module: the runner's copy must be rebuilt
    assert decoder.generate(prompt, 20).token_ids == hf_greedy(model, prompt, 20)


def test_weights_changed_in_place_are_seen_by_the_next_generation():
    model = tiny_llama(seed=10)
    decoder = LookaheadDecoder(model, config=LookaheadConfig(onednn_linear=True))
    prompt = repetitive_prompt(4)
    before = decoder.generate(prompt, 20).token_ids
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-3)
        model.model.layers[1].self_attn.q_proj.weight.mul_(2)
    expected = hf_greedy(model, prompt, 20)
    assert expected != before  # the change matters
    assert decoder.generate(prompt, 20).token_ids == expected
