"""Attention under a compact tree mask: the torch reference and our CPU kernel against attention
written out in float64, the Triton kernel against the reference under Triton's interpreter (on
the CPU), and the slab KV cache that appends in place."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rag_spec_kernels.cpu_attention as cpu_attention
from rag_spec.target.transformers.kv_cache import new_cache
from rag_spec_kernels import (
    SparseView,
    TreeMask,
    cpu_attention_available,
    cpu_tree_attention,
    reference_attention,
    row_attention,
    row_attention_available,
    tree_attention,
    tree_pass,
)
from rag_spec_kernels.tree_attention import DENSE_KERNEL_QUERIES

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def random_case(seed: int, batch: int, kv_heads: int, groups: int, q_len: int, committed: int,
                earlier: int, select: int | None, dim: int = 16):
    """Queries, a cache of ``committed`` slots then a round of ``earlier`` + ``q_len`` slots,
    holes in the committed part, a random tree over the round (each token sees itself)."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    length = committed + earlier + q_len
    query = torch.randn(batch, heads, q_len, dim, generator=g)
    key = torch.randn(batch, kv_heads, length, dim, generator=g)
    value = torch.randn(batch, kv_heads, length, dim, generator=g)
    bits = torch.rand(batch, committed, generator=g) > 0.3
    recent = torch.rand(batch, q_len, earlier + q_len, generator=g) > 0.5
    recent[:, torch.arange(q_len), earlier + torch.arange(q_len)] = True
    chosen = None
    if select is not None:
        chosen = torch.stack([torch.randperm(committed, generator=g)[:select]
                              for _ in range(batch)])
        bits = bits.gather(1, chosen)
    return query, key, value, TreeMask(bits, recent, None if chosen is None else SparseView(chosen))


