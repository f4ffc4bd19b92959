"""CPU kernels for verifying token trees: tree attention that reads each KV head once, and
oneDNN linear layers that keep few-token steps cheap."""

from rag_spec_kernels.onednn_linear import (
    onednn_available,
    onednn_ops_available,
    pack_weight,
    packed_linear,
    use_onednn_linear,
)
from rag_spec_kernels.tree_attention import TREE_ATTENTION, tree_attention, use_tree_attention

__all__ = ["TREE_ATTENTION", "onednn_available", "onednn_ops_available", "pack_weight",
           "packed_linear", "tree_attention", "use_onednn_linear", "use_tree_attention"]
