"""Zero-copy conversion between torch tensors and the numpy arrays the runtime moves.

numpy has no bfloat16, so ubep stores BF16 payloads as ``uint16`` bit patterns (see
:mod:`ubep.dtypes`). A CPU tensor shares its memory with ``Tensor.numpy()`` and
``torch.from_numpy``; a BF16 tensor is first reinterpreted as ``torch.uint16`` (same bytes), so
no element is converted or copied on either side. Only non-contiguous tensors are copied
(``contiguous()``), because the runtime reads rows as flat byte ranges.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, cast

import numpy as np
import torch

from ..errors import InvalidArgumentError, UbepError, Unviewable
from ..plane.results import DispatchResult, PendingCall

__all__ = [
    "BITS_OF_SIZE", "PAYLOAD_DTYPES", "TORCH_OF", "dispatch_result_to_torch", "from_numpy",
    "from_numpy_as", "owned_rows", "padded_rows", "quant_values_dtype", "received_rows",
    "storage_views", "tensor_of_storage", "to_numpy",
]

#: torch dtypes ubep moves, and the numpy storage dtype each travels in.
PAYLOAD_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(np.uint16),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),  # only the in-process fake backend accepts it
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
}


def to_numpy(t: torch.Tensor, *, argument: str = "x") -> np.ndarray:
    """The numpy storage view of a CPU tensor (BF16 as ``uint16`` bits); no copy if contiguous.

    Autograd is bypassed (``detach``): callers that need gradients wrap this in a Function.
    """
    # a decode step's tensors (CPU, contiguous, no autograd): the fewest steps
    if type(t) is torch.Tensor and t.is_cpu and not t.requires_grad and t.is_contiguous():
        return (t.view(torch.uint16) if t.dtype is torch.bfloat16 else t).numpy()
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(argument, type(t).__name__, "must be a torch.Tensor")
    if t.device.type != "cpu":
        raise InvalidArgumentError(argument, str(t.device), "must be a CPU tensor")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def on_host(obj: Any) -> Any:
    """A result field as a numpy array on the host: a tensor of any device as its storage
    (BF16 as uint16 bits; a device tensor copied to the host), anything else as it is."""
    if not isinstance(obj, torch.Tensor):
        return obj
    return to_numpy(obj.cpu() if obj.device.type != "cpu" else obj, argument="result")


def from_numpy(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor sharing ``a``'s memory; ``dtype=torch.bfloat16`` reinterprets ``uint16`` bits.

    Read-only arrays (the runtime may hand out views of its receive buffer) are wrapped
    without copying too; torch warns about that once, which is silenced here because ubep
    never writes through such a tensor.
    """
    arr = np.asarray(a)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    t = torch.from_numpy(arr) if arr.flags.writeable else _over_read_only(arr)
    if dtype is torch.bfloat16:
        if arr.dtype != np.uint16:
            raise InvalidArgumentError("a", arr.dtype, "bfloat16 needs uint16 storage")
        return t.view(torch.bfloat16)
    if dtype is not None and t.dtype != dtype:
        raise InvalidArgumentError("a", arr.dtype, f"does not store {dtype}")
    return t


def _over_read_only(arr: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only array: through a writeable view of it where its memory is
    writeable (a receive region is, its views are marked read-only), else with torch's warning
    about a read-only array silenced (once a call: the warnings machinery is the slow part)."""
    view = arr.view()
    try:
        view.flags.writeable = True
    except ValueError:  # memory that is read-only itself
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(view)


def from_numpy_as(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over ``a``'s memory (``a`` holds its storage: ``uint16`` bits for
    BF16, ``uint8`` bytes for an FP8 type); no copy. A tensor (an engine's result on its
    device) is viewed as ``dtype`` where it is not one already."""
    t = a if isinstance(a, torch.Tensor) else from_numpy(a)
    if t.dtype == dtype:
        return t
    if t.element_size() != torch.empty((), dtype=dtype).element_size():
        raise InvalidArgumentError("a", a.dtype, f"does not store {dtype}")
    return t.view(dtype)


def quant_values_dtype(quant: str) -> torch.dtype:
    """The torch dtype of a quantised dispatch's ``recv_x`` values (``BufferConfig.quant``)."""
    return {"e4m3": torch.float8_e4m3fn, "int8": torch.int8}[quant]


def dispatch_result_to_torch(res: Any, values: torch.dtype) -> Any:
    """A ``DispatchResult`` with every array field a tensor over the same memory, ``recv_x``
    of ``values``; the handle stays as it is (it is the Buffer's, read by combine)."""
    import dataclasses

    fields: dict[str, Any] = {}
    for f in dataclasses.fields(res):
        v = getattr(res, f.name)
        if isinstance(v, np.ndarray):
            v = from_numpy_as(v, values) if f.name == "recv_x" else from_numpy(v)
        fields[f.name] = v
    return type(res)(**fields)


# --- the torch door of a Buffer --------------------------------------------------------------

# dtypes numpy has no type for: a tensor of one is viewed as its storage type (same bytes)
_STORAGE_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
_TENSOR = torch.Tensor
_NDARRAY = np.ndarray
_TO_DLPACK, _FROM_DLPACK = torch._C._to_dlpack, torch._C._from_dlpack
#: the torch dtype of each ``ubep.dtypes`` name (a Buffer's ``dtype`` / ``combine_dtype``)
TORCH_OF: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8,
    "uint8": torch.uint8,
}
#: DLPack's type code of bfloat16 (the bits are the storage's): how BF16 rows reach torch
_BF16_DLPACK_CODE = 4
# references a kept recv_x tensor has when nothing but the door holds it: the door's, the
# lookup's local name and getrefcount's argument
_UNHELD = 3
_REFS, _NEW = sys.getrefcount, object.__new__