def written_out(query, key, value, mask: TreeMask) -> torch.Tensor:
    """Attention as the definition says it, in float64: every query head against its KV head's
    keys (repeated), the mask over every slot of the cache."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    committed = key.shape[2] - mask.round_length
    allowed = mask.over_cache(committed)[:, None]  # [B, 1, q, S + R]
    scores = query.double() @ k.transpose(-1, -2) / query.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 3), kv_heads=st.integers(1, 3),
       groups=st.sampled_from([1, 2, 4]), q_len=st.integers(1, 9), committed=st.integers(1, 40),
       earlier=st.integers(0, 6), sparse=st.booleans())
def test_reference_matches_attention_written_out(seed, batch, kv_heads, groups, q_len,
                                                  committed, earlier, sparse):
    select = max(1, committed // 2) if sparse else None
    query, key, value, mask = random_case(seed, batch, kv_heads, groups, q_len, committed,
                                          earlier, select)
    expected = written_out(query, key, value, mask)
    got = reference_attention(query, key, value, mask)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


needs_cpu_kernel = pytest.mark.skipif(not cpu_attention_available(),
                                      reason="our CPU attention kernel needs AVX-512")


@needs_cpu_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 3), kv_heads=st.integers(1, 3),
       groups=st.sampled_from([1, 3, 4]), q_len=st.integers(1, 18),
       committed=st.sampled_from([1, 15, 33, 511, 512, 513, 1300]), earlier=st.integers(0, 40),
       sparse=st.booleans(), dim=st.sampled_from([16, 32, 64, 128]))
def test_the_cpu_kernel_matches_attention_written_out(seed, batch, kv_heads, groups, q_len,
                                                      committed, earlier, sparse, dim):
    # slices of 512 committed slots merged (1300: three), rounds past one block of keys
    select = max(1, committed // 2) if sparse else None
    query, key, value, mask = random_case(seed, batch, kv_heads, groups, q_len, committed,
                                          earlier, select, dim)
    expected = written_out(query, key, value, mask)
    got = cpu_tree_attention(query, key, value, mask)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@needs_cpu_kernel
def test_the_cpu_kernel_reads_strided_caches_and_skips_what_no_row_sees():
    query, key, value, mask = random_case(3, 2, 3, 3, 4, 700, 2, None, 64)
    slab_k, slab_v = (torch.randn(2, 3, key.shape[2] + 9, 64) for _ in range(2))
    slab_k[:, :, :key.shape[2]], slab_v[:, :, :key.shape[2]] = key, value
    unseen = torch.cat([~mask.committed, torch.zeros(2, mask.round_length, dtype=torch.bool)],
                       dim=1)[:, None, :, None]
    # a slab's leading part (strided rows) whose unseen slots hold infinities
    k, v = (t[:, :, :key.shape[2]].masked_fill(unseen, float("inf")) for t in (slab_k, slab_v))
    got = cpu_tree_attention(query.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask)
    torch.testing.assert_close(got.double(), written_out(query, key, value, mask), atol=1e-5,
                               rtol=1e-5)


@needs_cpu_kernel
def test_a_cpu_kernel_row_does_not_depend_on_the_batch_or_the_tokens_beside_it():
    query, key, value, mask = random_case(5, 3, 2, 3, 5, 1100, 3, None, 64)
    together = cpu_tree_attention(query, key, value, mask)
    for b in range(3):
        alone = cpu_tree_attention(query[b:b + 1], key[b:b + 1], value[b:b + 1],
                                   TreeMask(mask.committed[b:b + 1], mask.recent[b:b + 1]))
        assert torch.equal(alone[0], together[b])
    first = TreeMask(mask.committed, mask.recent[:, :1])  # the step's first token only
    assert torch.equal(cpu_tree_attention(query[:, :, :1], key, value, first),
                       together[:, :, :1])


def dense_mask(mask: TreeMask, committed: int, additive: bool) -> torch.Tensor:
    """``mask`` over every slot as a [B, 1, q, S + R] mask: bool, or 0 / the minimum."""
    allowed = mask.over_cache(committed)[:, None]
    if not additive:
        return allowed
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)


def kernel_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    masked = cpu_attention.cpu_masked_attention
    monkeypatch.setattr(cpu_attention, "cpu_masked_attention",
                        lambda query, *a: calls.append(query.shape[2]) or masked(query, *a))
    return calls


@needs_cpu_kernel
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 3), groups=st.sampled_from([1, 3]),
       q_len=st.integers(1, 18), committed=st.sampled_from([1, 33, 600]),
       earlier=st.integers(0, 20), additive=st.booleans())
def test_dense_masked_steps_take_the_cpu_kernel_and_match_attention_written_out(
        seed, batch, groups, q_len, committed, earlier, additive):
    # a compiled step's mask over its static cache: the committed slots every query sees (holes
    # in them: ragged rows' padding), the round's as each query's own
    query, key, value, mask = random_case(seed, batch, 2, groups, q_len, committed, earlier,
                                          None, 64)
    with pytest.MonkeyPatch.context() as patch:
        calls = kernel_calls(patch)
        got, _ = tree_attention(None, query, key, value, dense_mask(mask, committed, additive))
    assert calls == [q_len]
    torch.testing.assert_close(got.transpose(1, 2).double(), written_out(query, key, value, mask),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@needs_cpu_kernel
def test_the_dense_masked_kernel_compiles_into_one_graph():
    query, key, value, mask = random_case(7, 2, 3, 3, 17, 300, 4, None, 64)
    compiled = torch.compile(lambda *a: tree_attention(None, *a)[0], fullgraph=True,
                             dynamic=True)
    got = compiled(query, key, value, dense_mask(mask, 300, additive=True))
    torch.testing.assert_close(got.transpose(1, 2).double(), written_out(query, key, value, mask),
                               atol=1e-5, rtol=1e-5)


def test_a_prompts_dense_masked_pass_stays_on_sdpa(monkeypatch):
    # the kernel is for a step's few queries; a prompt's many go through SDPA's flash kernel
    q_len = DENSE_KERNEL_QUERIES + 1
    query, key, value, mask = random_case(8, 1, 2, 3, q_len, 10, 0, None, 64)
    calls = kernel_calls(monkeypatch)
    got, _ = tree_attention(None, query, key, value, dense_mask(mask, 10, additive=False))
    assert not calls
    torch.testing.assert_close(got.transpose(1, 2).double(), written_out(query, key, value, mask),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("probe", [cpu_attention_available, row_attention_available])
def test_probing_a_cpu_kernel_leaves_torchs_global_rng_alone(probe):
    probe.cache_clear()  # probed again, as in a new process
    state = torch.get_rng_state()
    try:
        probe()
    finally:
        probe.cache_clear()
    assert torch.equal(torch.get_rng_state(), state)
    probe()  # cached again: later tests that patch the kernels must not re-probe them


def test_a_selection_reads_only_its_slots():
    query, key, value, mask = random_case(0, 2, 2, 2, 3, 30, 2, select=8)
    before = reference_attention(query, key, value, mask)
    unread = torch.ones(key.shape[2], dtype=torch.bool)
    unread[mask.select.flatten()] = False
    unread[-mask.round_length:] = False
    key[:, :, unread] = 1e3  # slots outside the selection: changing them changes nothing
    value[:, :, unread] = -1e3
    again = TreeMask(mask.committed, mask.recent, SparseView(mask.select))  # gathers anew
    torch.testing.assert_close(reference_attention(query, key, value, again), before)


def test_a_view_gathers_once_per_round_and_appends_each_pass():
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 3, 30, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g)
    select = torch.tensor([[0, 1, 17, 18, 19], [0, 2, 3, 15, 19]])
    view = SparseView(select)
    index = select[:, None, :, None].expand(-1, 3, -1, 8)
    for end, new in ((22, 2), (25, 3), (26, 1)):  # three passes of one round after 20 slots
        got_key, got_value = view.read(0, key[:, :, :end], value[:, :, :end], end - 20, new)
        torch.testing.assert_close(got_key, torch.cat([key[:, :, :20].gather(2, index),
                                                       key[:, :, 20:end]], dim=2))
        torch.testing.assert_close(got_value, torch.cat([value[:, :, :20].gather(2, index),
                                                         value[:, :, 20:end]], dim=2))
    # The next round reads other slots: only entries whose slot changed are copied again.
    moved = torch.tensor([[0, 1, 17, 18, 21], [0, 2, 20, 15, 19]])
    view.update(moved)
    key[:, :, 17:19] = 0  # unchanged entries keep what was read (committed slots never change)
    got_key, _ = view.read(0, key[:, :, :24], value[:, :, :24], 2, 2)
    index = moved[:, None, :, None].expand(-1, 3, -1, 8)
    expected = torch.cat([key[:, :, :22].gather(2, index), key[:, :, 22:24]], dim=2)
    torch.testing.assert_close(got_key[0, :, 4:], expected[0, :, 4:])  # row 0: slot 21 new
    torch.testing.assert_close(got_key[1, :, 2], expected[1, :, 2])  # row 1: slot 20 new
    assert got_key[0, :, 2:4].abs().sum() > 0  # row 0's slots 17, 18: not read again


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_triton_kernel_matches_the_reference_under_the_interpreter(tmp_path):
    # The interpreter is switched on for a child process only (never in this one).
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{KERNELS}{os.pathsep}"
           f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "errors.json"
    subprocess.run([sys.executable, __file__, str(out)], env=env, check=True, timeout=600)
    assert_within_tolerance(json.loads(out.read_text()))


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a GPU and Triton (`make gpu-check` runs it)")
def test_the_triton_kernel_matches_the_reference_on_a_gpu():
    assert_within_tolerance(triton_errors(torch.device("cuda")))


def assert_within_tolerance(errors: list) -> None:
    assert len(errors) == len(TRITON_CASES)
    for case, (dtype, error) in zip(TRITON_CASES, errors):
        assert error <= (1e-5 if dtype == "float32" else 1e-2), (case, dtype, error)


# (batch, kv_heads, groups, q_len, committed, earlier, select, dim, dtype): ragged holes, trees
# of 1 to 64 tokens, a sparse selection, head sizes that are and are not powers of two.
TRITON_CASES = [
    (2, 2, 2, 1, 70, 0, None, 64, "float32"),
    (3, 1, 4, 5, 33, 4, None, 64, "float32"),
    (1, 2, 1, 64, 20, 0, None, 32, "float32"),
    (2, 2, 3, 7, 90, 3, 24, 64, "float32"),
    (2, 1, 2, 9, 17, 0, None, 80, "float32"),
    (2, 2, 2, 4, 130, 2, None, 64, "bfloat16"),
    (2, 2, 4, 16, 50, 5, 12, 64, "bfloat16"),
]


def triton_errors(device: torch.device) -> list[tuple[str, float]]:
    """The kernel's largest error against the reference, per case, with inputs on ``device``."""
    from rag_spec_kernels.triton_tree_attention import triton_tree_attention

    errors = []
    for seed, (*shape, select, dim, dtype) in enumerate(TRITON_CASES):
        query, key, value, mask = random_case(seed, *shape, select, dim)
        query, key, value = (t.to(device, getattr(torch, dtype)) for t in (query, key, value))
        expected = reference_attention(query.float(), key.float(), value.float(), mask)
        got = triton_tree_attention(query, key, value, mask).float()
        errors.append((dtype, (got - expected).abs().max().item()))
    return errors


