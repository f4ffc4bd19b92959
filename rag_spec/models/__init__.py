"""Local language models: the embedded default and any Hugging Face folder."""

from rag_spec.models.embedded import pull
from rag_spec.models.loader import LoadedModel, load_model
from rag_spec.models.registry import DEFAULT_MODEL, EMBEDDED_MODELS

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "LoadedModel", "load_model", "pull"]
