"""Compiled verification steps (``LookaheadConfig(compile=True)``): a static KV cache and
torch.compile, with generate's greedy tokens for every drafter kind, batches of one prompt
length and of several (left-padded), and the user's model left alone."""

import itertools
import subprocess
import sys

import pytest
import torch

from conftest import char_tokenizer, tiny_llama
from rag_spec.drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
from rag_spec.drafters.self_drafter import SelfSpecDrafter
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.errors import RagSpecError
from rag_spec.models import LoadedModel
from rag_spec.serving.local_lm import GenerateOptions, LocalLM
from rag_spec.target.transformers import passes
from rag_spec_kernels import TracedLinear
from test_decoder_greedy import hf_greedy, repetitive_prompt

pytestmark = pytest.mark.slow  # compiles steps: seconds each

COMPILED = LookaheadConfig(compile=True)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4)


DRAFTERS = {
    "trie": lambda: None,
    "draft model": lambda: DraftModelDrafter(tiny_llama(seed=0, layers=2)),
    # drafts in a round of its own on the target's (static) cache, then discards it
    "early exit": lambda: EarlyExitDrafter(2),
    # sparse passes on the target's cache: a sink-and-window view through the dense mask
    "self-speculation": lambda: SelfSpecDrafter(budget=8, sinks=2),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_compiled_steps_give_generates_greedy_tokens(target, name):
    decoder = LookaheadDecoder(target, config=COMPILED, drafter=DRAFTERS[name]())
    steps = []
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        result = decoder.generate(prompt, 30)
        assert result.token_ids == hf_greedy(target, prompt, 30)
        steps.append(result.stats.steps)
    assert decoder.runner.compiled is not None
    if name == "trie":  # the repeats were drafted and kept: steps were trees, not one token
        assert min(steps) < 30
    ragged = [repetitive_prompt(s, length=12 + 9 * s) for s in range(3)]  # left-padded
    results = decoder.generate(ragged, 24)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 24) for p in ragged]
    assert {r.stats.passes for r in results} == {"compiled"}


def test_batches_of_one_prompt_length_and_of_several_decode_compiled_with_generates_tokens(
        target):
    decoder = LookaheadDecoder(target, config=COMPILED)
    same = [repetitive_prompt(s, length=24) for s in range(3)]  # written into a static cache
    ragged = [repetitive_prompt(s, length=10 + 7 * s) for s in range(3)]  # copied, left-padded
    # lengths far apart: prefilled in groups, joined, then copied
    apart = [repetitive_prompt(3, length=8), repetitive_prompt(4) * 6, repetitive_prompt(5)]
    for prompts in (same, ragged, apart):
        results = decoder.generate(prompts, 20)
        assert [r.token_ids for r in results] == [hf_greedy(target, p, 20) for p in prompts]
        assert {r.stats.passes for r in results} == {"compiled"}


def test_a_static_batch_whose_rows_accept_unequal_paths_stays_inside_its_cache(target):
    # a step takes as many slots as its longest accepted path: rows that copy long runs leave
    # holes in the others' slots, which once overran the cache a batch was given
    decoder = ablated(target, config=LookaheadConfig(compile=True), adaptive=False)
    prompts = [repetitive_prompt(s, length=24) for s in range(3)]
    prompts += [torch.randint(3, 64, (24,), generator=torch.Generator().manual_seed(s)).tolist()
                for s in range(2)]
    results = decoder.generate(prompts, 80)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 80) for p in prompts]
    steps = [r.stats.accepted_per_step for r in results]
    longest = [max(kept) for kept in itertools.zip_longest(*steps, fillvalue=0)]
    holes = [sum(most - kept for most, kept in zip(longest, row)) for row in steps]
    # more holes in a row than the two rounds' spare slots a single row's cache keeps
    assert max(holes) > 2 * (decoder.config.budget + 1)


