"""Per-token, per-128-channel FP8 (E4M3) and INT8 quantisation: the reference definition.

This module *defines* the quantiser (plain numpy, no torch); the native kernels
(``runtime/native/kernels.c``: ``quant_row_e4m3`` / ``quant_row_int8``) and
``ubep.torch.fp8.quantize_fp8`` match it bit for bit, and tests compare them with ``==``.

Layout, as DeepEP's low-latency FP8 dispatch: ``x [num_tokens, hidden]`` (BF16 bits as
``uint16``, FP16 or FP32; ``hidden`` a multiple of 128) gives ``values [num_tokens, hidden]``
(``uint8`` E4M3 bit patterns, or ``int8``) and ``scales [num_tokens, hidden // 128]`` float32,
``x[t, c] ~= decode(values[t, c]) * scales[t, c // 128]``.

**Rules, to the bit** (every operation in float32; ``fl`` is one IEEE float32 rounding to
nearest-even):

1. Inputs convert exactly to float32 (``ubep.dtypes``).
2. ``amax = max |x|`` over the 128 channels of a block (exact). A NaN anywhere in the block makes
   ``amax`` NaN (as ``torch.amax``; DeepEP's CUDA kernel uses ``fmaxf``, which skips NaN).
3. ``scale = fl(max(amax, fl(1e-4)) / qmax)``: a float32 *division* by ``qmax = 448`` (E4M3) or
   ``127`` (INT8). ``round_scale`` (UE8M0): ``scale`` is replaced by the smallest power of two
   ``>= scale``, by its bits (exponent + 1 when any mantissa bit is set), like DeepEP's
   ``fast_log2_ceil`` / DeepGEMM's ``ceil_to_ue8m0``. A NaN scale is stored as the canonical
   quiet NaN ``0x7FC00000``.
4. ``v = fl(x / scale)``: a float32 division (not a multiply by ``1 / scale``, which rounds
   twice; DeepEP's CUDA kernel multiplies by ``448 / amax``, so it can differ from this in the
   last bit of ``v`` and then, rarely, in the last bit of the E4M3 value).
5. E4M3 (``float8_e4m3fn``): round to nearest, ties to even, on the integer bits of ``v``
   (subnormals are multiples of ``2^-9``; results that round to zero keep their sign, ``0x80``);
   finite values above 448 and +-inf saturate to +-448 (``0x7E`` / ``0xFE``, CUDA's
   ``__NV_SATFINITE``); every NaN becomes ``0x7F``. Since ``|x| <= amax`` gives ``|v| <= 448``
   up to one ulp, saturation never fires inside :func:`quantize`; it is defined for
   :func:`float32_to_e4m3` alone. torch 2.13's ``Tensor.to(torch.float8_e4m3fn)`` on CPU agrees
   on every non-NaN input (it saturates too) and keeps the NaN's sign (``0xFF``).
6. INT8: round to nearest, ties to even, clamp to ``[-127, 127]``; NaN becomes 0 (its block's
   scale is NaN, so the block dequantises to NaN all the same).

Consequences worth knowing: a zero block has ``scale = fl(fl(1e-4) / qmax)`` and zero values
(``-0.0`` gives E4M3 ``0x80``, INT8 ``0``); a block with ``inf`` has ``scale = inf``, its
infinite elements become NaN (``inf / inf``) and the others +-0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import as_storage
from .errors import InvalidArgumentError

__all__ = [
    "AMAX_FLOOR",
    "FORMATS",
    "QUANT_BLOCK",
    "QuantFormat",
    "block_scales",
    "dequantize",
    "e4m3_to_float32",
    "float32_to_e4m3",
    "float32_to_int8",
    "quantize",
    "row_bytes",
    "ue8m0_ceil",
]

QUANT_BLOCK = 128  #: channels per scale, as DeepEP
AMAX_FLOOR = np.float32(1e-4)  #: DeepEP's floor on a block's amax (kFP8Margin)
CANONICAL_NAN_F32 = np.uint32(0x7FC00000)
E4M3_NAN = 0x7F

_U32 = np.uint32
_SIGN = _U32(0x80000000)
_ABS = _U32(0x7FFFFFFF)
_INF_BITS = _U32(0x7F800000)
_MANT = _U32(0x007FFFFF)
_HIDDEN_BIT = _U32(0x00800000)
_E4M3_MAX_BITS = _U32(0x43E00000)  # 448.0f
_E4M3_MIN_NORMAL_BITS = _U32(0x3C800000)  # 2^-6
_INT8_MAX_BITS = _U32(0x42FE0000)  # 127.0f


@dataclass(frozen=True)
class QuantFormat:
    """A quantised format: its name, largest magnitude ``qmax`` and value storage dtype."""

    name: str
    qmax: float
    storage: np.dtype


FORMATS: dict[str, QuantFormat] = {
    "e4m3": QuantFormat("e4m3", 448.0, np.dtype(np.uint8)),
    "int8": QuantFormat("int8", 127.0, np.dtype(np.int8)),
}


def row_bytes(hidden: int) -> int:
    """Bytes of one quantised row on the wire: ``hidden`` 1-byte values, then ``hidden // 128``
    float32 scales (4-byte aligned: ``hidden`` is a multiple of 128)."""
    return hidden + 4 * (hidden // QUANT_BLOCK)


def _format(fmt: str) -> QuantFormat:
    found = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if found is None:
        raise InvalidArgumentError("fmt", fmt, f"must be one of {', '.join(FORMATS)}")
    return found


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _round_shift(m: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """``m / 2^shift`` rounded to nearest, ties to even (uint32 ``m < 2^24``, shift 1..31):
    the quotient, plus one if the remainder is above half, or exactly half with an odd
    quotient. (The C kernels use the equivalent bias form; the tests compare the two.)"""
    q = m >> shift
    rem = m & ((_U32(1) << shift) - _U32(1))
    half = _U32(1) << (shift - _U32(1))
    up = (rem > half) | ((rem == half) & ((q & _U32(1)) == 1))
    return q + up.astype(np.uint32)


def float32_to_e4m3(a: np.ndarray) -> np.ndarray:
    """float32 -> ``float8_e4m3fn`` bit patterns (``uint8``, same shape), rule 5 of the module
    docstring: round to nearest even, saturate to +-448, NaN -> ``0x7F``."""
    u = _bits(a)
    sign = ((u >> _U32(24)) & _U32(0x80)).astype(np.uint8)
    mag = u & _ABS
    nan = mag > _INF_BITS
    # Saturating before rounding equals rounding then saturating: 448 is representable and
    # rounding is monotone. It also keeps the rounding below from carrying into 0x7F (NaN).
    mag = np.minimum(mag, _E4M3_MAX_BITS)
    # Normal results: rebias the exponent (127 -> 7) and round away the low 20 mantissa bits.
    t = mag - _U32(120 << 23)  # wraps for subnormal results; those lanes are discarded
    normal = (t + _U32(0x7FFFF) + ((t >> _U32(20)) & _U32(1))) >> _U32(20)
    # Subnormal results: the value in units of 2^-9, rounded; exponents <= 116 give 0.
    exp = mag >> _U32(23)
    man = (mag & _MANT) | _HIDDEN_BIT
    shift = np.clip(_U32(141) - np.minimum(exp, _U32(141)), 21, 25).astype(np.uint32)
    sub = _round_shift(man, shift)
    code = np.where(mag >= _E4M3_MIN_NORMAL_BITS, normal, sub).astype(np.uint8) | sign
    return np.where(nan, np.uint8(E4M3_NAN), code).reshape(np.shape(a))


def float32_to_int8(a: np.ndarray) -> np.ndarray:
    """float32 -> int8 (same shape), rule 6: round to nearest even, clamp to [-127, 127],
    NaN -> 0. Integer arithmetic on the bits, so no dependence on the FPU rounding mode."""
    u = _bits(a)
    neg = (u & _SIGN) != 0
    mag = u & _ABS
    nan = mag > _INF_BITS
    mag = np.minimum(mag, _INT8_MAX_BITS)  # clamp (monotone rounding, 127 representable)
    exp = mag >> _U32(23)
    man = (mag & _MANT) | _HIDDEN_BIT
    # |v| = man * 2^(exp - 150); exponents <= 125 (|v| < 0.5) give 0 through shift 25.
    shift = np.clip(_U32(150) - np.minimum(exp, _U32(150)), 17, 25).astype(np.uint32)
    q = _round_shift(man, shift).astype(np.int16)
    q = np.where(neg, -q, q)
    return np.where(nan, 0, q).astype(np.int8).reshape(np.shape(a))


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, codes & 7
    mag = np.where(exp == 0, man * 2.0**-9, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    vals = np.where(codes & 0x80, -mag, mag)
    vals[(codes & 0x7F) == 0x7F] = np.nan
    return vals.astype(np.float32)


_E4M3_VALUES = _e4m3_table()


def e4m3_to_float32(bits: np.ndarray) -> np.ndarray:
    """``float8_e4m3fn`` bit patterns (``uint8``) -> their exact float32 values."""
    b = np.asarray(bits)
    if b.dtype != np.uint8:
        raise InvalidArgumentError("bits", b.dtype, "must be uint8 E4M3 bit patterns")
    return _E4M3_VALUES[b]


def ue8m0_ceil(scale: np.ndarray) -> np.ndarray:
    """The smallest power of two ``>=`` each positive float32 (inf and NaN unchanged): exponent
    + 1 when any mantissa bit is set. Exact, unlike ``exp2(ceil(log2(s)))`` in float32, which
    rounds ``log2`` of a scale a few ulps above a power of two down onto the integer."""
    u = _bits(scale)
    finite = (u & _INF_BITS) != _INF_BITS
    up = finite & ((u & _MANT) != 0)
    out = np.where(up, (u & _INF_BITS) + _HIDDEN_BIT, u).astype(np.uint32)
    return out.view(np.float32).reshape(np.shape(scale))


def _as_rows(x: object) -> np.ndarray:
    a, dt = as_storage(x)
    if not dt.is_float:
        raise InvalidArgumentError("x", dt.name, "must be BF16 (uint16 bits), FP16 or FP32")
    if a.ndim != 2:
        raise InvalidArgumentError("x", a.shape, "must be [num_tokens, hidden]")
    if a.shape[1] % QUANT_BLOCK:
        raise InvalidArgumentError(
            "x", a.shape[1], f"hidden must be a multiple of {QUANT_BLOCK} (one scale per block)"
        )
    return dt.to_float32(a)


def block_scales(amax: np.ndarray, fmt: str, *, round_scale: bool = False) -> np.ndarray:
    """Rule 3: the float32 scale of each block from its float32 ``amax``."""
    qfmt = _format(fmt)
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf blocks are defined
        scale = np.maximum(amax, AMAX_FLOOR) / np.float32(qfmt.qmax)  # NaN propagates
    if round_scale:
        scale = ue8m0_ceil(scale)
    scale = np.array(scale, dtype=np.float32, copy=True)
    scale.view(np.uint32)[np.isnan(scale)] = CANONICAL_NAN_F32
    return scale


def quantize(
    x: object, fmt: str, *, round_scale: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Quantise each token's blocks of 128 channels (the module docstring gives the rules).

    Args:
        x: ``[num_tokens, hidden]`` BF16 (``uint16`` bits or ``ml_dtypes.bfloat16``), float16
            or float32; ``hidden`` a multiple of 128.
        fmt: ``"e4m3"`` or ``"int8"``.
        round_scale: UE8M0 scales (powers of two, rounded up).

    Returns:
        ``(values, scales)``: ``values [num_tokens, hidden]`` ``uint8`` E4M3 bit patterns
        (view as ``torch.float8_e4m3fn``) or ``int8``; ``scales [num_tokens, hidden // 128]``
        float32.
    """
    qfmt = _format(fmt)
    xf = _as_rows(x)
    num_tokens, hidden = xf.shape
    blocks = xf.reshape(num_tokens, hidden // QUANT_BLOCK, QUANT_BLOCK)
    # max over |x| propagates NaN (np.max does), as rule 2 wants
    amax = np.abs(blocks).max(axis=-1)
    scales = block_scales(amax, qfmt.name, round_scale=round_scale)
    with np.errstate(invalid="ignore"):  # inf / inf and NaN are defined (rules 4-6)
        v = blocks / scales[..., None]  # float32 / float32: one IEEE rounding
    convert = float32_to_e4m3 if qfmt.name == "e4m3" else float32_to_int8
    return convert(v).reshape(num_tokens, hidden), scales


def dequantize(values: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    """``decode(values) * scales`` per block, float32 ``[num_tokens, hidden]`` (one float32
    multiply per element)."""
    qfmt = _format(fmt)
    v = np.asarray(values)
    s = np.asarray(scales)
    if v.dtype != qfmt.storage or v.ndim != 2 or v.shape[1] % QUANT_BLOCK:
        raise InvalidArgumentError(
            "values", (v.dtype, v.shape),
            f"must be {qfmt.storage} [num_tokens, hidden] with hidden a multiple of {QUANT_BLOCK}",
        )
    want = (v.shape[0], v.shape[1] // QUANT_BLOCK)
    if s.dtype != np.float32 or s.shape != want:
        raise InvalidArgumentError("scales", (s.dtype, s.shape), f"must be float32 {want}")
    decoded = e4m3_to_float32(v) if qfmt.name == "e4m3" else v.astype(np.float32)
    return (decoded.reshape(*want, QUANT_BLOCK) * s[..., None]).reshape(v.shape)
