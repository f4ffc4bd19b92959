"""LlamaIndex indexes and retrievers seen as rag_spec Retrievers (queries in, Hits out)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.indices.base import BaseIndex
from llama_index.core.schema import NodeWithScore

from rag_spec import Hit, Retriever, require_retriever, side_by_side, stable_id


class LlamaIndexSource:
    """Searches a LlamaIndex index (any vector store behind it: ``MilvusVectorStore``, ...) or
    retriever; the queries of one batch run side by side, since LlamaIndex searches one query
    per call.

    An index is searched with ``as_retriever(similarity_top_k=k)``, so prefetching gets the
    passages it asks for; a retriever returns its own number. A node's id becomes the hit's
    ``doc_id`` (hashed), so equal nodes are one passage to speculation.
    """

    def __init__(self, source: BaseIndex | BaseRetriever) -> None:
        self.source = source

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        return side_by_side(lambda query: self._search(query, k), list(queries))

    def _search(self, query: str, k: int) -> list[Hit]:
        retriever = (self.source.as_retriever(similarity_top_k=k)
                     if isinstance(self.source, BaseIndex) else self.source)
        return [_hit(node, rank) for rank, node in enumerate(retriever.retrieve(query)[:k])]


def _hit(scored: NodeWithScore, rank: int) -> Hit:
    node = scored.node
    title = str(node.metadata.get("title") or node.metadata.get("file_name") or "")
    score = scored.score if scored.score is not None else 1.0 / (rank + 1)
    return Hit(doc_id=stable_id(node.node_id), score=float(score), title=title,
               text=node.get_content())


def as_retriever(source: Any) -> Retriever:
    """A rag_spec Retriever for ``source`` (LlamaIndex objects are translated)."""
    if isinstance(source, BaseIndex | BaseRetriever):
        return LlamaIndexSource(source)
    return require_retriever(source, "a rag_spec KnowledgeBase (local or Milvus), a LlamaIndex "
                                     "index or retriever")
