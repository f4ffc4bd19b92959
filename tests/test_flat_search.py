"""The exact flat search finds what faiss's own flat search finds, chunk boundaries included."""

import faiss
import numpy as np
import pytest

from rag_spec.retrieval import flat_search
from rag_spec.retrieval.flat_search import flat_vectors, top_k_inner_product


@pytest.mark.parametrize("rows", [1, 6, 7, 50])
@pytest.mark.parametrize("n_queries", [1, 3])
@pytest.mark.parametrize("k", [1, 4, 60])
def test_same_top_k_as_faiss_across_chunks(monkeypatch, rows, n_queries, k):
    monkeypatch.setattr(flat_search, "CHUNK_ROWS", 7)  # several chunks to merge
    rng = np.random.default_rng(rows * 100 + n_queries * 10 + k)
    vectors = rng.standard_normal((rows, 16), dtype=np.float32)
    index = faiss.IndexFlatIP(16)
    index.add(vectors)
    queries = rng.standard_normal((n_queries, 16), dtype=np.float32)

    scores, ids = top_k_inner_product(flat_vectors(index), queries, k)

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