@pytest.mark.parametrize("inference", [False, True])
def test_slab_layers_append_in_place_and_keep_their_slab_across_crops(inference):
    # under inference mode views do not record their base: the slab is tracked explicitly
    with torch.inference_mode(inference):
        slab_appends_in_place()


def slab_appends_in_place():
    cache = new_cache()
    first = torch.randn(2, 3, 5, 4)
    keys, _ = cache.update(first, first, 0)
    slab = keys.data_ptr()
    chunks = [first]
    for size in (1, 3, 1):
        chunk = torch.randn(2, 3, size, 4)
        chunks.append(chunk)
        keys, values = cache.update(chunk, chunk, 0)
        assert keys.data_ptr() == slab  # written in place, not concatenated
    torch.testing.assert_close(keys, torch.cat(chunks, dim=2))
    layer = cache.layers[0]
    layer.keys, layer.values = layer.keys[:, :, :6], layer.values[:, :, :6]  # a crop
    again = torch.randn(2, 3, 2, 4)
    keys, _ = cache.update(again, again, 0)
    assert keys.data_ptr() == slab
    expected = torch.cat([torch.cat(chunks, dim=2)[:, :, :6], again], dim=2)
    torch.testing.assert_close(keys, expected)
    big = torch.randn(2, 3, 600, 4)  # past the slab's room: regrown, contents kept
    keys, _ = cache.update(big, big, 0)
    torch.testing.assert_close(keys, torch.cat([expected, big], dim=2))

