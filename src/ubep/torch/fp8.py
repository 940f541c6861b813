"""DeepEP's FP8 casts of the low-latency dispatch (``ubep.torch.deep_ep``): per-token,
per-128-channel e4m3 quantisation and the UE8M0 scale packing.

The quantiser itself is :func:`ubep.quant.quantize` (numpy, the one definition the native
dispatch path matches bit for bit); this module only moves tensors in and out of it.
"""

from __future__ import annotations

import torch

from .. import quant
from ._convert import to_numpy

__all__ = ["FP8_BLOCK", "UE8M0_PACK", "pack_ue8m0", "quantize_fp8"]

FP8_BLOCK = quant.QUANT_BLOCK  # channels per FP8 scale, as DeepEP
UE8M0_PACK = 4  # UE8M0 scales per int32, as DeepEP's use_ue8m0
_STORED = (torch.bfloat16, torch.float16, torch.float32)  # what ubep.quant reads as is


def quantize_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel FP8 (e4m3) quantisation, as DeepEP's low-latency dispatch
    (:mod:`ubep.quant` gives the rules to the bit): ``scale = max(amax, 1e-4) / 448`` (rounded
    up to a power of two with ``round_scale``), ``values = x / scale`` rounded to e4m3.
    Returns the values ``[num_tokens, hidden]`` float8_e4m3fn and the scales
    ``[num_tokens, hidden // 128]`` float32 (new CPU tensors)."""
    src = x if x.dtype in _STORED else x.to(torch.float32)
    values, scales = quant.quantize(to_numpy(src), "e4m3", round_scale=round_scale)
    return torch.from_numpy(values).view(torch.float8_e4m3fn), torch.from_numpy(scales)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., n]`` -> DeepEP's UE8M0 layout: each scale's exponent
    byte, four to an int32 (first scale in the lowest byte), ``[..., n // 4]``."""
    exponents = (scales.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    return exponents.view(torch.int32)
