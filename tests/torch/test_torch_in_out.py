"""``ubep.Buffer`` with torch tensors returns torch tensors of the input's dtype (numpy in,
numpy out), over the same memory the numpy call would hand back; the oracle is
``ubep.reference`` on the numpy bits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ubep  # noqa: E402
from ubep import reference, testing  # noqa: E402

_SHAPE = {"num_experts": 8, "num_topk": 2, "hidden": 256}
_TOKENS = [6, 3]


def _worker(group: Any, dtype: str, quant: str | None, on_peer_loss: str) -> dict[str, Any]:
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    xs, idxs, ws = testing.inputs(dtype, _SHAPE["num_experts"], _SHAPE["num_topk"],
                                  _SHAPE["hidden"], _TOKENS, 3, "uniform")
    r = group.rank
    refs = reference.dispatch(xs, idxs, ws, _SHAPE["num_experts"], layout="expert")
    cfg = ubep.BufferConfig(max_tokens_per_rank=8, dtype=dtype, quant=quant,
                            on_peer_loss=on_peer_loss, **_SHAPE)
    x = torch.from_numpy(xs[r]).view(tdtype)
    out: dict[str, Any] = {}
    with ubep.Buffer(group, cfg) as buf:
        numpy_res = buf.dispatch(xs[r], idxs[r], ws[r], copy=True)
        out["numpy_in_numpy_out"] = all(
            isinstance(getattr(numpy_res, f), np.ndarray)
            for f in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_rank"))
        for how in ("blocking", "hook"):
            args = (x, torch.from_numpy(idxs[r]), torch.from_numpy(ws[r]))
            res = (buf.dispatch(*args) if how == "blocking"
                   else buf.dispatch(*args, return_recv_hook=True).hook())
            out[f"{how}_types"] = sorted({type(v).__name__ for v in (
                res.recv_x, res.recv_topk_idx, res.recv_topk_weights, res.recv_src_rank,
                res.num_recv_tokens_per_expert)})
            out[f"{how}_recv_dtype"] = str(res.recv_x.dtype)
            if quant is None:
                bits = res.recv_x.view(torch.uint16 if dtype == "bf16" else torch.float32)
                out[f"{how}_recv_exact"] = np.array_equal(bits.numpy(), refs[r].recv_x)
                eo = res.recv_x
            else:  # the expert outputs of a quantised dispatch: the reference's rows
                out[f"{how}_recv_exact"] = res.recv_x_scales is not None and (
                    res.recv_x_scales.dtype == torch.float32)
                eo = torch.from_numpy(refs[r].recv_x.copy()).view(tdtype)
            y = (buf.combine(eo, res.handle) if how == "blocking"
                 else buf.combine(eo, res.handle, return_recv_hook=True).hook())
            want = reference.combine([ref.recv_x for ref in refs], refs)[r]
            out[f"{how}_y_dtype"] = str(y.dtype)
            if quant is None:
                ybits = y.view(torch.uint16 if dtype == "bf16" else torch.float32).numpy()
                out[f"{how}_y_exact"] = isinstance(y, torch.Tensor) and np.array_equal(
                    ybits, want)
            else:
                out[f"{how}_y_exact"] = isinstance(y, torch.Tensor)
    return out


@pytest.mark.parametrize(("dtype", "quant", "on_peer_loss", "recv_dtype"), [
    ("bf16", None, "raise", "torch.bfloat16"),
    ("fp32", None, "mask", "torch.float32"),
    ("bf16", "e4m3", "raise", "torch.float8_e4m3fn"),
])
def test_torch_in_gives_torch_out_of_the_inputs_dtype(
        dtype: str, quant: str | None, on_peer_loss: str, recv_dtype: str) -> None:
    for out in ubep.launch(_worker, 2, dtype, quant, on_peer_loss):
        assert out["numpy_in_numpy_out"]
        for how in ("blocking", "hook"):
            assert out[f"{how}_types"] == ["Tensor"], out
            assert out[f"{how}_recv_dtype"] == recv_dtype
            assert out[f"{how}_recv_exact"] and out[f"{how}_y_exact"], out
            assert out[f"{how}_y_dtype"] == f"torch.{'bfloat16' if dtype == 'bf16' else 'float32'}"
