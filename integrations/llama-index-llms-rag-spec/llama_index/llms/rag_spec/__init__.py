"""LlamaIndex LLM for rag-spec: ``from llama_index.llms.rag_spec import LookaheadLLM``."""

from llama_index.llms.rag_spec.base import LookaheadLLM

__all__ = ["LookaheadLLM"]
