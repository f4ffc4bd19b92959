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
    "load_passages": "rag_spec.corpus",
    "chat_input_ids": "rag_spec.prompts",
    "rag_messages": "rag_spec.prompts",
    "ask": "rag_spec.serving.ask",
    "DelayedRetriever": "rag_spec.bench.simulated",
    "first_layers_folder": "rag_spec.bench.draft",
    "MilvusKnowledgeBase": "rag_spec.retrieval.milvus",
    "Embedder": "rag_spec.retrieval",
    "Hit": "rag_spec.retrieval",
    "Retriever": "rag_spec.retrieval",
    "LookaheadDecoder": "rag_spec.engine.decoder",
    "LookaheadConfig": "rag_spec.engine.decoder",
    "GenerationResult": "rag_spec.engine.batch",
    "JsonSchema": "rag_spec.engine.verify.grammar",
    "IncompleteOutputWarning": "rag_spec.errors",
    "TokenTree": "rag_spec.target.tree",
    "TrieDrafter": "rag_spec.drafters.trie_drafter",
    "SuffixIndex": "rag_spec.drafters.suffix_index",
    "DraftModelDrafter": "rag_spec.drafters.model_drafter",
    "EarlyExitDrafter": "rag_spec.drafters.model_drafter",
    "FeatureDrafter": "rag_spec.drafters.feature_drafter",
    "MergedDrafter": "rag_spec.drafters.merged_drafter",
    "SelfSpecDrafter": "rag_spec.drafters.self_drafter",
    "Expansion": "rag_spec.policy.expansion",
    "Drafter": "rag_spec.drafters.drafter",
    "DraftRequest": "rag_spec.drafters.drafter",
    "DraftSession": "rag_spec.drafters.drafter",
    "TargetView": "rag_spec.drafters.drafter",
    "SpecRetriever": "rag_spec.retrieval.spec_retriever",
    "IterativeRaLM": "rag_spec.serving.ralm",
    "RaLMSpeculation": "rag_spec.serving.ralm",
    "LocalLM": "rag_spec.serving.local_lm",
    "GenerateOptions": "rag_spec.serving.local_lm",
    "serve": "rag_spec.serving.server",
    "Server": "rag_spec.serving.server",
    "ServedModel": "rag_spec.serving.served_model",
    "create_app": "rag_spec.serving.server",
    "KNNLM": "rag_spec.knnlm",
    "KNNDatastore": "rag_spec.knnlm",
    "KNNSpeculation": "rag_spec.knnlm",
    "RagSpecError": "rag_spec.errors",
    # what the partner packages (integrations/) build on
    "DEFAULT_MODEL": "rag_spec.models.registry",
    "DEFAULT_EMBEDDER": "rag_spec.retrieval.embedder",
    "Completion": "rag_spec.serving.local_lm",
    "Chunk": "rag_spec.serving.local_lm",
    "Prompt": "rag_spec.serving.local_lm",
    "BatchingRetriever": "rag_spec.retrieval.batching",
    "require_retriever": "rag_spec.retrieval.types",
    "stable_id": "rag_spec.retrieval.types",
    "side_by_side": "rag_spec.threads",
    "run_in_compute_thread": "rag_spec.threads",
    "Tool": "rag_spec.serving.tools",
    "ToolCall": "rag_spec.serving.tools",
    "call_grammar": "rag_spec.serving.tools",
    "CallFormat": "rag_spec.serving.tools",
    "call_format": "rag_spec.serving.tools",
    "tool_options": "rag_spec.serving.tools",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    msg = f"module 'rag_spec' has no attribute {name!r}"
    raise AttributeError(msg)