def test_compiling_leaves_the_users_model_alone():
    model = tiny_llama(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    LookaheadDecoder(model, config=COMPILED).generate(repetitive_prompt(0), 10)
    assert all((model.state_dict()[k] == v).all() for k, v in state.items())
    assert model.config.to_dict() == config
    assert not any("forward" in vars(m) or "_compiled_call_impl" in vars(m) and
                   m._compiled_call_impl is not None for m in model.modules())


def test_exact_numerics_cannot_be_compiled():
    with pytest.raises(RagSpecError, match="exact=False"):
        LookaheadDecoder(tiny_llama(), config=LookaheadConfig(compile=True, exact=True))
    # "auto" asks for exact numerics in bfloat16; with compile it gives way
    model = tiny_llama().to(torch.bfloat16)
    assert not LookaheadDecoder(model, config=COMPILED).runner.exact


def test_a_static_cache_is_given_back_and_lent_again_its_old_entries_masked(target):
    decoder = LookaheadDecoder(target, config=COMPILED)
    first, second = repetitive_prompt(0, length=24), repetitive_prompt(1, length=24)
    assert decoder.generate(first, 20).token_ids == hf_greedy(target, first, 20)
    lent = decoder.runner.compiled._spare
    assert lent is not None
    assert decoder.generate(second, 20).token_ids == hf_greedy(target, second, 20)
    assert decoder.runner.compiled._spare[1] is lent[1]  # the same tensors: graphs replay


def compiled_widths(step):
    """The widths of the passes ``step`` will run compiled, recorded as they run."""
    widths = []
    forward = step._compiled
    step._compiled = lambda **inputs: widths.append(inputs["input_ids"].shape[1]) or \
        forward(**inputs)
    return widths


def traced_layers(step):
    return [m for m in step.module.modules() if isinstance(m, TracedLinear)]


def test_with_cuda_graphs_every_pass_runs_compiled_and_tokens_stay_generates(monkeypatch):
    model = tiny_llama(seed=5, layers=3)  # a runner of its own: its step is changed below
    decoder = LookaheadDecoder(model, config=COMPILED)
    step = decoder.runner.compiled
    step.graphs = True  # as on a GPU: all widths compiled, padded, slots in steps of 256
    step._wide = False  # not through oneDNN's products
    assert [step.bucket(w) for w in range(1, 19)] == [1, 2, 4, 4, *[8] * 4, *[16] * 8, 24, 24]
    widths = compiled_widths(step)
    trees = []  # each pass's own width, before padding
    padded = passes.padded_inputs
    monkeypatch.setattr(passes, "padded_inputs", lambda inputs, width: trees.append(
        inputs["input_ids"].shape[1]) or padded(inputs, width))
    for seed in range(2):
        prompt = repetitive_prompt(seed)
        assert decoder.generate(prompt, 30).token_ids == hf_greedy(model, prompt, 30)
    assert max(widths) > 1  # trees ran compiled too
    assert set(widths) <= {1, 2, 4, 8, 16, 24}  # padded to a few widths: a few graphs
    assert set(trees) - set(widths)  # some trees were padded (and their tokens kept exact)
    assert step._spare is not None and step._spare[0][1] % 256 == 0


def test_with_onednn_every_pass_runs_compiled_on_the_eager_layers_reordered_weights():
    model = tiny_llama(seed=6, layers=3)
    decoder = LookaheadDecoder(model, config=COMPILED)
    runner = decoder.runner
    if not runner.stacks:
        pytest.skip("oneDNN is not available in this torch build")
    step = runner.compiled
    assert step.wide and not step.graphs
    traced = traced_layers(step)
    assert {id(m.stack) for m in traced} == {id(stack) for stack in runner.stacks}  # no copy
    widths = compiled_widths(step)
    prompt = repetitive_prompt(1)
    assert decoder.generate(prompt, 30).token_ids == hf_greedy(model, prompt, 30)
    assert max(widths) > 1  # trees ran compiled too


def test_without_onednn_one_token_steps_run_compiled_on_the_stock_weights():
    model = tiny_llama(seed=7, layers=3)
    decoder = LookaheadDecoder(model, config=LookaheadConfig(compile=True, onednn_linear=False))
    step = decoder.runner.compiled
    assert not step.wide and not decoder.runner.stacks
    traced = traced_layers(step)
    assert traced and all(m.stack is None for m in traced)  # single rows reduce, no copy
    widths = compiled_widths(step)
    prompt = repetitive_prompt(2)
    assert decoder.generate(prompt, 30).token_ids == hf_greedy(model, prompt, 30)
    assert widths and set(widths) == {1}  # trees stay on the eager kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (make gpu-check)")
def test_on_a_gpu_graphs_replay_across_generations_and_batches_with_generates_tokens():
    model = tiny_llama(seed=5, layers=3).cuda()  # fp32: compiled kernels round as eager ones
    decoder = LookaheadDecoder(model, config=COMPILED)
    assert decoder.runner.compiled.graphs
    caches = []
    for seed in range(3):  # prompts of different lengths, one capacity: the same graphs
        prompt = repetitive_prompt(seed, length=20 + 6 * seed)
        assert decoder.generate(prompt, 30).token_ids == hf_greedy(model, prompt, 30)
        caches.append(decoder.runner.compiled._spare[1])
    assert caches[0] is caches[1] is caches[2]
    prompts = [repetitive_prompt(s, length=24) for s in range(3)]
    results = decoder.generate(prompts, 20)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]


