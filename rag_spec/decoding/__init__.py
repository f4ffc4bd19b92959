"""Lossless speculative decoding: token trees, drafters, verification and the decode loop."""

from rag_spec.decoding.decoder import (
    DecodeStats,
    GenerationResult,
    LookaheadConfig,
    LookaheadDecoder,
)
from rag_spec.decoding.drafter import Drafter, DraftSession
from rag_spec.decoding.sampling import SamplingParams
from rag_spec.decoding.tree import TokenTree
from rag_spec.decoding.trie_drafter import TrieDrafter

__all__ = ["DecodeStats", "DraftSession", "Drafter", "GenerationResult", "LookaheadConfig",
           "LookaheadDecoder", "SamplingParams", "TokenTree", "TrieDrafter"]