if __name__ == "__main__":  # the interpreter's child process
    Path(sys.argv[1]).write_text(json.dumps(triton_errors(torch.device("cpu"))))


# -- row attention: each query row from its own keys alone --------------------------------------

needs_row_kernel = pytest.mark.skipif(not row_attention_available(),
                                      reason="the row attention kernel needs AVX2 or AVX-512")


@needs_row_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 3), kv_heads=st.integers(1, 3),
       groups=st.sampled_from([1, 3, 4]), q_len=st.integers(1, 18),
       committed=st.sampled_from([1, 7, 33, 600]), earlier=st.integers(0, 20),
       dim=st.sampled_from([8, 16, 64, 128]))
def test_row_attention_matches_attention_written_out(seed, batch, kv_heads, groups, q_len,
                                                     committed, earlier, dim):
    query, key, value, mask = random_case(seed, batch, kv_heads, groups, q_len, committed,
                                          earlier, None, dim)
    got = row_attention(query, key, value, mask.over_cache(committed))
    torch.testing.assert_close(got.double(), written_out(query, key, value, mask), atol=1e-5,
                               rtol=1e-5)


@needs_row_kernel
@pytest.mark.parametrize("seed", range(6))
def test_a_tree_row_equals_its_one_token_step_bit_for_bit(seed):
    # a tree token sees the committed keys, then its ancestors; once they are committed, its
    # one-token step sees the same keys in the same order at other slots, and no others
    g = torch.Generator().manual_seed(seed)
    committed, q_len, dim = 300 + seed * 97, 7, 64
    parents = [-1, 0, 0, 1, 2, 2, 4]  # a tree over the step's tokens
    query = torch.randn(1, 6, q_len, dim, generator=g)
    key, value = (torch.randn(1, 2, committed + q_len, dim, generator=g) for _ in range(2))
    holes = torch.rand(1, committed, generator=g) > 0.1  # padding a ragged batch leaves
    recent = torch.zeros(1, q_len, q_len, dtype=torch.bool)
    for i in range(q_len):
        j = i
        while j >= 0:
            recent[0, i, j], j = True, parents[j]
    tree = row_attention(query, key, value, TreeMask(holes, recent).over_cache(committed))
    for i in range(q_len):
        path = recent[0, i].nonzero().flatten() + committed  # ancestors, then itself
        keys, values = (torch.cat([t[:, :, :committed], t[:, :, path]], dim=2)
                        for t in (key, value))
        allowed = torch.cat([holes, torch.ones(1, len(path), dtype=torch.bool)], dim=1)
        alone = row_attention(query[:, :, i:i + 1], keys, values, allowed[:, None])
        assert torch.equal(alone[:, :, 0], tree[:, :, i])


