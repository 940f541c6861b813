"""``from ubep import deep_ep``: DeepEP's API on ubep, the documented import for DeepEP programs
(``import deep_ep`` -> ``from ubep import deep_ep``; ``from ubep.deep_ep import Buffer``).

A re-export: the facade lives at its home, :mod:`ubep.torch.deep_ep` (it needs torch).
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

__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "EventOverlap",
    "InternodeHandle",
    "LowLatencyHandle",
    "NormalHandle",
    "topk_idx_t",
]
