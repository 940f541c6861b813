"""The torch door of ``ubep.Buffer``: tensors in, tensors out over the same memory the numpy
call hands back (the oracle: ``ubep.reference`` on the numpy bits), through the one native call;
the receive region viewed once per Buffer; the native DLPack conversions against torch's own
views of the same tensors."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ubep  # noqa: E402
from ubep import reference, testing  # noqa: E402
from ubep.errors import InvalidArgumentError  # noqa: E402
from ubep.runtime.abi import load_native  # noqa: E402

_SHAPE = {"num_experts": 8, "num_topk": 2, "hidden": 256}
_TOKENS = [6, 3]


def _bits(t: Any) -> np.ndarray:
    """A tensor's (or array's) bytes as numpy, BF16 as its uint16 bits."""
    if isinstance(t, torch.Tensor):
        return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(t)


def _worker(group: Any, layout: str) -> dict[str, Any]:
    xs, idxs, ws = testing.inputs("bf16", _SHAPE["num_experts"], _SHAPE["num_topk"],
                                  _SHAPE["hidden"], _TOKENS, 5, "uniform")
    r = group.rank
    refs = reference.dispatch(xs, idxs, ws, _SHAPE["num_experts"], layout=layout)
    want_y = reference.combine([ref.recv_x for ref in refs], refs)[r]
    cfg = ubep.BufferConfig(max_tokens_per_rank=8, dtype="bf16", layout=layout, **_SHAPE)
    x = torch.from_numpy(xs[r]).view(torch.bfloat16)
    idx, w = torch.from_numpy(idxs[r]), torch.from_numpy(ws[r])
    out: dict[str, Any] = {}
    with ubep.Buffer(group, cfg) as buf:
        offers = {"n": 0}
        engine_dispatch = buf._fast.dispatch

        class _Counting:  # counts the one native call's offers (the engine is a C type)
            def __getattr__(self, name: str) -> Any:
                return getattr(buf._engine, name)

            def dispatch(self, *a: Any) -> Any:
                offers["n"] += 1
                return engine_dispatch(*a)

        buf._fast = _Counting()
        res = buf.dispatch(x, idx, w)
        out["one_native_call"] = offers["n"] == 1
        buf._fast = buf._engine
        fields = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
        out["tensors"] = sorted({type(v).__name__ for k, v in fields.items()
                                 if k not in ("handle", "recv_x_scales")})
        out["exact"] = all(np.array_equal(_bits(fields[f]), getattr(refs[r], f))
                           for f in ("recv_x", "recv_topk_idx", "recv_topk_weights",
                                     "num_recv_tokens_per_expert", "recv_src_rank",
                                     "recv_src_token", "recv_src_k"))
        # recv_x is the receive region itself: the numpy call's view of the same bytes
        out["region_view"] = res.recv_x.data_ptr() == res._np.recv_x.ctypes.data
        y = buf.combine(res.recv_x, res.handle)
        out["y"] = (str(y.dtype), np.array_equal(_bits(y), want_y))
        # strided inputs (a transposed copy viewed back) and int32 ids: the same answer
        xt = x.t().contiguous().t()
        res2 = buf.dispatch(xt, idx.to(torch.int32), w)
        out["strided_exact"] = np.array_equal(_bits(res2.recv_x), refs[r].recv_x)
        y2 = buf.combine(res2.recv_x.clone(), res2.handle)
        out["strided_y"] = np.array_equal(_bits(y2), want_y)
        # the region's slice of a shape is made once: handed out again when nobody holds it,
        # never while the caller still holds the one before
        def step() -> Any:
            got = buf.dispatch(x, idx, w)
            buf.combine(got.recv_x, got.handle)
            return got

        a = step()  # region 0 (dispatches 0, 2, 4, ...)
        held = a.recv_x
        step()
        b = step()  # region 0 again, its slice still held by the caller
        out["held_not_reused"] = b.recv_x is not held
        key = (torch.bfloat16, 0, held.shape[0])
        cached = id(buf._torch._slices[key])
        del a, b, held
        gc.collect()
        step()
        c = step()
        out["reused"] = id(c.recv_x) == cached
        out["reused_exact"] = np.array_equal(_bits(c.recv_x), refs[r].recv_x)
        # a tensor numpy cannot view (the meta device) on every rank: the checks name it, on
        # every rank, and the next call is exact
        try:
            buf.dispatch(torch.empty_like(x, device="meta"), idx, w)
            out["meta"] = "returned"
        except InvalidArgumentError as exc:
            out["meta"] = "x" in str(exc)
        res3 = buf.dispatch(x, idx, w)
        out["after_meta_exact"] = np.array_equal(_bits(res3.recv_x), refs[r].recv_x)
    return out


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_torch_door_is_the_numpy_call_over_the_same_memory(layout: str) -> None:
    for out in ubep.launch(_worker, 2, layout):
        assert out["one_native_call"], out
        assert out["tensors"] == ["Tensor"], out
        assert out["exact"] and out["region_view"], out
        assert out["y"] == ("torch.bfloat16", True), out
        assert out["strided_exact"] and out["strided_y"], out
        assert out["held_not_reused"] and out["reused"] and out["reused_exact"], out
        assert out["meta"] is True and out["after_meta_exact"], out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64,
                                   torch.int32, torch.uint8, torch.int8, torch.bool])
def test_storage_views_are_torchs_bytes_without_a_copy(dtype: Any) -> None:
    native = load_native()
    t = (torch.arange(24) % 7).to(dtype).reshape(4, 6)
    strided = t.t()  # a view with strides: numpy sees the same strides
    a, s, none, arr = native.storage_views(torch._C._to_dlpack, t, strided, None,
                                           np.zeros(3))
    want = (t.view(torch.uint16) if dtype == torch.bfloat16 else t).numpy()
    assert a.dtype == want.dtype and np.array_equal(a, want)
    assert a.ctypes.data == t.data_ptr() and a.flags.c_contiguous
    assert np.array_equal(s, want.T) and s.ctypes.data == t.data_ptr()
    assert none is None and isinstance(arr, np.ndarray)
    a[0, 0] = a[1, 1]  # one memory: a write through the view is the tensor's
    assert np.array_equal(_bits(t)[0, 0], _bits(t)[1, 1])


def test_storage_views_hand_back_what_they_do_not_view() -> None:
    native = load_native()
    meta = torch.empty(2, 2, device="meta")
    fp8 = torch.zeros(2, 2).to(torch.float8_e4m3fn)
    got = native.storage_views(torch._C._to_dlpack, meta, [1, 2], fp8)
    assert got[0] is meta and got[1] == [1, 2]
    # an FP8 tensor: viewed (as its bytes) or handed back, never misread
    assert got[2] is fp8 or (got[2].dtype == np.uint8 and got[2].shape == (2, 2))


def test_tensor_capsule_is_a_tensor_over_the_array() -> None:
    native = load_native()
    bits = np.array([[0x3F80, 0x4000], [0xC040, 0x0000]], np.uint16)  # 1, 2, -3, 0 in BF16
    t = torch._C._from_dlpack(native.tensor_capsule(bits, 4))
    assert t.dtype == torch.bfloat16 and t.shape == (2, 2)
    assert t.tolist() == [[1.0, 2.0], [-3.0, 0.0]]
    assert t.data_ptr() == bits.ctypes.data
    ptr = bits.ctypes.data
    del bits
    gc.collect()  # the tensor keeps the array alive
    assert t.data_ptr() == ptr and t.tolist() == [[1.0, 2.0], [-3.0, 0.0]]
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]
    tf = torch._C._from_dlpack(native.tensor_capsule(f32, 2))
    assert tf.tolist() == f32.tolist() and tf.stride() == (3, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_storage_views_and_tensor_of_storage_share_memory(dtype: Any) -> None:
    """The facades' conversions: a CPU tensor's storage view (torch's own view of the same
    bits the oracle) and back, no copy either way; a tensor the native path does not view (on
    ``meta``: another device) comes back as it is."""
    from ubep.torch._convert import storage_views, tensor_of_storage

    t = (torch.arange(-60, 60).reshape(8, 15) * 0.37).to(dtype)[:, 1:14]  # strided too
    flat = torch.arange(12, dtype=dtype)
    (a, b) = storage_views(t, flat)
    for tensor, view in ((t, a), (flat, b)):
        assert isinstance(view, np.ndarray) and view.shape == tuple(tensor.shape)
        want = tensor.contiguous()
        assert np.array_equal(view, _bits(want))
        assert view.__array_interface__["data"][0] == tensor.data_ptr()
    back = tensor_of_storage(b, dtype)
    assert back.dtype == dtype and back.data_ptr() == flat.data_ptr() and torch.equal(back, flat)
    meta = torch.empty((4, 4), dtype=dtype, device="meta")
    assert storage_views(meta)[0] is meta
