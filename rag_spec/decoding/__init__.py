"""Lossless speculative decoding: token trees, drafters, verification and the decode loop."""

from rag_spec.decoding.decoder import (
    DecodeStats,
    GenerationResult,
    LookaheadConfig,
    LookaheadDecoder,
)
from rag_spec.decoding.draft_head import DraftHead, cached_head
from rag_spec.decoding.drafter import Drafter, DraftRequest, DraftSession, TargetView
from rag_spec.decoding.feature_drafter import FeatureDrafter
from rag_spec.decoding.merged_drafter import MergedDrafter
from rag_spec.decoding.model_drafter import DraftModelDrafter, EarlyExitDrafter
from rag_spec.decoding.runner import Runner, RunnerSettings
from rag_spec.decoding.sampling import SamplingParams
from rag_spec.decoding.self_drafter import SelfSpecDrafter
from rag_spec.decoding.tree import TokenTree
from rag_spec.decoding.tree_cache import TreeKVCache
from rag_spec.decoding.tree_expansion import Expansion
from rag_spec.decoding.trie_drafter import TrieConfig, TrieDrafter
from rag_spec.decoding.verify import Verdict, verify

__all__ = ["DecodeStats", "DraftHead", "DraftModelDrafter", "DraftRequest", "DraftSession",
           "Drafter", "EarlyExitDrafter", "Expansion", "FeatureDrafter", "GenerationResult",
           "LookaheadConfig", "LookaheadDecoder", "MergedDrafter", "Runner", "RunnerSettings",
           "SamplingParams", "SelfSpecDrafter", "TargetView", "TokenTree", "TreeKVCache",
           "TrieConfig", "TrieDrafter", "Verdict", "cached_head", "verify"]
