"""Serving loops: one-shot RAG answers and iterative retrieval-augmented generation."""
