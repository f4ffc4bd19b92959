"""Steps compiled ahead of time (``step_package``): built once per architecture on this
machine, loaded by later decoders without compiling, greedy tokens equal to ``generate``'s, the
weights read from the model they run for, a damaged package skipped, the user's model left
alone."""

import shutil
import sys

import pytest
import torch

from conftest import tiny_llama
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder
from rag_spec.errors import RagSpecError
from rag_spec.target.transformers import step_package
from rag_spec.target.transformers.runner import Runner, RunnerSettings
from rag_spec_kernels import cpu_attention_available
from test_decoder_greedy import hf_greedy, repetitive_prompt

pytestmark = pytest.mark.slow  # compiles and loads step packages: seconds each

# an architecture no other test builds (3 layers), so no other test meets its package; heads
# 16 wide, which the CPU attention kernel takes where the CPU has AVX-512
SHAPE = {"layers": 3, "hidden": 64}


@pytest.fixture(scope="module")
def package_root(tmp_path_factory):
    """A cache of its own holding one package, built once for the module (~45 s)."""
    root = tmp_path_factory.mktemp("steps")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAG_SPEC_CACHE", str(root))
        model = tiny_llama(seed=0, **SHAPE)
        # not yet probed, as in a new process (`rag-spec models compile`): where the CPU takes
        # the attention kernel, its probe must not run inside the export's tracing
        cpu_attention_available.cache_clear()
        decoder = LookaheadDecoder(model)
        assert decoder.runner.compiled is None  # "auto": nothing built yet, so eager
        folder = decoder.package_steps(progress=False)
        assert decoder.runner.compiled.package is not None  # this decoder uses it at once
    return root, folder


@pytest.fixture
def packaged(package_root, monkeypatch):
    """The package's cache in place, and any compilation refused: loading must not compile."""
    monkeypatch.setenv("RAG_SPEC_CACHE", str(package_root[0]))

    def refuse(*args, **kwargs):
        pytest.fail("compiled while a package was there to load")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    monkeypatch.setattr(torch.export, "export", refuse)
    monkeypatch.setattr(torch, "compile", refuse)  # not even the wrapper: it imports inductor

    def probe(*args, **kwargs):  # a subprocess per instruction set, to warn only
        pytest.fail("loading probed the CPU's instruction sets")

    monkeypatch.setattr(torch._inductor.codecache, "get_device_information", probe)
    return package_root[1]


def calls_through(step):
    """The shapes of the passes ``step``'s package runs, recorded as they run."""
    shapes = []
    package = step.package
    graphs = dict(package.graphs)
    for name, graph in graphs.items():
        package.graphs[name] = lambda *a, g=graph, n=name: shapes.append(
            (n, tuple(a[0].shape))) or g(*a)
    return shapes


@pytest.mark.parametrize("seed", [1, 2])
def test_a_new_decoder_loads_the_package_and_gives_its_own_models_greedy_tokens(packaged,
                                                                                seed):
    model = tiny_llama(seed=seed, **SHAPE)  # other weights, same architecture
    decoder = LookaheadDecoder(model)
    step = decoder.runner.compiled
    assert step is not None and step.package is not None
    shapes = calls_through(step)
    for prompt_seed in range(3):
        prompt = repetitive_prompt(prompt_seed)
        result = decoder.generate(prompt, 30)
        assert result.token_ids == hf_greedy(model, prompt, 30)
        assert result.stats.passes == "compiled ahead of time"
    assert ("one", (1, 1)) in shapes or any(n == "wide" for n, _ in shapes)
    if decoder.runner.stacks:  # oneDNN's products: trees run through the package too
        assert any(n == "wide" and s[1] > 1 for n, s in shapes)


def test_two_models_of_one_architecture_interleave_each_on_its_own_weights(packaged):
    first, second = tiny_llama(seed=3, **SHAPE), tiny_llama(seed=4, **SHAPE)
    decoders = [LookaheadDecoder(first), LookaheadDecoder(second)]
    prompt = repetitive_prompt(5)
    for _ in range(2):  # each call names its own stacks and tensors
        for model, decoder in zip((first, second), decoders, strict=True):
            assert decoder.generate(prompt, 20).token_ids == hf_greedy(model, prompt, 20)


