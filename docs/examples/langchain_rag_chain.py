"""A LangChain LCEL RAG chain over the default corpus (Python's standard library docs),
running on the embedded model with rag-spec's retriever and chat model.

    python docs/examples/langchain_rag_chain.py "How do I copy a whole directory tree?"
"""

import sys
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from langchain_rag_spec import ChatLookahead, SpecRetriever


def format_docs(docs):
    return "\n\n".join(f"Documentation of {d.metadata['title']}:\n{d.page_content}" for d in docs)


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "How do I copy a whole directory tree?"
    retriever = SpecRetriever(k=3)  # the default knowledge base: flat faiss over MiniLM vectors
    llm = ChatLookahead(max_tokens=128)  # the embedded SmolLM2-135M-Instruct, lookahead decoding
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You answer questions about Python using the documentation given."),
        ("human", "{context}\n\n{question}"),
    ])
    chain = ({"context": retriever | format_docs, "question": RunnablePassthrough()}
             | prompt | llm)
    chain.invoke(question)  # warm-up: loads the model and the index once

    started = time.perf_counter()
    message = None
    for chunk in chain.stream(question):  # the answer arrives in accepted chunks
        print(chunk.content, end="", flush=True)
        message = chunk if message is None else message + chunk
    seconds = time.perf_counter() - started
    stats = message.response_metadata["speculation"]
    tokens = message.usage_metadata["output_tokens"]
    print(f"\n\n{tokens} tokens in {seconds:.2f} s end to end ({tokens / seconds:.1f} tok/s); "
          f"{stats['tokens_per_step']:.2f} tokens per forward pass")
    print("answer only:", (chain | StrOutputParser()).invoke(question)[:60], "...")


if __name__ == "__main__":
    main()
