"""The segment layout of a Buffer's config (``ubep.plane.layout`` places the records; this
module reads the config: dtypes, quantised rows, integrity)."""

from __future__ import annotations

from .. import dtypes as _dt
from .. import quant as _quant
from ..config import BufferConfig
from ..plane.layout import SegmentLayout, compute_layout

__all__ = ["layout_of"]


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


