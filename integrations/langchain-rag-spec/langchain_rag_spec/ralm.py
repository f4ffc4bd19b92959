"""``IterativeRaLM``: question in, answer out, retrieving every few tokens (RaLMSpec)."""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, PrivateAttr, model_validator

from langchain_rag_spec.chat_models import ChatLookahead
from langchain_rag_spec.llms import LookaheadLLM
from langchain_rag_spec.retrievers import RagSpecRetriever, SpecRetriever
from rag_spec import IterativeRaLM as RaLM
from rag_spec import ServedModel
from rag_spec import SpecRetriever as SpeculativeSearch


class IterativeRaLM(RunnableSerializable[str, str]):
    """Iterative retrieval-augmented generation as a Runnable.

    Every ``stride`` tokens the latest ``query_tokens`` tokens query ``retriever`` and the top
    passage replaces the one in the prompt. Swapping in a ``SpecRetriever`` (or passing
    ``speculative=True``) guesses retrievals from a per-request cache and verifies them in
    batches, asynchronously; each stride is then decoded by the LLM's lookahead decoder. The
    answer is the same as the plain loop's. With ``served`` (a ``rag_spec.ServedModel``) in
    place of ``llm``, the strides are requests to a model behind a server (``rag-spec serve``),
    which drafts there; the answer is still the plain loop's against that server.

    Examples:
        >>> chain = IterativeRaLM(llm=ChatLookahead(), retriever=SpecRetriever())  # doctest: +SKIP
        >>> chain.invoke("How do I copy a file?")                                   # doctest: +SKIP
        >>> IterativeRaLM(served=ServedModel("http://127.0.0.1:8000"),
        ...               retriever=SpecRetriever())                              # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    llm: ChatLookahead | LookaheadLLM | None = None
    served: ServedModel | None = None  # a model behind a server, in place of ``llm``
    retriever: RagSpecRetriever
    speculative: bool | None = None  # None: when the retriever is a SpecRetriever
    stride: int = 4
    query_tokens: int = 32
    k: int = 1
    max_tokens: int = 128
    _loops: dict[tuple[Any, ...], RaLM] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _one_model(self) -> IterativeRaLM:
        if (self.llm is None) == (self.served is None):
            msg = ("IterativeRaLM takes one model: llm=ChatLookahead(...) (or LookaheadLLM) in "
                   "this process, or served=rag_spec.ServedModel(url) behind a server.")
            raise ValueError(msg)
        return self

    def invoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return self._call_with_config(self._answer, input, config, **kwargs)

    def _answer(self, question: str) -> str:
        search = self.retriever.backend()
        speculative = isinstance(self.retriever, SpecRetriever) if self.speculative is None \
            else self.speculative
        if self.served is not None:  # the server decodes; requests need no lock here
            key = (self.served, search, speculative, self.stride, self.query_tokens, self.k)
            ralm = self._loops.get(key) or self._loops.setdefault(key, RaLM(
                self.served, SpeculativeSearch(search) if speculative else search,
                stride=self.stride, query_tokens=self.query_tokens, k=self.k))
            return ralm.generate(question, max_new_tokens=self.max_tokens).text
        local = self.llm.local_lm()
        # One loop per setting, kept: its stride scheduler learns from every request.
        key = (local, search, speculative, self.stride, self.query_tokens, self.k)
        ralm = self._loops.get(key)
        if ralm is None:  # both loops decode on the chat model's decoder, so on its weights
            # (a GGUF file's, by default): the same answer whether or not retrieval speculates
            ralm = self._loops.setdefault(key, RaLM(
                local.lm, SpeculativeSearch(search) if speculative else search,
                stride=self.stride, query_tokens=self.query_tokens, k=self.k,
                lookahead=local.decoder))
        with local.exclusive():  # the model computes for one caller at a time
            return ralm.generate(question, max_new_tokens=self.max_tokens).text
