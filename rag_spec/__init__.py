"""rag-spec: faster RAG on local language models, with output identical to plain decoding.

Heavy modules (torch, transformers, faiss) load on first use of the name that needs them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "rag_spec.models",
    "LoadedModel": "rag_spec.models",
    "KnowledgeBase": "rag_spec.retrieval",
    "MilvusKnowledgeBase": "rag_spec.retrieval.milvus",
    "Embedder": "rag_spec.retrieval",
    "Hit": "rag_spec.retrieval",
    "Retriever": "rag_spec.retrieval",
    "LookaheadDecoder": "rag_spec.decoding",
    "LookaheadConfig": "rag_spec.decoding",
    "GenerationResult": "rag_spec.decoding",
    "TokenTree": "rag_spec.decoding",
    "TrieDrafter": "rag_spec.decoding",
    "DraftModelDrafter": "rag_spec.decoding",
    "EarlyExitDrafter": "rag_spec.decoding",
    "FeatureDrafter": "rag_spec.decoding",
    "MergedDrafter": "rag_spec.decoding",
    "SelfSpecDrafter": "rag_spec.decoding",
    "Expansion": "rag_spec.decoding",
    "SpecRetriever": "rag_spec.retrieval.spec_retriever",
    "IterativeRaLM": "rag_spec.serving.ralm",
    "LocalLM": "rag_spec.serving.local_lm",
    "GenerateOptions": "rag_spec.serving.local_lm",
    "KNNLM": "rag_spec.knnlm",
    "KNNDatastore": "rag_spec.knnlm",
    "KNNSpeculation": "rag_spec.knnlm",
    "RagSpecError": "rag_spec.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    msg = f"module 'rag_spec' has no attribute {name!r}"
    raise AttributeError(msg)
