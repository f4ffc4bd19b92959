"""kNN-LM: a language model interpolated with nearest neighbours from a datastore of its own
hidden states, served naively or with speculative retrieval."""

from rag_spec.knnlm.datastore import KNNDatastore
from rag_spec.knnlm.knnlm import KNNLM, KNNResult, KNNSpeculation, KNNStats

__all__ = ["KNNLM", "KNNDatastore", "KNNResult", "KNNStats", "KNNSpeculation"]
