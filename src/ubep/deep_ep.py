"""``from ubep import deep_ep``: DeepEP's API on ubep, the documented import for DeepEP programs
(``import deep_ep`` -> ``from ubep import deep_ep``; ``from ubep.deep_ep import Buffer``), V1's
``Buffer`` and V2's ``ElasticBuffer`` (DeepEP 2.1) and ``EPBuffer`` (2.5).

A re-export: the facades live at their homes, :mod:`ubep.torch.deep_ep` and
:mod:`ubep.torch.deep_ep_v2` (they need torch).
"""

from .torch.deep_ep import (
    Buffer,
    Config,
    EventHandle,
    EventOverlap,
    InternodeHandle,
    LowLatencyHandle,
    NormalHandle,
    topk_idx_t,
)
from .torch.deep_ep_v2 import (
    ElasticBuffer,
    EPBuffer,
    get_logical_domain_size,
    get_physical_domain_size,
)
from .torch.deep_ep_v2_types import (
    BufferAllocator,
    EPHandle,
    get_num_allocation_alignment,
    get_num_rdma_alignment,
    get_num_tma_alignment,
)

__all__ = [
    "Buffer",
    "BufferAllocator",
    "Config",
    "EPBuffer",
    "EPHandle",
    "ElasticBuffer",
    "EventHandle",
    "EventOverlap",
    "InternodeHandle",
    "LowLatencyHandle",
    "NormalHandle",
    "get_logical_domain_size",
    "get_num_allocation_alignment",
    "get_num_rdma_alignment",
    "get_num_tma_alignment",
    "get_physical_domain_size",
    "topk_idx_t",
]