def storage_or_same(obj: object) -> object:
    """A CPU tensor's numpy storage view (BF16 as ``uint16``, FP8 as ``uint8``; strided as it
    is: the engine's door copies a layout it does not read as it is), anything else as it is:
    a tensor numpy cannot view (another device, say) comes back unchanged, so that the Buffer's
    checks reject it inside the call, where the rejection reaches every rank."""
    if not isinstance(obj, _TENSOR):
        return obj
    t: Any = obj
    try:
        view = _STORAGE_VIEW.get(t.dtype)
        return (t if view is None else t.view(view)).detach().numpy()
    except (RuntimeError, TypeError):
        return obj


def _viewed(obj: object, argument: str) -> object:
    """:func:`storage_or_same`; a tensor numpy cannot view as ``ubep.errors.Unviewable``, the
    error naming ``argument`` (and the tensor's device) that the call's checks raise."""
    got = storage_or_same(obj)
    if not isinstance(got, _TENSOR):
        return got
    device = got.device
    if device.type != "cpu":
        return Unviewable(InvalidArgumentError(
            argument, device, f"must be a CPU tensor (it is on device {device}): this "
            "Buffer's engine moves host memory"))
    try:
        return to_numpy(got, argument=argument)
    except UbepError as exc:
        return Unviewable(exc)


