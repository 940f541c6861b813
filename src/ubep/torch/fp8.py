"""DeepEP's FP8 casts of the low-latency dispatch (``ubep.torch.deep_ep``): per-token,
per-128-channel e4m3 quantisation and the UE8M0 scale packing."""

from __future__ import annotations

import torch

__all__ = ["FP8_BLOCK", "UE8M0_PACK", "pack_ue8m0", "quantize_fp8"]

FP8_BLOCK = 128  # channels per FP8 scale, as DeepEP
UE8M0_PACK = 4  # UE8M0 scales per int32, as DeepEP's use_ue8m0
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_MIN_AMAX = 1e-4  # DeepEP's floor on a block's amax


def quantize_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel FP8 (e4m3) quantisation, as DeepEP's low-latency dispatch:
    ``scale = max(amax, 1e-4) / 448`` (rounded up to a power of two with ``round_scale``).
    Returns the values ``[num_tokens, hidden]`` float8_e4m3fn and the scales
    ``[num_tokens, hidden // 128]`` float32."""
    num_tokens, hidden = x.shape
    blocks = x.to(torch.float32).reshape(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp(min=_FP8_MIN_AMAX) / _FP8_MAX
    if round_scale:  # UE8M0-style: scales are powers of two
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(num_tokens, hidden)
    return q, scale.contiguous()


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., n]`` -> DeepEP's UE8M0 layout: each scale's exponent
    byte, four to an int32 (first scale in the lowest byte), ``[..., n // 4]``."""
    exponents = (scales.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    return exponents.view(torch.int32)
