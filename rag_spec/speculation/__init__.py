"""Speculative retrieval's one loop (RaLMSpec): guess each retrieval, decode on the guess,
verify a stride of guesses with one call, roll back to the first wrong one. Iterative RaLM
(``serving.ralm``) and kNN-LM (``knnlm``) each say what a guess, a verification and a roll back
are (``Speculation``); the loop, the stride schedule and the pipeline of verifications in flight
are shared."""

from rag_spec.speculation.loop import Cancel, Speculation, SpeculationTally, speculate

__all__ = ["Cancel", "Speculation", "SpeculationTally", "speculate"]
