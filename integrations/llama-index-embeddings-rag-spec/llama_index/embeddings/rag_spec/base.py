"""``RagSpecEmbedding``: the bundled MiniLM as LlamaIndex embeddings, offline."""

from __future__ import annotations

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding

from rag_spec import DEFAULT_EMBEDDER, Embedder, run_in_compute_thread


class RagSpecEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 from a PyPI wheel; LlamaIndex's default would call a remote API.

    Examples:
        >>> from llama_index.core import Settings                         # doctest: +SKIP
        >>> Settings.embed_model = RagSpecEmbedding()                     # doctest: +SKIP
    """

    model_name: str = DEFAULT_EMBEDDER

    @classmethod
    def class_name(cls) -> str:
        return "RagSpecEmbedding"

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return Embedder.default().encode(texts).tolist()

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._get_text_embedding(query)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await run_in_compute_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return await run_in_compute_thread(self._get_text_embedding, text)