def test_a_batch_of_one_length_runs_through_the_package(packaged):
    model = tiny_llama(seed=5, **SHAPE)
    decoder = LookaheadDecoder(model)
    shapes = calls_through(decoder.runner.compiled)
    prompts = [repetitive_prompt(s, length=24) for s in range(3)]
    results = decoder.generate(prompts, 20)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]
    assert any(s[0] == 3 for _, s in shapes)  # three rows in one pass


def test_rows_that_join_a_batch_in_flight_run_through_the_package(packaged, flat_step_costs):
    """Continuous batching on a static cache: a join copies the batch into a new one, sized
    for everyone's answers, and every row's tokens stay generate's."""
    from test_continuous_batching import joined_midway

    model = tiny_llama(seed=5, **SHAPE)
    decoder = LookaheadDecoder(model)
    shapes = calls_through(decoder.runner.compiled)
    prompts = [repetitive_prompt(s, length=10 + 13 * s) for s in range(3)]
    new_tokens = [30, 12, 20]
    tokens, live = joined_midway(decoder, prompts, new_tokens, joins=[0, 4, 9])
    assert tokens == [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens)]
    assert max(live) >= 2 and any(s[0] >= 2 for _, s in shapes)


def test_every_prompt_length_runs_through_the_package(packaged):
    """From one token (its first pass comes before any prefill allocated the static cache,
    which the package's graphs take whole) to the context's end: greedy tokens generate's,
    alone and in a batch of ragged lengths, through the package's graphs."""
    model = tiny_llama(seed=6, **SHAPE)
    decoder = LookaheadDecoder(model)
    shapes = calls_through(decoder.runner.compiled)
    window = model.config.max_position_embeddings
    phrase = repetitive_prompt(6) * (window // 36 + 1)
    lengths = [*range(1, 10), 35, window - 9, window - 2]
    for length in lengths:
        prompt = phrase[:length]
        result = decoder.generate(prompt, 12)  # cut at the context's end near it
        assert result.token_ids == hf_greedy(model, prompt, min(12, window - length)), length
        assert result.stats.passes == "compiled ahead of time"
    ragged = [phrase[:1], phrase[:2], phrase[:7]]
    assert [r.token_ids for r in decoder.generate(ragged, 12)] == \
        [hf_greedy(model, p, 12) for p in ragged]
    assert {name for name, _ in shapes} >= {"one"}


def test_without_a_package_auto_decodes_eagerly_and_compiles_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda *a, **k: pytest.fail("compiled behind the user's back"))
    model = tiny_llama(seed=0, **SHAPE)
    decoder = LookaheadDecoder(model)
    assert decoder.runner.compiled is None
    prompt = repetitive_prompt(0)
    result = decoder.generate(prompt, 20)
    assert result.token_ids == hf_greedy(model, prompt, 20)
    assert result.stats.passes == "eager"


def test_the_package_is_the_architectures_not_the_weights(packaged):
    def digest(model):
        return step_package.fingerprint(Runner(model, RunnerSettings(compile=True)).compiled)

    same = digest(tiny_llama(seed=0, **SHAPE))
    assert digest(tiny_llama(seed=7, **SHAPE)) == same  # other weights: the same package
    assert digest(tiny_llama(seed=0, layers=4, hidden=64)) != same  # another architecture
    assert digest(tiny_llama(seed=0, **SHAPE).to(torch.float64)) != same  # another dtype


def test_a_package_built_by_other_code_is_named_and_decoding_goes_on_eagerly(
        package_root, monkeypatch, tmp_path, caplog):
    # an upgrade changes the digest: the old package no longer loads, and the user is told
    # which command builds the steps again rather than getting eager steps without a word
    copy = tmp_path / "cache"
    shutil.copytree(package_root[0], copy)
    monkeypatch.setenv("RAG_SPEC_CACHE", str(copy))
    folder = copy / package_root[1].relative_to(package_root[0])
    folder.rename(folder.with_name(folder.name.rsplit("-", 1)[0] + "-builtbyothercode"))
    model = tiny_llama(seed=0, **SHAPE)
    with caplog.at_level("WARNING", logger="rag_spec.target.transformers.step_package"):
        decoder = LookaheadDecoder(model)
        assert decoder.runner.compiled is None
        assert "builtbyothercode" in caplog.text and "rag-spec models compile" in caplog.text
        caplog.clear()
        other_model = LookaheadDecoder(tiny_llama(seed=0, layers=4, hidden=64))
        assert other_model.runner.compiled is None  # no package: eager, and none stale
        other_kernels = LookaheadConfig(onednn_linear=False)  # an ablation: not stale either
        assert LookaheadDecoder(model, config=other_kernels).runner.stacks == []
        assert "built by other code" not in caplog.text
    prompt = repetitive_prompt(0)
    assert decoder.generate(prompt, 12).token_ids == hf_greedy(model, prompt, 12)


