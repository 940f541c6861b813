"""Where a Buffer's results live: views of the receive regions, the one allocation of a
dispatch's int64 outputs, results built without their constructors, and the segment layout of a
config."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import numpy as np

from .. import dtypes as _dt
from .. import quant as _quant
from ..config import BufferConfig
from ..handle import DispatchHandle
from ..runtime.layout import SegmentLayout, compute_layout

__all__ = ["combine_region", "int64_outputs", "layout_of", "new_frozen", "rows_view"]

_T = TypeVar("_T")


def new_frozen(cls: type[_T], **fields: Any) -> _T:
    """Build a frozen dataclass instance without ``__init__``/``__post_init__``.

    Only for results this module assembles itself, whose consistency holds by construction:
    the generated frozen ``__init__`` plus the handle's checks cost ~12 us per dispatch, more
    than the rest of the Python side together. Every field must be given.
    """
    obj = object.__new__(cls)
    assert fields.keys() == _field_names(cls)  # type: ignore[arg-type]
    object.__setattr__(obj, "__dict__", fields)  # the call's own fresh dict: no copy
    return obj


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(cls.__dataclass_fields__)  # type: ignore[attr-defined]


def int64_outputs(cap: int, K: int, L: int, R: int, ntok: int,
                   expert: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A dispatch's int64 outputs as views of one allocation (one malloc, not four):
    ``recv_topk_idx``, ``meta`` (recv_src_rank, recv_src_token, recv_src_k), ``counts`` (per
    local expert, then rows per source rank) and ``send_dst_row``."""
    w_idx, w_dst = (1, K) if expert else (K, R)
    a = cap * w_idx
    b = a + 3 * cap
    c = b + L + R
    block = np.empty(c + ntok * w_dst, np.int64)
    o_idx = block[:a]
    return (o_idx if expert else o_idx.reshape(cap, K), block[a:b].reshape(3, cap), block[b:c],
            block[c:].reshape(ntok, w_dst))


def combine_region(h: DispatchHandle) -> int:
    index = getattr(h, "dispatch_index", -1)
    return int(index) % 2 if index >= 0 else 0


def rows_view(region: np.ndarray, lay: SegmentLayout, dtype: np.dtype, offset: int,
               width: int) -> np.ndarray:
    """Read-only ``[cap_rows, width]`` view of ``dtype`` elements starting ``offset`` bytes into
    each row of a receive region."""
    view = np.ndarray((lay.cap_rows, width), dtype=dtype, buffer=region, offset=offset,
                      strides=(lay.out_stride, dtype.itemsize))
    view.flags.writeable = False
    return view


def layout_of(config: BufferConfig, num_ranks: int, num_cores: int) -> SegmentLayout:
    dt = _dt.dtype_of(config.dtype)
    cdt = _dt.dtype_of(config.combine_dtype)
    return compute_layout(
        num_ranks=num_ranks,
        num_cores=num_cores,
        num_experts=config.num_experts,
        num_topk=config.num_topk,
        max_tokens=config.max_tokens_per_rank,
        hidden=config.hidden,
        itemsize=dt.itemsize,
        combine_itemsize=cdt.itemsize,
        layout=config.layout,
        engine=config.engine,
        sync=config.sync,
        tff_block_bytes=config.tff_block_bytes,
        tff_flag_bytes=config.tff_flag_bytes,
        integrity=config.integrity == "checksum",
        row_bytes=None if config.quant is None else _quant.row_bytes(config.hidden),
    )


