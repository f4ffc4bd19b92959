"""The kNN-LM datastore: (key, next token) at every position of a corpus, in corpus order.

Entry ``i + 1`` is the position after entry ``i`` in the same text, which speculative kNN-LM
relies on: the neighbours of the next step are often the successors of this step's.

Layout on disk (``<cache>/knn/<corpus>/<model>-<key>/``)::

    keys.npy      float32 [entries, dim]: the model's hidden state (see ``keys``)
    values.npy    int32 [entries]: the token that followed
    meta.json     corpus and model fingerprints, key, sizes, build time
    ivfpq.faiss   the approximate index, built on first use

Every write goes to a scratch path first, so a crash leaves the previous datastore usable.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rag_spec.corpus import DEFAULT_SOURCES, fingerprint, load_passages
from rag_spec.errors import RagSpecError
from rag_spec.knnlm.keys import KeyedLM, KeyKind
from rag_spec.paths import atomic_dir, atomic_file, cache_dir
from rag_spec.retrieval.flat_search import CHUNK_ROWS, norm_bound, top_k_inner_product
from rag_spec.retrieval.knowledge_base import corpus_dir

KINDS = ("flat", "ivfpq")
PRECISIONS = ("float32", "float16")
FLOAT16_TOLERANCE = 1e-3  # float16 keys: relative error of squared distances stays below this


class KNNDatastore:
    """Keys searched by L2 distance, with the token that followed each.

    ``kind``: ``"flat"`` is exact (matrix products over every key; a batch of queries reads the
    keys once); ``"ivfpq"`` is faiss's IVF-PQ (64-byte codes, ``nprobe`` lists searched).
    ``precision``: ``"float16"`` halves a flat datastore's memory; squared distances then
    differ from float32's by less than ``FLOAT16_TOLERANCE`` (relative), so a neighbour changes
    only between near ties.
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray, *, key: KeyKind, model: str,
                 kind: str = "flat", precision: str = "float32", nprobe: int = 32,
                 index: Any = None, real: int | None = None) -> None:
        _check_choice("kind", kind, KINDS)
        _check_choice("precision", precision, PRECISIONS)
        if len(keys) != len(values) or keys.ndim != 2 or not len(keys):
            msg = f"A datastore needs one key per value (keys {keys.shape}, values {values.shape})."
            raise RagSpecError(msg)
        self.key = key
        self.model = model  # fingerprint of the model whose hidden states the keys are
        self.kind = kind
        self.precision = precision
        self.values = np.ascontiguousarray(values, dtype=np.int64)
        self.real = len(keys) if real is None else real  # entries from text; the rest distractors
        self.dim = int(keys.shape[1])
        self._keys: torch.Tensor | None = None
        self._index: Any = None
        if kind == "flat":
            dtype = np.float16 if precision == "float16" else np.float32
            self._keys = torch.from_numpy(np.ascontiguousarray(keys, dtype=dtype))
            self._half_norms = _half_squared_norms(self._keys)
            self._max_norm = norm_bound(math.sqrt(2 * float(self._half_norms.max())), self.dim)
        else:
            self._index = index if index is not None else build_ivfpq(keys)
            self._index.nprobe = nprobe

    def __len__(self) -> int:
        return len(self.values)

    @property
    def nbytes(self) -> int:
        """Memory held by keys, values and index."""
        if self._keys is not None:
            held = self._keys.numel() * self._keys.element_size() + self._half_norms.numel() * 4
        else:
            held = self._index.sa_code_size() * self._index.ntotal
        return held + self.values.nbytes

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(squared L2 distances, entry ids), each [n_queries, k], nearest first; one call for
        the whole batch."""
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dim)
        if self._keys is not None:
            # |q - x|^2 = |q|^2 - 2 (q.x - |x|^2 / 2): an inner-product top-k with a bias.
            scores, ids = top_k_inner_product(self._keys, queries, k, bias=self._half_norms,
                                              max_norm=self._max_norm)
            distances = (queries**2).sum(1, keepdims=True) - 2 * scores
            return np.maximum(distances, 0), ids
        distances, ids = self._index.search(queries, k)
        return distances, ids

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids), dim] what ``search`` compares queries with: the keys, or their IVF-PQ
        reconstructions (so a guess ranks cached entries as the index would)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self._keys is not None:
            return self._keys[torch.from_numpy(ids)].float().numpy()
        return self._index.reconstruct_batch(ids)

    def with_distractors(self, size: int, seed: int = 0) -> KNNDatastore:
        """This datastore padded to ``size`` entries with random keys and values (labelled:
        ids ``>= real``), drawn from the real keys' per-dimension mean and spread: the benchmark's
        stand-in for a datastore of millions of entries."""
        if self._keys is None:
            msg = "Pad a flat datastore, then build the approximate index over it (as_kind)."
            raise RagSpecError(msg)
        real = self._keys[: self.real].float()
        mean, std = real.mean(0), real.std(0)
        keys = torch.empty((size, self.dim), dtype=self._keys.dtype)
        keys[: self.real] = self._keys[: self.real]
        generator = torch.Generator().manual_seed(seed)
        for start in range(self.real, size, CHUNK_ROWS):
            rows = min(CHUNK_ROWS, size - start)
            noise = torch.randn((rows, self.dim), generator=generator)
            keys[start:start + rows] = (mean + std * noise).to(keys.dtype)
        vocab = int(self.values[: self.real].max()) + 1
        values = np.concatenate([self.values[: self.real], np.random.default_rng(seed).integers(
            0, vocab, size - self.real)])
        return KNNDatastore(keys.numpy(), values, key=self.key, model=self.model,  # type: ignore[arg-type]
                            kind="flat", precision=self.precision, real=self.real)

    def as_kind(self, kind: str, *, nprobe: int = 32) -> KNNDatastore:
        """The same entries behind another index kind (a flat datastore's keys are needed)."""
        if self._keys is None:
            msg = "Only a flat datastore holds the keys another kind is built from."
            raise RagSpecError(msg)
        return KNNDatastore(self._keys.float().numpy(), self.values, key=self.key,  # type: ignore[arg-type]
                            model=self.model, kind=kind, precision=self.precision,
                            nprobe=nprobe, real=self.real)

    # -- building and opening ------------------------------------------------------------------

    @classmethod
    def build(cls, lm: Any, texts: Sequence[str], *, key: KeyKind = "ffn_input",
              kind: str = "flat", precision: str = "float32", batch_size: int = 8,
              max_tokens: int = 512, progress: bool = False) -> KNNDatastore:
        """Keys and next tokens at every position of ``texts`` (in order), in batches of
        ``batch_size`` texts (each cut at ``max_tokens``)."""
        keys, values = compute_entries(lm, texts, key=key, batch_size=batch_size,
                                       max_tokens=max_tokens, progress=progress)
        return cls(keys, values, key=key, model=model_fingerprint(lm.model), kind=kind,
                   precision=precision)

    @classmethod
    def open(cls, lm: Any, sources: Sequence[str] = DEFAULT_SOURCES, *,
             key: KeyKind = "ffn_input", kind: str = "flat", precision: str = "float32",
             rebuild: bool = False, progress: bool = True) -> KNNDatastore:
        """The datastore of ``sources`` for ``lm``, built and saved on first use (the default
        corpus: the standard library's docstrings)."""
        _check_choice("kind", kind, KINDS)
        passages = load_passages(sources)
        texts = [passage_text(p.title, p.text) for p in passages]
        model = model_fingerprint(lm.model)
        folder = cache_dir() / "knn" / corpus_dir(sources).name / f"{model}-{key}"
        corpus = fingerprint(passages)
        meta = _read_meta(folder)
        problem = "" if rebuild or meta is None else _problem(folder, meta, corpus, model, key)
        if problem:  # built afresh: the same passages and model give the same datastore
            print(f"rag-spec: the kNN-LM datastore in {folder} {problem}; building it again.")
        if rebuild or meta is None or problem:
            if progress:
                print(f"rag-spec: building the kNN-LM datastore over {len(texts)} passages of "
                      f"{', '.join(sources)} (once; saved under {folder}).")
            started = time.perf_counter()
            keys, values = compute_entries(lm, texts, key=key, progress=progress)
            with atomic_dir(folder) as scratch:
                np.save(scratch / "keys.npy", keys)
                np.save(scratch / "values.npy", values.astype(np.int32))
                # written last: its digests vouch for the arrays written before it
                (scratch / "meta.json").write_text(json.dumps({
                    "corpus": corpus, "model": model, "key": key, "entries": len(values),
                    "dim": int(keys.shape[1]), "digests": _digests(scratch),
                    "build_seconds": round(time.perf_counter() - started, 1)}, indent=2))
        else:
            keys = np.load(folder / "keys.npy")
            values = np.load(folder / "values.npy")
        index = None
        if kind == "ivfpq":
            index = _saved_ivfpq(folder / "ivfpq.faiss", keys)
        return cls(keys, values, key=key, model=model, kind=kind, precision=precision,
                   index=index)


def passage_text(title: str, text: str) -> str:
    """How a passage reads in the datastore: its title, then its text."""
    return f"{title}\n{text}"


def compute_entries(lm: Any, texts: Sequence[str], *, key: KeyKind = "ffn_input",
                    batch_size: int = 8, max_tokens: int = 512,
                    progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(keys float32 [n, dim], values int64 [n]): one entry per position that has a next
    token, texts in order."""
    from tqdm.auto import tqdm

    keyed = KeyedLM.of(lm.model, key)
    window = min(max_tokens, int(getattr(keyed.runner.config, "max_position_embeddings",
                                         max_tokens)))
    encoded = [ids[:window] for ids in lm.tokenizer(list(texts))["input_ids"]]
    by_length = sorted((i for i, ids in enumerate(encoded) if len(ids) > 1),
                       key=lambda i: len(encoded[i]))  # batches of like lengths pad little
    if not by_length:
        msg = "No text had two tokens or more: a kNN-LM datastore needs some text."
        raise RagSpecError(msg)
    keys: dict[int, np.ndarray] = {}
    device = next(lm.model.parameters()).device
    for start in tqdm(range(0, len(by_length), batch_size), desc="kNN-LM datastore",
                      unit="batch", disable=not progress):
        batch = by_length[start:start + batch_size]
        width = len(encoded[batch[-1]])
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
            mask[row, : len(encoded[i])] = 1
        hidden = keyed.keys(ids.to(device), mask.to(device))
        for row, i in enumerate(batch):  # right padding: a row's real positions lead
            keys[i] = hidden[row, : len(encoded[i]) - 1].cpu().numpy()
    order = sorted(keys)  # back in corpus order
    return (np.concatenate([keys[i] for i in order]),
            np.concatenate([np.asarray(encoded[i][1:], dtype=np.int64) for i in order]))


def model_fingerprint(model: Any) -> str:
    """A short hash of the model's config and some of its weights: keys from another model
    (or other weights) mean nothing to this one."""
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where the model lies says nothing of its weights
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for parameter in list(model.parameters())[:4]:
        digest.update(parameter.detach().reshape(-1)[:65_536].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:12]


def build_ivfpq(keys: np.ndarray, seed: int = 0) -> Any:
    """IVF-PQ over ``keys`` (L2): about 4 sqrt(n) lists, 64 sub-quantizers where the dimension
    allows, trained on a sample; with a direct map so guesses can read reconstructions."""
    import faiss

    keys = np.ascontiguousarray(keys, dtype=np.float32)
    n, dim = keys.shape
    lists = max(1, min(4096, int(4 * math.sqrt(n))))
    sub = next(m for m in (64, 48, 32, 16, 8, 4, 2, 1) if dim % m == 0)
    bits = 8 if n >= 256 * 39 else max(1, int(math.log2(max(n // 39, 2))))
    index = faiss.IndexIVFPQ(faiss.IndexFlatL2(dim), dim, lists, sub, bits)
    sample = keys[np.random.default_rng(seed).permutation(n)[: max(lists, 2 ** bits) * 50]]
    index.train(sample)
    for start in range(0, n, CHUNK_ROWS):
        index.add(keys[start:start + CHUNK_ROWS])
    index.make_direct_map()
    return index


def _saved_ivfpq(path: Path, keys: np.ndarray) -> Any:
    import faiss

    if path.is_file():
        index = faiss.read_index(str(path))
        if index.ntotal == len(keys):
            index.make_direct_map()
            return index
    index = build_ivfpq(keys)
    with atomic_file(path) as scratch:
        faiss.write_index(index, str(scratch))
    return index


_ARRAYS = ("keys.npy", "values.npy")


def _digests(folder: Path) -> dict[str, str]:
    """A BLAKE2b digest of each array file: a zeroed or truncated file no longer matches."""
    digests = {}
    for name in _ARRAYS:
        with (folder / name).open("rb") as file:
            digests[name] = hashlib.file_digest(file, "blake2b").hexdigest()
    return digests


def _problem(folder: Path, meta: dict[str, Any], corpus: str, model: str, key: str) -> str:
    """Why the saved datastore cannot serve (empty: it can): built from other passages, or
    its files differ from what was written."""
    if (meta.get("corpus"), meta.get("model"), meta.get("key")) != (corpus, model, key):
        return "was built from other passages"
    if "digests" not in meta:
        return "was written by an older rag-spec, without digests"
    try:
        if meta.get("digests") != _digests(folder):
            return "is damaged (its files differ from what was written)"
    except OSError as err:
        return f"is damaged ({err.strerror or err})"
    return ""


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _half_squared_norms(keys: torch.Tensor) -> torch.Tensor:
    """|x|^2 / 2 per key, in float32 from the stored precision, chunk by chunk."""
    return torch.cat([0.5 * keys[start:start + CHUNK_ROWS].float().pow(2).sum(1)
                      for start in range(0, len(keys), CHUNK_ROWS)])


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        msg = f"Unknown {name} {value!r}; use one of {', '.join(choices)}."
        raise RagSpecError(msg)