class _Converted:
    """A field of :class:`TorchDispatchResult` with a class-level default in
    ``DispatchResult`` (which ``__getattr__`` would never be asked for): converted on first
    read, as the others."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return None  # the dataclass default
        return TorchDispatchResult.__getattr__(obj, self.name)


class TorchDispatchResult(DispatchResult[Any]):
    """A dispatch result whose array fields are torch tensors, each made on its first read from
    the numpy result it wraps (``_np``): a decode step that reads ``recv_x`` and ``handle``
    pays for those, not for eight conversions. Everything a dataclass reader does
    (``getattr``, ``dataclasses.fields``, ``replace``, ``asdict``) reads the tensors."""

    num_sent_rows_per_rank = _Converted("num_sent_rows_per_rank")

    def host_result(self) -> Any:
        """The numpy result this one wraps, when the engine's arrays are on the host (what a
        reader of numpy storage, the DeepEP facades' backend, takes without converting every
        field back), else None."""
        res = self.__dict__.get("_np")
        return res if res is not None and type(res.recv_x) is _NDARRAY else None

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        if name.startswith("__") or "_np" not in d:
            raise AttributeError(name)
        value = getattr(d["_np"], name)
        if type(value) is _NDARRAY:
            value = from_numpy(value)
        d[name] = value
        return value



class TorchDoor:
    """How a Buffer takes torch tensors and hands them back, decided once per Buffer (its dtype
    plans, its region views), so that a torch call costs what the numpy call costs.

    In: each tensor's numpy view, made in C from its DLPack capsule (``storage_views``: no
    copy; a layout the engine does not read as it is, its door copies once, as for numpy); the
    numpy call then takes the Buffer's one-native-call path. Out: the numpy result wrapped
    (:class:`TorchDispatchResult`): ``recv_x`` a slice of a tensor over its receive region
    (each region viewed once; the slice of each row count kept and handed out again once
    nothing else holds it); every other array a tensor over the numpy array's memory, made on
    first read; the handle the engine's (combine reads it). ``y``: a tensor over the numpy
    ``y``'s memory, by DLPack (in the combine dtype: no view on top).

    ``call_dispatch`` / ``call_combine`` are the numpy calls. A tensor numpy cannot view (another
    device, say) goes to them as :class:`ubep.errors.Unviewable`, whose error the call's
    checks raise inside the call, where the rejection reaches every rank.
    """

    def __init__(self, *, x_dtype: str, combine_dtype: str, quant: str | None,
                 call_dispatch: Any, call_combine: Any,
                 regions: list[np.ndarray] | None = None) -> None:
        self.x_dtype = TORCH_OF[x_dtype]
        self.c_dtype = TORCH_OF[combine_dtype]
        self._quant = None if quant is None else quant_values_dtype(quant)
        self._call_dispatch, self._call_combine = call_dispatch, call_combine
        self._region_arrays = regions or []
        self._num_regions = len(self._region_arrays)
        # each receive region as a tensor of a recv_x dtype, made on its first use; the slices
        # handed out, by (dtype, region, rows)
        self._regions: dict[torch.dtype, list[torch.Tensor]] = {}
        self._slices: dict[tuple[torch.dtype, int, int], torch.Tensor] = {}
        self._pending = PendingCall
        self._views = _native_conversions()[0]
        self.tensor_type = _TENSOR

    def dispatch(self, x: Any, topk_idx: object, topk_weights: object, copy: bool, hook: bool,
                 x_scales: object) -> Any:
        """The Buffer's dispatch of torch ``x`` (tensors or arrays for the rest)."""
        views = self._views
        xa, ia, wa, sa = (views(_TO_DLPACK, x, topk_idx, topk_weights, x_scales)
                          if views is not None else (x, topk_idx, topk_weights, x_scales))
        values = x.dtype if self._quant is None else self._quant
        if (type(xa) is _NDARRAY and type(ia) is _NDARRAY and type(wa) is _NDARRAY
                and sa is None):  # the common case: every tensor viewed
            got = self._call_dispatch(xa, ia, wa, copy=copy, return_recv_hook=hook)
        else:
            xa, ia, wa, sa = (_viewed(a, name) for a, name in zip(
                (xa, ia, wa, sa), ("x", "topk_idx", "topk_weights", "x_scales"), strict=True))
            got = self._call_dispatch(xa, ia, wa, copy=copy, return_recv_hook=hook, x_scales=sa)
        if type(got) is self._pending:
            got.map_result(lambda res: self.result(res, values, copy))
            return got
        return self.result(got, values, copy)

    def result_of(self, res: Any, x: torch.Tensor) -> Any:
        """The torch result of a plain dispatch of ``x`` that the engine ran (``res``, numpy):
        :meth:`result`'s common case, written out (a decode step meets it cold)."""
        if not self._num_regions or self._quant is not None:
            return self.result(res, x.dtype if self._quant is None else self._quant, False)
        out = _NEW(TorchDispatchResult)
        d = out.__dict__
        d["_np"] = res
        handle = d["handle"] = res.handle
        d["recv_x_scales"] = None
        key = (x.dtype, handle.dispatch_index % self._num_regions, res.recv_x.shape[0])
        t = self._slices.get(key)
        d["recv_x"] = t if t is not None and _REFS(t) == _UNHELD else self._new_slice(key)
        return out

    def result(self, res: Any, values: torch.dtype, copy: bool) -> Any:
        """``res`` (the numpy call's) as the torch result, ``recv_x`` of ``values``: the rest
        converted when read."""
        out = _NEW(TorchDispatchResult)
        d = out.__dict__
        d["_np"] = res
        handle = d["handle"] = res.handle
        recv_x = res.recv_x
        if type(recv_x) is not _NDARRAY:  # an engine's own tensor
            d["recv_x"] = recv_x
        elif self._num_regions and not copy:
            key = (values, handle.dispatch_index % self._num_regions, recv_x.shape[0])
            t = self._slices.get(key)
            d["recv_x"] = t if t is not None and _REFS(t) == _UNHELD else self._new_slice(key)
        else:
            d["recv_x"] = from_numpy_as(recv_x, values)
        scales = res.recv_x_scales
        d["recv_x_scales"] = from_numpy(scales) if type(scales) is _NDARRAY else scales
        return out

    def _new_slice(self, key: tuple[torch.dtype, int, int]) -> torch.Tensor:
        """The first ``rows`` rows of receive region ``region`` as a tensor of ``values``
        (``key``), kept to be handed out again once nothing else holds it."""
        values, region, rows = key
        regions = self._regions.get(values) or self._region_tensors(values)
        t = self._slices[key] = regions[region][:rows]
        return t

    def _region_tensors(self, values: torch.dtype) -> list[torch.Tensor]:
        """Each receive region as a tensor of ``values`` (read-only memory: torch's one warning
        about it silenced; nothing writes through these)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            made = self._regions[values] = [from_numpy_as(torch.from_numpy(r), values)
                                            for r in self._region_arrays]
        return made

    def combine(self, expert_out: Any, handle: object, hook: bool, **extra: Any) -> Any:
        """The Buffer's combine of a torch ``expert_out``: ``y`` a tensor of the combine dtype
        over the numpy ``y``'s memory."""
        views = self._views
        if views is not None and not extra:  # the common case
            (ea,) = views(_TO_DLPACK, expert_out)
            got = (self._call_combine(ea, handle, return_recv_hook=hook)
                   if type(ea) is _NDARRAY else self._combine_rest(ea, handle, hook, {}))
        else:
            got = self._combine_rest(expert_out, handle, hook, extra)
        if type(got) is self._pending:
            got.map_result(self.y_of)
            return got
        return self.y_of(got)

    def _combine_rest(self, expert_out: object, handle: object, hook: bool,
                      extra: dict[str, Any]) -> Any:
        ea = _viewed(expert_out, "expert_out")
        args = {k: _viewed(v, k) for k, v in extra.items()}
        return self._call_combine(ea, handle, return_recv_hook=hook, **args)

    def y_of(self, y: Any) -> torch.Tensor:
        """A combine's ``y`` as a tensor of the combine dtype (no copy)."""
        return tensor_of_storage(y, self.c_dtype)


