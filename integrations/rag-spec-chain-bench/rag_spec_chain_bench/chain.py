"""``rag-spec bench chain``: a LangChain RAG chain and a LlamaIndex query engine, as a user
builds them on the stock Hugging Face integrations, against the same pipelines with our classes
swapped in. End-to-end time per question (retrieval + generation), systems interleaved.

Stock LangChain: ``ChatHuggingFace`` over a ``HuggingFacePipeline`` and an
``InMemoryVectorStore``; stock LlamaIndex: ``HuggingFaceLLM`` and a ``VectorStoreIndex``.
Both stock stores hold the default corpus with the same MiniLM vectors as our knowledge base,
so all four systems see the same passages, model object, dtype and prompt; all decode greedily.

This module imports the frameworks (they are the peers measured), which is why it lives
beside the adapters and not in the library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rag_spec.bench.prompts import RAG_QUESTIONS
from rag_spec.bench.report import (
    DEQUANTIZED,
    Run,
    figure,
    interleaved,
    machine,
    median,
    publish,
    save_figure,
    setting,
)
from rag_spec.prompts import SYSTEM

PAIRS = {"langchain": ("langchain_stock", "langchain_rag_spec"),
         "llamaindex": ("llamaindex_stock", "llamaindex_rag_spec")}
K = 3
WARM_UP = "What does the os module provide?"


def run(json_out: str | None = None, limit: int | None = 12, max_new_tokens: int = 128,
        model_name: str = "smollm2-135m-instruct") -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON and a PNG plot; return the report."""
    from rag_spec.models import load_model
    from rag_spec.retrieval import KnowledgeBase

    lm = load_model(model_name)
    kb = KnowledgeBase.load_default("flat")
    questions = RAG_QUESTIONS[:limit]
    chains = {**langchain_chains(lm, kb, max_new_tokens),
              **llamaindex_engines(lm, kb, max_new_tokens)}

    def timed(answer: Any) -> Any:
        def system(question: str) -> Run:
            text = answer(question)
            return Run(0.0, lm.tokenizer(text, add_special_tokens=False)["input_ids"],
                       {"text": text})
        return system

    systems = {name: timed(answer) for name, answer in chains.items()}
    for system in systems.values():  # warm-up (a question outside the set: no trie memory)
        system(WARM_UP)
    runs = interleaved(systems, questions)
    report: dict[str, Any] = {"benchmark": "chain", "model": model_name, "dtype": str(lm.dtype),
                              "max_new_tokens": max_new_tokens, "k": K,
                              "questions": len(questions), "machine": machine(),
                              "systems": {}}
    for framework, (stock, ours) in PAIRS.items():
        speedups = [s.seconds / o.seconds for s, o in zip(runs[stock], runs[ours])]
        same = [s.extra["text"] == o.extra["text"] for s, o in zip(runs[stock], runs[ours])]
        for name in (stock, ours):
            report["systems"][name] = {
                "median_seconds": round(median([r.seconds for r in runs[name]]), 3),
                "tok_per_s": round(median([len(r.tokens) / r.seconds for r in runs[name]]), 2),
                "per_question_seconds": [round(r.seconds, 3) for r in runs[name]]}
        report[framework] = {"speedup": round(median(speedups), 3),
                             "min_speedup": round(min(speedups), 3),
                             "per_question_speedup": [round(s, 3) for s in speedups],
                             "identical_answers": sum(same),
                             "different": [q for q, ok in zip(questions, same) if not ok]}
    publish(report, json_out, "chain", _plot, _print_table)
    return report


