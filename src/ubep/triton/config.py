"""``TritonConfig``: the shape and behaviour of one Triton engine (identical on every rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..dtypes import dtype_of
from ..errors import InvalidArgumentError
from ..modes import FLOAT_DTYPE_NAMES, LAYOUTS, POLICIES, supports
from .sync import DEFAULT_SYNC, sync_row

__all__ = ["TritonConfig", "from_buffer_config"]


@dataclass(frozen=True)
class TritonConfig:
    """Fields as ``ubep.BufferConfig``'s of the same names, and:

    Attributes:
        device: ``"cpu"`` (Triton's interpreter on shared memory) or a CUDA device.
        num_send_programs: programs of the send launch (the Plan's send cores) and of the
            combine's push and reduce launches.
        num_count_programs: programs of the count launch (the Plan's count cores).
        spins: polls of one wait inside one launch before the program gives up for that launch
            (the host launches it again until ``timeout_s``); ``None``: 64 on a CPU, 2^20 on a
            GPU.
    """

    max_tokens_per_rank: int
    hidden: int
    num_topk: int
    num_experts: int
    dtype: str = "bf16"
    combine_dtype: str | None = None
    layout: str = "expert"
    sync: str = DEFAULT_SYNC
    policy: str = "hierarchical"
    timeout_s: float = 60.0
    device: str = "cpu"
    num_send_programs: int = 4
    num_count_programs: int = 2
    spins: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_rank", "hidden", "num_topk", "num_experts",
                     "num_send_programs", "num_count_programs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(name, v, "must be a positive integer")
        dt = dtype_of(self.dtype)
        row = sync_row(self.sync)
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError("layout", self.layout, f"must be one of {LAYOUTS}")
        if self.policy not in POLICIES:
            raise InvalidArgumentError("policy", self.policy, f"must be one of {POLICIES}")
        if not supports(self.sync, self.dtype):
            raise InvalidArgumentError("sync", self.sync, f"SP has no sentinel for {self.dtype} "
                                       "payloads: use tff or dc")
        cd = self.out_dtype
        if cd not in FLOAT_DTYPE_NAMES or (dt.is_float and cd != self.dtype):
            raise InvalidArgumentError("combine_dtype", self.combine_dtype,
                                       "must be a float type, dtype itself for a float dtype")
        if row.needs_words and (self.hidden * dt.itemsize % 8
                                or self.hidden * dtype_of(cd).itemsize % 8):
            raise InvalidArgumentError("hidden", self.hidden, f"sync={self.sync} checksums 8-byte "
                                       "words: hidden * itemsize must be a multiple of 8")
        if not self.timeout_s > 0:
            raise InvalidArgumentError("timeout_s", self.timeout_s, "must be > 0")
        if self.spins is not None and (not isinstance(self.spins, int) or self.spins < 1):
            raise InvalidArgumentError("spins", self.spins, "must be a positive integer")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgumentError("device", self.device, "must be 'cpu' or a CUDA device")

    @property
    def out_dtype(self) -> str:
        """The type combine takes and returns (``dtype``, or ``combine_dtype`` / bf16 after a
        1-byte dispatch)."""
        if self.combine_dtype is not None:
            return self.combine_dtype
        return self.dtype if dtype_of(self.dtype).is_float else "bf16"

    @property
    def poll_spins(self) -> int:
        if self.spins is not None:
            return self.spins
        return 1 << 20 if self.device.startswith("cuda") else 64


# What a BufferConfig may ask that this engine does not do, with the value it must keep.
_UNSUPPORTED = (("quant", None), ("expert_map", None), ("expert_ranks", None),
                ("engine", "asp"), ("integrity", "off"), ("on_peer_loss", "raise"),
                ("tff_block_bytes", 512), ("tff_flag_bytes", 32))


def from_buffer_config(config: Any, *, device: str = "cpu",
                       num_send_programs: int | None = None) -> TritonConfig:
    """The :class:`TritonConfig` of a ``ubep.BufferConfig`` (what a registry row opening this
    engine for a Buffer builds). A field this engine does not serve is refused by name
    (``InvalidArgumentError``); ``num_cores``, when given and ``num_send_programs`` is not,
    sets the send programs. ``sp_check_bytes`` does not change results: this engine polls
    every element of an SP row (docs/FORMATS.md, ``sp_check_bytes = 0``) whatever it is."""
    for name, keep in _UNSUPPORTED:
        value = getattr(config, name)
        if value != keep:
            raise InvalidArgumentError(name, value, f"the Triton engine needs {name}={keep!r}")
    if config.layout == "expert_padded":
        # its kernels pack each expert's rows after the previous expert's: the padded places
        # are the native and RMA engines' (docs/TRITON.md)
        raise InvalidArgumentError("layout", config.layout, "the Triton engine serves "
                                   "layout='expert' and 'rank' (not 'expert_padded')")
    send = num_send_programs or getattr(config, "num_cores", None) or 4
    return TritonConfig(
        max_tokens_per_rank=config.max_tokens_per_rank, hidden=config.hidden,
        num_topk=config.num_topk, num_experts=config.num_experts, dtype=config.dtype,
        combine_dtype=config.combine_dtype, layout=config.layout, sync=config.sync,
        policy=config.policy, timeout_s=float(config.timeout_s), device=device,
        num_send_programs=int(send))