@functools.cache
def _native_conversions() -> tuple[Any, Any]:
    """The native build's ``storage_views`` and ``tensor_capsule``, or (None, None) without
    one (the conversions in Python then); looked up once."""
    try:
        from ..runtime.abi import load_native

        native = load_native()
    except Exception:  # no native build: the Python conversions
        return None, None
    native.use_dlpack(_TO_DLPACK)  # the engine's door takes tensors from now on
    return native.storage_views, native.tensor_capsule


def storage_views(*tensors: Any) -> tuple[Any, ...]:
    """Each CPU tensor's numpy storage view (BF16 as ``uint16`` bits; no copy), all in one
    native call from their DLPack capsules (detached, as :func:`to_numpy`); a tensor this path
    does not view (another device, no native build) comes back as it is, for the caller's
    checked path to convert or name."""
    views = _native_conversions()[0]
    return tensors if views is None else cast(tuple[Any, ...], views(_TO_DLPACK, *tensors))


def tensor_of_storage(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor over ``a``'s memory (``a`` its storage: ``uint16`` bits for BF16);
    no copy. BF16 goes to torch by DLPack in one native call where built (from_numpy and a
    view cost a third more); types numpy has, by ``torch.from_numpy``."""
    if dtype is torch.bfloat16 and type(a) is _NDARRAY and a.dtype.itemsize == 2:
        capsule = _native_conversions()[1]
        if capsule is not None:
            return cast(torch.Tensor, _FROM_DLPACK(capsule(a, _BF16_DLPACK_CODE)))
    return from_numpy_as(a, dtype)


def owned_rows(recv_x: np.ndarray, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """A new ``dtype`` tensor of ``rows`` rows: ``recv_x`` (its storage dtype's array, read-only
    where it views a receive region) copied in, zeros after (copied through the tensor's numpy
    view: no tensor over the read-only region, nor torch's warning about one)."""
    if recv_x.shape[0] == rows:  # no padding: one copy, a tensor over it
        return tensor_of_storage(np.array(recv_x), dtype)
    out = torch.empty((rows, *recv_x.shape[1:]), dtype=dtype)
    view = to_numpy(out)
    n = recv_x.shape[0]
    view[:n] = recv_x
    view[n:] = 0
    return out


def padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (an owned tensor either way, on ``t``'s
    device), written as integer bits of its element size (FP8 types have no fill kernel)."""
    bits = t.view(BITS_OF_SIZE[t.element_size()])
    out = torch.empty((rows, *t.shape[1:]), dtype=bits.dtype, device=t.device)
    out[: t.shape[0]] = bits
    out[t.shape[0]:].zero_()  # only the padding: the rows are written once
    return out.view(t.dtype)


#: the integer dtype of each element size: rows moved as bits (FP8 types have no index or fill
#: kernels)
BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def received_rows(recv_x: np.ndarray, recv_scales: np.ndarray | None, dtype: torch.dtype,
                  fp8: bool, rows: int) -> Any:
    """A normal-mode dispatch's owned ``recv_x`` of ``rows`` rows (:func:`owned_rows`; with
    ``fp8``, the values as ``dtype`` and their float32 scales, each padded)."""
    if not fp8:
        return owned_rows(recv_x, dtype, rows)
    assert recv_scales is not None
    return (padded_rows(from_numpy(recv_x, torch.uint8), rows).view(dtype),
            padded_rows(torch.from_numpy(recv_scales), rows))
