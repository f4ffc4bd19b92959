"""The exact flat search finds what faiss's own flat search finds, chunk boundaries included."""

import math

import faiss
import numpy as np
import pytest
import torch

from rag_spec.retrieval import flat_search
from rag_spec.retrieval.flat_search import (
    PackedVectors,
    flat_vectors,
    largest_norm,
    norm_bound,
    top_k_inner_product,
)
from rag_spec_kernels import onednn_ops_available

needs_onednn = pytest.mark.skipif(not onednn_ops_available(),
                                  reason="packing needs a torch build with oneDNN")


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("rows", [1, 6, 7, 50])
@pytest.mark.parametrize("n_queries", [1, 3, 17])
@pytest.mark.parametrize("k", [1, 4, 60])
def test_same_top_k_as_faiss_across_chunks(monkeypatch, packed, rows, n_queries, k):
    monkeypatch.setattr(flat_search, "CHUNK_ROWS", 7)  # several chunks to merge
    rng = np.random.default_rng(rows * 100 + n_queries * 10 + k)
    vectors = rng.standard_normal((rows, 16), dtype=np.float32)
    index = faiss.IndexFlatIP(16)
    index.add(vectors)
    queries = rng.standard_normal((n_queries, 16), dtype=np.float32)
    stored = PackedVectors(flat_vectors(index)) if packed else flat_vectors(index)

    scores, ids = top_k_inner_product(stored, queries, k)

    expected_scores, expected_ids = index.search(queries, min(k, rows))
    assert ids.shape == (n_queries, min(k, rows)) and ids.dtype == np.int64
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)


def test_the_vectors_are_the_index_memory_not_a_copy():
    index = faiss.IndexFlatIP(4)
    index.add(np.eye(4, dtype=np.float32))
    vectors = flat_vectors(index)
    assert vectors.shape == (4, 4)
    assert vectors.data_ptr() == int(index.get_xb())  # 5M vectors are 7.7 GB: never doubled


def test_an_empty_index_finds_nothing():
    scores, ids = top_k_inner_product(flat_vectors(faiss.IndexFlatIP(4)),
                                      np.ones((2, 4), np.float32), 3)
    assert scores.shape == ids.shape == (2, 0)


@needs_onednn
def test_a_packed_knowledge_base_finds_the_same_passages(user_cache):
    from rag_spec.retrieval import KnowledgeBase

    kb = KnowledgeBase.load_default("flat")
    queries = ["join two filesystem paths", "parse a json string", "sort a list in place"]
    expected = kb.search(queries, k=5)
    kb.pack()
    try:
        found = kb.search(queries, k=5)
    finally:
        kb.index.packed = None  # the default knowledge base is shared by other tests
    assert [[h.doc_id for h in hits] for hits in found] == [
        [h.doc_id for h in hits] for hits in expected]
    assert [h.score for hits in found for h in hits] == pytest.approx(
        [h.score for hits in expected for h in hits], abs=1e-5)


def test_only_a_flat_index_packs():
    from rag_spec.corpus import Passage
    from rag_spec.errors import RagSpecError
    from rag_spec.retrieval import KnowledgeBase

    for kind in ("hnsw", "bm25"):
        kb = KnowledgeBase.build([Passage("a", "alpha"), Passage("b", "beta")], kind)
        with pytest.raises(RagSpecError, match="Only a flat"):
            kb.pack()


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_query_finds_the_same_bits_alone_and_in_any_batch(packed, dtype):
    # Speculative retrieval verifies guesses in a batch and is lossless only if that batch finds
    # what the naive loop's one-query searches find: same ids, same scores to the bit (a
    # matrix product's rounding changes with its shape on AVX2 CPUs).
    if packed and dtype == torch.float16:
        pytest.skip("packing takes float32 vectors")
    rng = np.random.default_rng(0)
    vectors = torch.from_numpy(rng.standard_normal((3000, 96), dtype=np.float32)).to(dtype)
    bias = torch.from_numpy(rng.standard_normal(3000, dtype=np.float32))
    stored = PackedVectors(vectors) if packed else vectors
    queries = rng.standard_normal((17, 96), dtype=np.float32)
    alone = [top_k_inner_product(stored, queries[i:i + 1], 8, bias) for i in range(17)]
    for size in (2, 3, 9, 17):
        scores, ids = top_k_inner_product(stored, queries[:size], 8, bias)
        for i in range(size):
            np.testing.assert_array_equal(ids[i], alone[i][1][0])
            np.testing.assert_array_equal(scores[i], alone[i][0][0])


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
def test_ties_beyond_the_shortlist_go_to_the_lowest_ids_in_any_batch(packed):
    # 100 copies of the nearest vector (a datastore's keys repeat where texts start alike):
    # more ties than the first shortlist holds, so the search must widen it until it has
    # proven the best k, and return the lowest ids, whatever the batch.
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((2000, 48), dtype=np.float32)
    copies = rng.permutation(2000)[:100]
    vectors[copies] = vectors[copies[0]]
    stored = PackedVectors(torch.from_numpy(vectors)) if packed else torch.from_numpy(vectors)
    queries = np.concatenate([vectors[copies[:1]] + 0.01,
                              rng.standard_normal((4, 48), dtype=np.float32)])
    for size in (1, 2, 5):
        scores, ids = top_k_inner_product(stored, queries[:size], 8)
        np.testing.assert_array_equal(ids[0], np.sort(copies)[:8])
        assert (scores[0] == scores[0][0]).all()
    alone = top_k_inner_product(stored, queries[4:], 8)
    np.testing.assert_array_equal(alone[1][0], top_k_inner_product(stored, queries, 8)[1][4])


def test_the_norm_bound_covers_every_vector():
    vectors = torch.randn(5000, 33, dtype=torch.float16) * 7
    assert largest_norm(vectors) >= float(vectors.double().norm(dim=1).max())
    assert largest_norm(vectors) < 1.001 * float(vectors.double().norm(dim=1).max())
    squares = vectors.float().pow(2).sum(1)  # a datastore's bound comes from its squared norms
    from_squares = norm_bound(math.sqrt(float(squares.max())), 33)
    assert from_squares >= float(vectors.double().norm(dim=1).max())
