"""kNN-LM: the datastore, the interpolated distribution, and speculative retrieval's output
equal to the naive loop's (greedy and sampled), on a tiny character-level Llama."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import char_lm
from rag_spec.errors import RagSpecError
from rag_spec.knnlm import KNNLM, KNNDatastore, KNNSpeculation
from rag_spec.knnlm.datastore import FLOAT16_TOLERANCE, compute_entries
from rag_spec.knnlm.keys import KeyedLM
from rag_spec.paths import cache_dir
from rag_spec.retrieval import flat_search
from test_sampling import chi_square_ok

TEXTS = [
    "the cat sat on the mat. the dog sat on the log.",
    "a path joins two parts. a list sorts its items in place.",
    "the thread holds the lock, then the other thread waits for it.",
    "json parses text into objects, and dumps objects into text.",
    "the mat was red, the log was wet, and the cat was asleep.",
] * 3
PROMPTS = ["the cat ", "a list ", "the thread h", "json ", "the log was", "zzz"]


@pytest.fixture(scope="module")
def lm():
    return char_lm(seed=7)


@pytest.fixture(scope="module")
def store(lm):
    return KNNDatastore.build(lm, TEXTS)


def test_entries_are_each_positions_key_and_next_token(lm):
    keys, values = compute_entries(lm, TEXTS[:2], batch_size=2)  # padded batch
    ids = [lm.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    assert len(values) == sum(len(i) - 1 for i in ids)
    assert values.tolist() == ids[0][1:] + ids[1][1:]  # corpus order: entry i+1 follows i
    alone, _ = compute_entries(lm, TEXTS[1:2], batch_size=1)
    np.testing.assert_allclose(keys[len(ids[0]) - 1:], alone, atol=1e-5)  # padding is inert


@pytest.mark.parametrize("key", ["ffn_input", "final"])
def test_keys_are_read_on_a_private_copy(lm, key):
    model = lm.model
    keyed = KeyedLM.of(model, key)
    assert KeyedLM.of(model, key) is keyed  # one runner (and weight copy) per model and key
    logits, keys = keyed(torch.tensor([[3, 4, 5]]))
    assert keys.shape == (1, 3, 32)
    torch.testing.assert_close(logits, model(torch.tensor([[3, 4, 5]])).logits,
                               rtol=1e-4, atol=1e-5)
    assert all(not m._forward_hooks for m in model.modules())  # the user's model: no hook
    if key == "final":  # the LM head reads this vector
        with torch.inference_mode():
            torch.testing.assert_close(logits[0], model.lm_head(keys[0]), rtol=1e-4, atol=1e-5)


def test_flat_search_is_exact_l2_and_float16_stays_within_tolerance(store, lm):
    rng = np.random.default_rng(0)
    queries = store.vectors(rng.integers(0, len(store), 5)) + rng.normal(0, 0.1, (5, 32))
    distances, ids = store.search(queries, 4)
    brute = ((queries[:, None, :] - store.vectors(np.arange(len(store)))[None]) ** 2).sum(-1)
    nearest = np.sort(brute, 1)[:, :4]  # the texts repeat: ids tie, distances do not
    np.testing.assert_allclose(np.take_along_axis(brute, ids, 1), nearest, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(distances, nearest, rtol=1e-4, atol=1e-4)
    keys, values = compute_entries(lm, TEXTS)
    half = KNNDatastore(keys, values, key="ffn_input", model=store.model, precision="float16")
    assert half.nbytes < 0.6 * store.nbytes
    half_distances, _ = half.search(queries, 4)
    np.testing.assert_allclose(half_distances, distances, rtol=FLOAT16_TOLERANCE, atol=1e-3)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_search_results_do_not_depend_on_the_batch(store, precision, monkeypatch):
    monkeypatch.setattr(flat_search, "CONVERT_ROWS", 64)  # float16: several pieces
    if precision == "float16":
        store = KNNDatastore(store.vectors(np.arange(len(store))), store.values,
                             key=store.key, model=store.model, precision="float16")
    rng = np.random.default_rng(1)
    queries = store.vectors(rng.integers(0, len(store), 9)) + rng.normal(0, 0.2, (9, 32))
    together = store.search(queries, 8)
    for i in range(9):  # the naive loop searches one at a time, a verification in batches
        alone = store.search(queries[i:i + 1], 8)
        np.testing.assert_array_equal(alone[1][0], together[1][i])
        np.testing.assert_array_equal(alone[0][0], together[0][i])


def test_ivfpq_guesses_read_what_the_index_compares_with(store):
    approx = store.as_kind("ivfpq", nprobe=64)  # every list: the PQ distances themselves
    rng = np.random.default_rng(2)
    queries = store.vectors(rng.integers(0, len(store), 4))
    distances, ids = approx.search(queries, 3)
    rebuilt = approx.vectors(ids.ravel()).reshape(4, 3, -1)
    np.testing.assert_allclose(distances, ((rebuilt - queries[:, None]) ** 2).sum(-1),
                               rtol=1e-3, atol=1e-3)


def test_the_distribution_mixes_the_neighbours_votes(store, lm):
    knn = KNNLM(lm, store, k=3, lambda_=0.5, temperature=1.0)
    logits = torch.randn(len(lm.tokenizer))
    distances, ids = np.array([0.0, 1.0, 50.0]), np.array([0, 1, 2])
    p = knn.distribution(logits, distances, ids)
    assert abs(float(p.sum()) - 1) < 1e-9
    weights = np.exp(-distances) / np.exp(-distances).sum()
    expected = 0.5 * torch.softmax(logits.double(), -1).numpy()
    for w, i in zip(weights, ids):
        expected[store.values[i]] += 0.5 * w
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-9)


def test_lambda_zero_is_the_model_itself(store, lm):
    knn = KNNLM(lm, store, lambda_=0.0)
    ids = lm.tokenizer("the cat ", return_tensors="pt")["input_ids"]
    reference = lm.model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert knn.generate("the cat ", 20).token_ids == reference[0, ids.shape[1]:].tolist()


SETTINGS = [KNNSpeculation(os3=False, stride=1), KNNSpeculation(os3=False, stride=4),
            KNNSpeculation(os3=False, stride=7, successors=0), KNNSpeculation(),
            KNNSpeculation(capacity=16)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
@pytest.mark.parametrize("k", [1, 8])
def test_speculative_output_equals_the_naive_loops(store, lm, kind, k):
    datastore = store if kind == "flat" else store.as_kind("ivfpq", nprobe=4)
    naive = KNNLM(lm, datastore, k=k, speculation=None)
    rollbacks = hits = 0
    for spec in SETTINGS:
        fast = KNNLM(lm, datastore, k=k, speculation=spec)
        for prompt in PROMPTS:
            for do_sample, seed in ((False, 0), (True, 3)):
                expected = naive.generate(prompt, 24, do_sample=do_sample, seed=seed)
                got = fast.generate(prompt, 24, do_sample=do_sample, seed=seed)
                assert got.token_ids == expected.token_ids, (spec, prompt, do_sample)
                assert expected.stats.kb_calls == len(expected.token_ids)  # one per token
                rollbacks += got.stats.rollbacks
                hits += got.stats.speculation_hits
    assert rollbacks > 0 and hits > 0  # both paths were taken, not one by chance


def test_speculation_saves_datastore_calls_when_generation_follows_the_text(store, lm):
    knn = KNNLM(lm, store, k=4, lambda_=0.9, temperature=1.0,
                speculation=KNNSpeculation(os3=False, stride=6))
    result = knn.generate("the thread h", 30)
    assert result.stats.kb_calls <= len(result.token_ids) / 2


def test_sampled_tokens_follow_the_mixture(store, lm):
    knn = KNNLM(lm, store, k=4, lambda_=0.5, temperature=1.0, speculation=KNNSpeculation())
    first = [knn.generate("the ", 1, do_sample=True, seed=s).token_ids[0] for s in range(600)]
    logits, keys = knn.keyed(lm.tokenizer("the ", return_tensors="pt")["input_ids"])
    distances, neighbours = store.search(keys[0, -1].numpy()[None], 4)
    p = knn.distribution(logits[0, -1], distances[0], neighbours[0]).numpy()
    stat, bound = chi_square_ok(first, torch.from_numpy(p))
    assert stat < bound
    model_alone = torch.softmax(logits[0, -1].double(), -1)  # the test tells lambda apart
    assert chi_square_ok(first, model_alone)[0] > bound


def test_another_models_datastore_is_refused(store):
    other = char_lm(seed=8)
    with pytest.raises(RagSpecError, match="another model"):
        KNNLM(other, store)


def test_open_saves_once_per_key_and_rebuilds_a_changed_one(lm, tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("\n\n".join(TEXTS[:5]))
    first = KNNDatastore.open(lm, [str(folder)], progress=False)
    again = KNNDatastore.open(lm, [str(folder)], progress=False)
    np.testing.assert_array_equal(first.values, again.values)
    approx = KNNDatastore.open(lm, [str(folder)], kind="ivfpq", progress=False)
    assert len(approx) == len(first)
    other = KNNDatastore.open(lm, [str(folder)], key="final", progress=False)
    assert other.key == "final" and len(other) == len(first)
    meta = next(cache_dir().glob("knn/*/*-final/meta.json"))
    meta.write_text(meta.read_text().replace('"final"', '"ffn_input"'))
    rebuilt = KNNDatastore.open(lm, [str(folder)], key="final", progress=False)
    assert "built from other passages; building it again" in capsys.readouterr().out
    np.testing.assert_array_equal(rebuilt.values, other.values)
    assert json.loads(meta.read_text())["key"] == "final"


def test_distractors_are_labelled_and_keep_the_real_entries(store):
    padded = store.with_distractors(5000, seed=1)
    assert len(padded) == 5000 and padded.real == len(store)
    np.testing.assert_array_equal(padded.values[: len(store)], store.values)
    np.testing.assert_array_equal(padded.vectors(np.arange(10)), store.vectors(np.arange(10)))


async def test_agenerate_keeps_the_event_loop_free_and_returns_the_same_tokens(store, lm):
    import asyncio

    knn = KNNLM(lm, store)
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    ticker = asyncio.create_task(tick())
    result = await knn.agenerate("the cat ", 40)
    ticker.cancel()
    assert result.token_ids == knn.generate("the cat ", 40).token_ids
    assert ticks > 0  # the loop ran while the kNN-LM generated