def test_a_damaged_package_is_removed_and_decoding_goes_on_eagerly(package_root, monkeypatch,
                                                                   tmp_path, caplog):
    copy = tmp_path / "cache"
    shutil.copytree(package_root[0], copy)
    monkeypatch.setenv("RAG_SPEC_CACHE", str(copy))
    folder = copy / package_root[1].relative_to(package_root[0])
    (folder / "wide.pt2").write_bytes(b"not a package")
    model = tiny_llama(seed=6, **SHAPE)
    decoder = LookaheadDecoder(model)
    assert decoder.runner.compiled is None
    assert "rag-spec models compile" in caplog.text and not folder.exists()
    prompt = repetitive_prompt(1)
    assert decoder.generate(prompt, 20).token_ids == hf_greedy(model, prompt, 20)


def test_a_torch_without_the_loaders_private_form_loads_through_its_public_one(package_root,
                                                                             monkeypatch):
    monkeypatch.setenv("RAG_SPEC_CACHE", str(package_root[0]))
    monkeypatch.setitem(sys.modules, "torch.export.pt2_archive._package", None)  # ImportError
    public = torch._inductor.aoti_load_package
    loaded = []
    monkeypatch.setattr(torch._inductor, "aoti_load_package",
                        lambda path: loaded.append(path) or public(path))
    model = tiny_llama(seed=9, **SHAPE)
    decoder = LookaheadDecoder(model)
    assert decoder.runner.compiled.package is not None and len(loaded) == 2
    prompt = repetitive_prompt(2)
    assert decoder.generate(prompt, 20).token_ids == hf_greedy(model, prompt, 20)


def test_packaging_leaves_the_users_model_alone(packaged):
    model = tiny_llama(seed=8, **SHAPE)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    decoder = LookaheadDecoder(model)
    assert decoder.runner.compiled.package is not None
    decoder.generate(repetitive_prompt(0), 10)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert model.config.to_dict() == config
    assert not any("forward" in vars(m) for m in model.modules())


def test_exact_numerics_are_never_packaged(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_SPEC_CACHE", str(tmp_path))
    decoder = LookaheadDecoder(tiny_llama(seed=0, **SHAPE), config=LookaheadConfig(exact=True))
    assert decoder.runner.compiled is None
    with pytest.raises(RagSpecError, match="exact=False"):
        decoder.package_steps(progress=False)


def test_a_model_moved_to_another_dtype_leaves_the_package_for_eager_steps(packaged):
    model = tiny_llama(seed=9, **SHAPE)
    decoder = LookaheadDecoder(model)
    assert decoder.runner.compiled.package is not None
    model.to(torch.float64)  # the same parameter objects, their data elsewhere
    assert decoder.runner.compiled is None  # rebuilt: no package for float64
    prompt = repetitive_prompt(2)
    assert decoder.generate(prompt, 20).token_ids == hf_greedy(model, prompt, 20)


def test_the_digest_reads_code_not_prose():
    # a docstring or comment edit must not cost a 3-minute rebuild; a code edit must
    import ast

    def digest(source: str) -> str:
        return ast.dump(step_package._without_docstrings(ast.parse(source)))

    base = ('"""Module."""\nclass A:\n    """A."""\n'
            '    def f(self):\n        """F."""\n        return 1\n')
    prose = base.replace('"""F."""', '"""Other words."""  # and a comment')
    assert digest(prose) == digest(base)
    assert digest(base.replace("return 1", "return 2")) != digest(base)
    assert digest('def g():\n    """Only a docstring."""\n') == digest("def g():\n    pass\n")


def test_the_digest_names_the_attention_kernel(monkeypatch):
    # a package traced where the attention kernel failed its probe is not loaded where it works
    step = Runner(tiny_llama(seed=0, **SHAPE), RunnerSettings(compile=True)).compiled
    digests = set()
    for works in (True, False):
        monkeypatch.setattr("rag_spec_kernels.cpu_attention_available", lambda w=works: w)
        digests.add(step_package.fingerprint(step))
    assert len(digests) == 2