def test_a_stream_closed_early_gives_its_static_cache_back(tokenizer):
    decoder = LookaheadDecoder(tiny_llama(vocab_size=len(tokenizer)), tokenizer, COMPILED)
    prompt = tokenizer("the cat sat on the mat. the cat")["input_ids"]
    stream = decoder.stream(prompt, max_new_tokens=30)
    pieces = iter(stream)  # kept: dropping it would close the stream too
    next(pieces)
    assert decoder.runner.compiled._spare is None  # lent to the stream
    stream.close()
    assert decoder.runner.compiled._spare is not None


@pytest.fixture
def new_process():
    """Start from no compiled code, as a new process does: a same-shaped model in an earlier
    test leaves code that dynamo's guards accept, and a count of compilations would see none."""
    torch._dynamo.reset()


@pytest.mark.usefixtures("new_process")
def test_a_generation_compiles_one_graph_for_one_token_passes_and_one_for_trees():
    from torch._dynamo.utils import counters

    model = tiny_llama(seed=8, layers=2)
    decoder = LookaheadDecoder(model, config=COMPILED)
    if not decoder.runner.stacks:
        pytest.skip("oneDNN is not available in this torch build")
    widths = compiled_widths(decoder.runner.compiled)
    before = counters["stats"]["unique_graphs"]
    for seed in range(3):  # three prompt lengths: three cache sizes
        decoder.generate(repetitive_prompt(seed, length=12 + 9 * seed), 30)
    assert 1 in widths and max(widths) > 1
    # a second graph for a state the first pass left behind would cost a compilation (~15 s)
    assert counters["stats"]["unique_graphs"] - before == 2


@pytest.mark.usefixtures("new_process")
def test_a_warmed_up_decoder_compiles_nothing_for_its_first_request():
    from torch._dynamo.utils import counters

    model = tiny_llama(seed=9, layers=2)
    decoder = LookaheadDecoder(model, config=COMPILED)
    before = counters["stats"]["unique_graphs"]
    assert decoder.warm_up(progress=False) > 0
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > before
    prompt = repetitive_prompt(3, length=40)
    assert decoder.generate(prompt, 20).token_ids == hf_greedy(model, prompt, 20)
    assert counters["stats"]["unique_graphs"] == compiled
    assert decoder.drafter.memory.nodes > 0  # it remembers its outputs ...
    fresh = LookaheadDecoder(model, config=COMPILED, drafter=type(decoder.drafter)())
    fresh.warm_up(progress=False)
    assert fresh.drafter.memory.nodes == 0  # ... but not the made-up prompts' answers


@pytest.mark.usefixtures("new_process")
def test_a_service_warmed_up_compiles_nothing_for_its_first_request():
    from torch._dynamo.utils import counters

    lm = LoadedModel(tiny_llama(seed=10, vocab_size=35), char_tokenizer(), "tiny",
                     torch.device("cpu"), torch.float32)
    lm.tokenizer.chat_template = None
    local = LocalLM(lm, COMPILED, batch_wait_ms=1)
    before = counters["stats"]["unique_graphs"]
    local.warm_up(progress=False)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > before
    local.generate(["the cat sat on the mat, the cat sat"], GenerateOptions(max_new_tokens=12))
    assert counters["stats"]["unique_graphs"] == compiled


def test_a_step_compiled_reads_the_attention_kernels_availability_as_a_constant():
    # traced into, the availability probe breaks the graph (a whole-graph compile refuses it);
    # in a new interpreter, where nothing has compiled yet
    code = """
import torch
from rag_spec.target.transformers.compiled_step import CompiledStep
from rag_spec_kernels import cpu_attention_fits
CompiledStep(torch.nn.Linear(2, 2))._compiled  # what a compiled decoder makes at first use
q, k = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 5, 32)
fits = torch.compile(lambda q, k: q * 2 if cpu_attention_fits(q, k) else q, fullgraph=True)
print(torch.equal(fits(q, k), q * 2 if cpu_attention_fits(q, k) else q))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert run.stdout.strip() == "True"
