"""``rag-spec bench chain``: LangChain and LlamaIndex RAG pipelines, stock classes against ours.

It lives beside the adapters because it imports both frameworks; the rag-spec CLI finds it
through the ``rag_spec.benchmarks`` entry point, so the library itself imports no framework.
"""
