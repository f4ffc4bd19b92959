"""A LlamaIndex query engine over the default corpus (Python's standard library docs), running
on the embedded model with rag-spec's retriever and LLM; it prints the answer and the speed.

    python docs/examples/llamaindex_query_engine.py "How do I read rows from a CSV file?"
"""

import sys
import time

from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.llms.rag_spec import LookaheadLLM
from llama_index.retrievers.rag_spec import RagSpecRetriever


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "How do I read rows from a CSV file?"
    llm = LookaheadLLM(max_new_tokens=128)
    engine = RetrieverQueryEngine.from_args(RagSpecRetriever(similarity_top_k=3), llm=llm,
                                            streaming=True)
    engine.query(question).get_response()  # warm-up: loads the model and the index once

    started = time.perf_counter()
    response = engine.query(question)
    pieces = []
    for piece in response.response_gen:
        print(piece, end="", flush=True)
        pieces.append(piece)
    seconds = time.perf_counter() - started
    words = len("".join(pieces).split())
    print(f"\n\nsources: {[n.node.metadata['title'] for n in response.source_nodes]}")
    print(f"{words} words in {seconds:.2f} s end to end ({words / seconds:.1f} words/s)")


if __name__ == "__main__":
    main()