@needs_row_kernel
def test_row_attention_never_reads_a_key_it_does_not_see():
    query, key, value, mask = random_case(3, 2, 3, 3, 4, 70, 2, None, 64)
    allowed = mask.over_cache(70)
    poisoned = [t.masked_fill(~allowed.any(1)[:, None, :, None], float("nan"))
                for t in (key, value)]
    torch.testing.assert_close(row_attention(query, *poisoned, allowed).double(),
                               written_out(query, key, value, mask), atol=1e-5, rtol=1e-5)


@needs_row_kernel
def test_rows_mode_takes_every_pass_to_the_row_kernel_prompts_too(monkeypatch):
    """Steps (eager tree, compiled dense mask, one token) and prompts (a padded one's mask, a
    whole one's causal ``None``, as SDPA's ``is_causal`` reads it: query i sees slots up to i,
    also in a static cache longer than the prompt) all run on the row kernel."""
    calls: list[int] = []
    kernel = cpu_attention.row_attention
    monkeypatch.setattr(cpu_attention, "row_attention",
                        lambda query, *a: calls.append(query.shape[2]) or kernel(query, *a))
    query, key, value, mask = random_case(4, 1, 2, 3, 5, 40, 3, None, 64)
    with tree_pass(mask):  # an eager tree step
        got, _ = tree_attention(None, query, key, value, None, rows=True)
    torch.testing.assert_close(got.transpose(1, 2).double(),
                               written_out(query, key, value, mask), atol=1e-5, rtol=1e-5)
    tree_attention(None, query, key, value, dense_mask(mask, 40, True), rows=True)  # compiled
    tree_attention(None, query[:, :, :1], key, value, None, rows=True)  # one token, eager
    prompt = random_case(8, 1, 2, 3, DENSE_KERNEL_QUERIES + 1, 10, 0, None, 64)
    tree_attention(None, *prompt[:3], dense_mask(prompt[3], 10, False), rows=True)  # padded
    query, key, value = (torch.randn(2, 6, 30, 64), torch.randn(2, 2, 40, 64),
                         torch.randn(2, 2, 40, 64))
    got, _ = tree_attention(None, query, key, value, None, rows=True)  # a prompt's causal pass
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), is_causal=True)
    torch.testing.assert_close(got.transpose(1, 2), expected, atol=1e-5, rtol=1e-5)
    assert calls == [5, 5, 1, DENSE_KERNEL_QUERIES + 1, 30]

