"""Kernels for verifying token trees: attention under a compact tree mask that reads each KV
head once (ours in C++ on AVX-512 CPUs, else torch; Triton on a GPU), linear layers that keep
few-token steps cheap on the CPU (oneDNN's kernels, or on AVX-512 and AVX2 our streamed one,
and ours over a GGUF file's quantised blocks),
the KV cache's compaction after a step in one call (C++ on a CPU), and exact numerics for half
precision (each token of a step bit for bit as a one-token step). Nothing here modifies a
caller's model: the decoder's runner puts these into its private copy of the module tree."""

from rag_spec_kernels.cpu_attention import (
    cpu_attention_available,
    cpu_attention_fits,
    cpu_tree_attention,
    row_attention,
    row_attention_available,
)
from rag_spec_kernels.cpu_extension import cpu_info, vector_flags
from rag_spec_kernels.exact import (
    EXACT_TREE_ATTENTION,
    RowChunkedLinear,
    exact_tree_attention,
    invariant_rows,
    whole_rows,
)
from rag_spec_kernels.mask import SparseView, TreeMask, reference_attention, tree_pass
from rag_spec_kernels.onednn_linear import (
    LinearStack,
    OneDNNLinear,
    TracedLinear,
    is_plain_linear,
    linear_stacks,
    onednn_available,
    onednn_ops_available,
    onednn_packs,
    pack_weight,
    packed_linear,
    stack_table,
)
from rag_spec_kernels.quantized import (
    GroupQuantized,
    pack_quantized,
    quantized_available,
    quantized_linear,
    quantized_reference,
    stacked,
)
from rag_spec_kernels.slots import move_slots, slots_kernel_available
from rag_spec_kernels.streamed import pack_streamed, streamed_available, streamed_linear
from rag_spec_kernels.tree_attention import (
    TREE_ATTENTION,
    TREE_ATTENTION_ROWS,
    TREE_ATTENTION_SDPA,
    register_tree_attention,
    tree_attention,
)

__all__ = ["EXACT_TREE_ATTENTION", "GroupQuantized", "LinearStack", "OneDNNLinear",
           "RowChunkedLinear", "SparseView", "TREE_ATTENTION", "TREE_ATTENTION_ROWS",
           "TREE_ATTENTION_SDPA",
           "TracedLinear", "TreeMask",
           "cpu_attention_available", "cpu_attention_fits", "cpu_info", "cpu_tree_attention",
           "exact_tree_attention", "invariant_rows", "is_plain_linear", "linear_stacks",
           "move_slots", "onednn_available", "onednn_ops_available", "onednn_packs",
           "pack_quantized", "pack_streamed", "pack_weight", "packed_linear", "quantized_available",
           "quantized_linear", "quantized_reference", "reference_attention",
           "register_tree_attention", "row_attention", "row_attention_available",
           "slots_kernel_available", "stack_table", "stacked",
           "streamed_available", "streamed_linear", "tree_attention", "tree_pass", "vector_flags",
           "whole_rows"]
