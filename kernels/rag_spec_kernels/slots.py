"""The KV cache's compaction after a step, in every layer at once.

After a verification pass each row keeps its root and accepted path, moved to the front of the
round's slots in every layer's keys and values: three torch operations per tensor (an index,
a gather, a copy), 180 calls a step over the default model's 60 tensors, each costing more to
call than to do (docs/concepts.md, "Why the defaults").
``move_slots.cpp`` moves them all in one call; elsewhere (a GPU, a CPU where the kernels do not
build) torch's operations run, with the same result.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from rag_spec_kernels.cpu_extension import cpu_extension, vector_isa

log = logging.getLogger(__name__)

torch.library.define("rag_spec_cpu::move_slots",  # its CPU kernel: move_slots.cpp
                     "(Tensor(a!)[] tensors, Tensor index, int start) -> ()")


@functools.cache
def slots_kernel_available() -> bool:
    """Whether the C++ kernel moves CPU slots here (it builds with the other CPU kernels)."""
    if vector_isa() is None:
        return False
    try:
        cpu_extension()
    except Exception as error:  # noqa: BLE001 - any build failure means: torch's operations
        log.warning("rag-spec: the CPU kernels did not build (%s); the cache moves slots with "
                    "torch's operations", error)
        return False
    return True


def move_slots(tensors: Sequence[torch.Tensor], index: torch.Tensor, start: int) -> None:
    """In place, for every [rows, heads, slots, dim] tensor: slot ``start + j`` of row b takes
    what slot ``index[b, j]`` held (every slot read before any is written)."""
    if tensors and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors) \
            and slots_kernel_available():
        torch.ops.rag_spec_cpu.move_slots(list(tensors), index.cpu(), start)
        return
    width = index.shape[1]
    if tensors:  # copied to the tensors' device once, not once per tensor
        index = index.to(tensors[0].device)
    for tensor in tensors:
        gather = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
        tensor[:, :, start:start + width] = tensor.gather(2, gather)
