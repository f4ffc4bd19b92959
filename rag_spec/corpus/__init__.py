"""Corpora: where passages come from (the standard library, installed packages, folders)."""

from __future__ import annotations

from collections.abc import Sequence

from rag_spec.corpus.docstrings import read_docstrings
from rag_spec.corpus.files import folder_documents
from rag_spec.corpus.passages import Passage, chunk, fingerprint, passages_from
from rag_spec.errors import RagSpecError

DEFAULT_SOURCES = ("stdlib",)


def load_passages(sources: Sequence[str] = DEFAULT_SOURCES) -> list[Passage]:
    """Passages from each source: ``"stdlib"``, ``"pkg:NAME"`` (installed package) or a folder."""
    passages: list[Passage] = []
    for source in sources:
        if source == "stdlib" or source.startswith("pkg:"):
            documents = read_docstrings(source)
        else:
            documents = folder_documents(source)
        found = passages_from(documents)
        if not found:
            msg = (f"The source {source!r} gave no passages: it holds no text of at least a few "
                   f"words (looked for .txt/.md/.rst/.py files, or docstrings). Point it at a "
                   f"folder with documents, or an installed package name as pkg:NAME.")
            raise RagSpecError(msg)
        passages.extend(found)
    return passages


__all__ = ["DEFAULT_SOURCES", "Passage", "chunk", "fingerprint", "load_passages"]