def langchain_chains(lm: Any, kb: Any, max_new_tokens: int) -> dict[str, Any]:
    """Question -> answer callables: the stock LangChain RAG chain, and ours."""
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    from transformers import pipeline

    from langchain_rag_spec import ChatLookahead, SpecRetriever

    docs = [Document(page_content=p.text, metadata={"title": p.title}) for p in kb.passages]
    store = InMemoryVectorStore.from_documents(docs, _CorpusEmbeddings(kb))
    generator = pipeline("text-generation", model=lm.model, tokenizer=lm.tokenizer,
                         max_new_tokens=max_new_tokens, do_sample=False, return_full_text=False)
    stock_llm = ChatHuggingFace(llm=HuggingFacePipeline(pipeline=generator, model_id=lm.name),
                                tokenizer=lm.tokenizer)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM),
                                               ("human", "{context}\n\n{question}")])

    def chain(retriever: Any, llm: Any) -> Any:
        context = retriever | (lambda found: "\n\n".join(
            f"Documentation of {d.metadata['title']}:\n{d.page_content}" for d in found))
        return ({"context": context, "question": RunnablePassthrough()} | prompt | llm
                | StrOutputParser())

    stock = chain(store.as_retriever(search_kwargs={"k": K}), stock_llm)
    # the stock pipeline's weights (float32): its answers are what ours must equal
    ours = chain(SpecRetriever(source=kb, k=K), ChatLookahead(model=lm.name,
                                                             max_tokens=max_new_tokens,
                                                             lookahead=DEQUANTIZED))
    return {"langchain_stock": stock.invoke, "langchain_rag_spec": ours.invoke}


def llamaindex_engines(lm: Any, kb: Any, max_new_tokens: int) -> dict[str, Any]:
    """Question -> answer callables: the stock LlamaIndex query engine, and ours."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.embeddings.rag_spec import RagSpecEmbedding
    from llama_index.llms.huggingface import HuggingFaceLLM
    from llama_index.llms.rag_spec import LookaheadLLM
    from llama_index.retrievers.rag_spec import RagSpecRetriever
    from llama_index.retrievers.rag_spec.base import passage_node

    vectors = kb.index.cpu_index.reconstruct_n(0, len(kb))
    nodes = [passage_node(hit, vector.tolist()) for hit, vector in
             zip((kb.hit(i, 0.0) for i in range(len(kb))), vectors)]
    index = VectorStoreIndex(nodes, embed_model=RagSpecEmbedding())
    ours = LookaheadLLM(model=lm.name, max_new_tokens=max_new_tokens, lookahead=DEQUANTIZED)
    stock_llm = HuggingFaceLLM(model=lm.model, tokenizer=lm.tokenizer, model_name=lm.name,
                               max_new_tokens=max_new_tokens, is_chat_model=True,
                               context_window=ours.metadata.context_window,
                               generate_kwargs={"do_sample": False})
    stock = index.as_query_engine(llm=stock_llm, similarity_top_k=K)
    fast = RetrieverQueryEngine.from_args(RagSpecRetriever(kb, similarity_top_k=K), llm=ours)
    return {"llamaindex_stock": lambda q: str(stock.query(q)),
            "llamaindex_rag_spec": lambda q: str(fast.query(q))}


class _CorpusEmbeddings:
    """The knowledge base's stored passage vectors (no re-embedding); queries via MiniLM."""

    def __init__(self, kb: Any) -> None:
        vectors = kb.index.cpu_index.reconstruct_n(0, len(kb))
        self.by_text = {p.text: v.tolist() for p, v in zip(kb.passages, vectors)}

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.by_text[t] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        from langchain_rag_spec import RagSpecEmbeddings

        return RagSpecEmbeddings().embed_query(text)


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, axes = figure(2, (12, 4.5))
    for ax, (framework, (stock, ours)) in zip(axes, PAIRS.items()):
        systems = report["systems"]
        x = range(report["questions"])
        ax.bar([i - 0.2 for i in x], systems[stock]["per_question_seconds"], 0.4, label=stock)
        ax.bar([i + 0.2 for i in x], systems[ours]["per_question_seconds"], 0.4, label=ours)
        ax.set_xlabel("question")
        ax.set_ylabel("end-to-end seconds (retrieval + generation)")
        result = report[framework]
        ax.set_title(f"{framework}: median {result['speedup']:.2f}x, "
                     f"{result['identical_answers']}/{report['questions']} identical")
        ax.legend()
    save_figure(fig, path, f"{setting(report)}, up to {report['max_new_tokens']} new tokens, "
                           f"k={report['k']}")


def _print_table(report: dict[str, Any]) -> None:
    n = report["questions"]
    print(f"\n{'system':22} {'median s':>9} {'tok/s':>7}")
    for name, s in report["systems"].items():
        print(f"{name:22} {s['median_seconds']:9.2f} {s['tok_per_s']:7.1f}")
    for framework in PAIRS:
        r = report[framework]
        print(f"{framework}: {r['speedup']:.2f}x median (min {r['min_speedup']:.2f}x), "
              f"{r['identical_answers']}/{n} identical answers")
