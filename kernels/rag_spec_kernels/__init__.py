"""CPU kernels for verifying token trees: tree attention that reads each KV head once, and
oneDNN linear layers that keep few-token steps cheap. Nothing here modifies a caller's model:
the decoder's runner puts these into its private copy of the module tree."""

from rag_spec_kernels.onednn_linear import (
    LinearStack,
    OneDNNLinear,
    is_plain_linear,
    linear_stacks,
    onednn_available,
    onednn_ops_available,
    pack_weight,
    packed_linear,
)
from rag_spec_kernels.tree_attention import (
    TREE_ATTENTION,
    register_tree_attention,
    tree_attention,
)

__all__ = ["TREE_ATTENTION", "LinearStack", "OneDNNLinear", "is_plain_linear", "linear_stacks",
           "onednn_available", "onednn_ops_available", "pack_weight", "packed_linear",
           "register_tree_attention", "tree_attention"]
