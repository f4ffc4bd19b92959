"""``RagSpecRetriever``: a LlamaIndex retriever over a rag_spec knowledge base.

It searches; it does not speculate (LlamaIndex has no iterative-retrieval loop to speculate
in): ``rag_spec.SpecRetriever`` and LangChain's ``SpecRetriever`` are the speculative ones.
``SpecRetriever``, this class's first name, still works and warns."""

from __future__ import annotations

import warnings
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.retrievers.rag_spec._sources import as_retriever

from rag_spec import BatchingRetriever, Hit, KnowledgeBase, Retriever


class RagSpecRetriever(BaseRetriever):
    """Top ``similarity_top_k`` passages as ``NodeWithScore``; concurrent calls share a search.

    Args:
        knowledge_base: a rag_spec KnowledgeBase (local or ``MilvusKnowledgeBase``), any
            rag_spec Retriever, or a LlamaIndex index or retriever (e.g. a ``VectorStoreIndex``
            over a ``MilvusVectorStore``); ``None`` opens the default knowledge base with index
            ``kind`` ("flat", "hnsw", "ivf", "bm25").

    Examples:
        >>> from llama_index.core.query_engine import RetrieverQueryEngine          # doctest: +SKIP
        >>> RetrieverQueryEngine.from_args(RagSpecRetriever(), llm=LookaheadLLM())  # doctest: +SKIP
    """

    def __init__(self, knowledge_base: Retriever | None = None, *, kind: str = "flat",
                 similarity_top_k: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._source = knowledge_base
        self._kind = kind
        self.similarity_top_k = similarity_top_k
        self._backend: BatchingRetriever | None = None

    def backend(self) -> BatchingRetriever:
        """The rag_spec Retriever that answers (opened on first use)."""
        if self._backend is None:
            source = KnowledgeBase.load_default(self._kind) if self._source is None \
                else self._source  # an empty knowledge base is falsy, and still the user's
            self._backend = BatchingRetriever(as_retriever(source))
        return self._backend

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return _scored(self.backend().search([query_bundle.query_str], self.similarity_top_k)[0])

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = await self.backend().asearch([query_bundle.query_str], self.similarity_top_k)
        return _scored(hits[0])


class SpecRetriever(RagSpecRetriever):
    """``RagSpecRetriever`` under its first name, which said speculation where there is none."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn("llama_index.retrievers.rag_spec.SpecRetriever is RagSpecRetriever: a "
                      "plain retriever (rag_spec.SpecRetriever is the speculative one); "
                      "import RagSpecRetriever instead.", DeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)


def _scored(hits: list[Hit]) -> list[NodeWithScore]:
    return [NodeWithScore(node=passage_node(hit), score=hit.score) for hit in hits]


def passage_node(hit: Hit, embedding: list[float] | None = None) -> TextNode:
    """A passage as a LlamaIndex node: the LLM sees its title and text, not its id."""
    return TextNode(text=hit.text, id_=f"rag-spec-{hit.doc_id}", embedding=embedding,
                    metadata={"title": hit.title, "doc_id": hit.doc_id},
                    excluded_llm_metadata_keys=["doc_id"],
                    excluded_embed_metadata_keys=["doc_id", "title"])
