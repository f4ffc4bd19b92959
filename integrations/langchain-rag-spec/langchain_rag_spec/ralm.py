"""``IterativeRaLM``: question in, answer out, retrieving every few tokens (RaLMSpec)."""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import PrivateAttr

from langchain_rag_spec.chat_models import ChatLookahead
from langchain_rag_spec.llms import LookaheadLLM
from langchain_rag_spec.retrievers import RagSpecRetriever, SpecRetriever
from rag_spec import IterativeRaLM as RaLM
from rag_spec import SpecRetriever as SpeculativeSearch


class IterativeRaLM(RunnableSerializable[str, str]):
    """Iterative retrieval-augmented generation as a Runnable.

    Every ``stride`` tokens the latest ``query_tokens`` tokens query ``retriever`` and the top
    passage replaces the one in the prompt. Swapping in a ``SpecRetriever`` (or passing
    ``speculative=True``) guesses retrievals from a per-request cache and verifies them in
    batches, asynchronously; each stride is then decoded by the LLM's lookahead decoder. The
    answer is the same as the plain loop's.

    Examples:
        >>> chain = IterativeRaLM(llm=ChatLookahead(), retriever=SpecRetriever())  # doctest: +SKIP
        >>> chain.invoke("How do I copy a file?")                                   # doctest: +SKIP
    """

    llm: ChatLookahead | LookaheadLLM
    retriever: RagSpecRetriever
    speculative: bool | None = None  # None: when the retriever is a SpecRetriever
    stride: int = 4
    query_tokens: int = 32
    k: int = 1
    max_tokens: int = 128
    _loops: dict[tuple[Any, ...], RaLM] = PrivateAttr(default_factory=dict)

    def invoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return self._call_with_config(self._answer, input, config, **kwargs)

    def _answer(self, question: str) -> str:
        local = self.llm.local_lm()
        search = self.retriever.backend()
        speculative = isinstance(self.retriever, SpecRetriever) if self.speculative is None \
            else self.speculative
        # One loop per setting, kept: its stride scheduler learns from every request.
        key = (local, search, speculative, self.stride, self.query_tokens, self.k)
        ralm = self._loops.get(key)
        if ralm is None:
            ralm = self._loops.setdefault(key, RaLM(
                local.lm, SpeculativeSearch(search) if speculative else search,
                stride=self.stride, query_tokens=self.query_tokens, k=self.k,
                lookahead=local.decoder if speculative else None))
        with local.exclusive():  # the model computes for one caller at a time
            return ralm.generate(question, max_new_tokens=self.max_tokens).text
