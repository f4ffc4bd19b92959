"""Drop-in: the stock LangChain chain (ChatHuggingFace) and LlamaIndex query engine
(HuggingFaceLLM) and ours give the same greedy answers on RAG questions."""

import pytest

from rag_spec.bench.prompts import RAG_QUESTIONS
from rag_spec_chain_bench.chain import langchain_chains, llamaindex_engines

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("user_cache")]


@pytest.fixture(scope="module")
def setting():
    from rag_spec import KnowledgeBase, load_model

    return load_model(), KnowledgeBase.load_default("flat")


@pytest.mark.parametrize("build", [langchain_chains, llamaindex_engines])
def test_same_answers_as_the_stock_integration(setting, build):
    lm, kb = setting
    (stock_name, stock), (ours_name, ours) = build(lm, kb, max_new_tokens=48).items()
    assert stock_name.endswith("stock") and ours_name.endswith("rag_spec")
    for question in RAG_QUESTIONS[:3]:
        answer = ours(question)
        assert answer.strip()
        assert answer == stock(question)
