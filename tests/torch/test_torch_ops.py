"""ubep.torch dispatch/combine: zero-copy conversion, autograd against float64 oracles.

Multi-rank cases run N ranks as threads of this process (``LocalWorld``), which accepts float64,
so ``torch.autograd.gradcheck`` (finite differences) can check every backward formula, and the
gradients of a whole MoE layer can be compared with a dense single-process float64 layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from ubep.errors import InvalidArgumentError  # noqa: E402
from ubep.modes import LAYOUTS  # noqa: E402
from ubep.torch import LocalWorld, MoELayer, combine, dispatch, run_threads  # noqa: E402
from ubep.torch._convert import from_numpy, to_numpy  # noqa: E402


# --------------------------------------------------------------------------- conversion
def test_to_numpy_shares_memory_for_every_payload_dtype() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8):
        t = torch.arange(12).reshape(3, 4).to(dtype)
        a = to_numpy(t)
        assert a.ctypes.data == t.data_ptr()  # same memory, no copy
        back = from_numpy(a, dtype)
        assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)


def test_bf16_travels_as_its_bit_pattern() -> None:
    t = torch.tensor([1.0, -2.5, 3.140625, float("inf")], dtype=torch.bfloat16)
    bits = to_numpy(t)
    assert bits.dtype == np.uint16
    # Independent oracle: the top 16 bits of the float32 value (exact for bf16 values).
    expected = (t.float().numpy().view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(bits, expected)


def test_to_numpy_rejects_non_tensors() -> None:
    with pytest.raises(InvalidArgumentError, match="x="):
        to_numpy(np.zeros(3))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- helpers
def _routing(num_tokens: int, num_experts: int, num_topk: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack(
        [torch.randperm(num_experts, generator=g)[:num_topk] for _ in range(num_tokens)]
    )
    if num_tokens > 1:
        idx[1, -1] = -1  # a masked slot
    return idx.to(torch.int64)


def _expert_maps(num_experts: int, hidden: int) -> torch.Tensor:
    # A different linear map per expert, so rows that end at the wrong expert change the result.
    g = torch.Generator().manual_seed(99)
    return torch.randn(num_experts, hidden, hidden, generator=g, dtype=torch.float64) / hidden


def _pipeline(world: LocalWorld, rank: int, maps: torch.Tensor, idx: torch.Tensor,
              hooked: bool = False):
    """f(x, w) = combine(expert_e(dispatch(x)), weights w) on this rank (``hooked``: both calls
    split-phase, received through their hooks)."""
    backend = world.backend(rank)
    per_rank = world.num_experts // world.num_ranks
    first = rank * per_rank

    def combine_(out: torch.Tensor, handle: Any) -> torch.Tensor:
        return combine(out, handle, return_recv_hook=True).hook() if hooked else combine(
            out, handle)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        res = dispatch(backend, x, idx, w, return_recv_hook=hooked)
        res = res.hook() if hooked else res
        if world.layout == "expert":
            expert = res.recv_topk_idx  # global expert id of each row
            out = torch.einsum("nh,nkh->nk", res.recv_x, maps[expert].transpose(1, 2))
            return combine_(out, res.handle)
        # rank layout: the caller applies its local experts and their weights
        out = torch.zeros_like(res.recv_x)
        for k in range(idx.shape[1]):
            local = res.recv_topk_idx[:, k]
            ok = local >= 0
            mapped = torch.einsum(
                "nh,nkh->nk", res.recv_x, maps[first + local.clamp(min=0)].transpose(1, 2)
            )
            out = out + torch.where(ok[:, None], res.recv_topk_weights[:, k, None] * mapped, 0.0)
        return combine_(out, res.handle)

    return f


def _dense(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        ok = idx[:, k] >= 0
        mapped = torch.einsum("nh,nkh->nk", x, maps[idx[:, k].clamp(min=0)].transpose(1, 2))
        y = y + torch.where(ok[:, None], w[:, k, None] * mapped, 0.0)
    return y


# --------------------------------------------------------------------------- autograd
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_dispatch_combine_on_two_ranks(layout: str) -> None:
    """Finite differences (float64) agree with the collective backward passes on every rank."""
    R, E, H, K, T = 2, 4, 4, 2, 3
    world = LocalWorld(R, E, layout=layout)
    maps = _expert_maps(E, H)

    def body(rank: int) -> bool:
        idx = _routing(T, E, K, seed=rank)
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.rand(T, K, generator=g, dtype=torch.float64).requires_grad_(True)
        f = _pipeline(world, rank, maps, idx)
        # Routing weights travel as float32 (as in DeepEP), so a perturbation of eps is rounded to
        # float32: eps=1e-3 keeps that error (~ulp/eps) at 1e-4 relative. f is linear in x and in
        # w, so the central difference itself is exact for any eps.
        return bool(
            torch.autograd.gradcheck(
                f,
                (x, w),
                eps=1e-3,
                atol=1e-5,
                rtol=1e-3,
                check_undefined_grad=False,
                check_batched_grad=False,
                fast_mode=False,
            )
        )

    assert run_threads(body, R, timeout_s=120) == [True, True]


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_match_dense_reference(layout: str, hooked: bool) -> None:
    """Gradients w.r.t. x and routing weights equal a dense float64 computation (3 ranks), with
    blocking calls and with split-phase calls received through their hooks."""
    R, E, H, K, T = 3, 6, 5, 3, 4
    world = LocalWorld(R, E, layout=layout)
    maps = _expert_maps(E, H)
    xs = [
        torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        for r in range(R)
    ]
    # Weights exactly representable in float32, so the float32 weight channel loses nothing.
    ws = [
        torch.rand(T, K, generator=torch.Generator().manual_seed(9 + r)).double() for r in range(R)
    ]
    idxs = [_routing(T, E, K, seed=20 + r) for r in range(R)]
    if layout == "expert":
        idxs[2] = torch.full((T, K), -1, dtype=torch.int64)  # a rank that sends nothing
    probes = [
        torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + r))
        for r in range(R)
    ]

    def body(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = xs[rank].clone().requires_grad_(True)
        w = ws[rank].clone().requires_grad_(True)
        y = _pipeline(world, rank, maps, idxs[rank], hooked)(x, w)
        (y * probes[rank]).sum().backward()
        assert x.grad is not None and w.grad is not None
        return y.detach(), x.grad, w.grad

    got = run_threads(body, R)
    for r in range(R):
        x = xs[r].clone().requires_grad_(True)
        w = ws[r].clone().requires_grad_(True)
        y = _dense(x, w, idxs[r], maps)
        (y * probes[r]).sum().backward()
        torch.testing.assert_close(got[r][0], y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[r][1], x.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[r][2], w.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_layer_gradients_match_dense_layer(layout: str) -> None:
    """Training step in float64 on 2 ranks: every parameter and input gradient equals the dense
    layer's (each rank's expert gradients = the dense gradients of the experts it owns)."""
    R, E, H, F, K, T = 2, 4, 8, 6, 2, 5
    world = LocalWorld(R, E, layout=layout)
    xs = [
        torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        for r in range(R)
    ]
    probes = [
        torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + r))
        for r in range(R)
    ]

    def body(rank: int) -> dict[str, torch.Tensor]:
        layer = MoELayer(H, F, E, K, world.backend(rank), seed=5, dtype=torch.float64)
        x = xs[rank].clone().requires_grad_(True)
        (layer(x) * probes[rank]).sum().backward()
        return {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}

    got = run_threads(body, R)
    dense = MoELayer(H, F, E, K, None, seed=5, dtype=torch.float64)
    x_d = [x.clone().requires_grad_(True) for x in xs]
    ys = dense.forward_dense(x_d)
    sum((y * p).sum() for y, p in zip(ys, probes, strict=True)).backward()
    tol = {"rtol": 1e-10, "atol": 1e-12}
    router_grad = sum(g["router"] for g in got)  # data parallel router: gradients add over ranks
    torch.testing.assert_close(router_grad, dense.router.grad, **tol)
    for r in range(R):
        torch.testing.assert_close(got[r]["x"], x_d[r].grad, **tol)
        sl = slice(r * E // R, (r + 1) * E // R)
        torch.testing.assert_close(got[r]["gate_up_proj"], dense.gate_up_proj.grad[sl], **tol)
        torch.testing.assert_close(got[r]["down_proj"], dense.down_proj.grad[sl], **tol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_forward_matches_dense(layout: str, dtype: torch.dtype) -> None:
    R, E, H, F, K, T = 2, 8, 16, 8, 3, 6
    world = LocalWorld(R, E, layout=layout)
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(R)]
    xs[1] = xs[1][:0]  # rank 1 has no tokens this step

    def body(rank: int) -> torch.Tensor:
        with torch.no_grad():
            return MoELayer(H, F, E, K, world.backend(rank), seed=1, dtype=dtype)(xs[rank])

    got = run_threads(body, R)
    with torch.no_grad():
        ref = MoELayer(H, F, E, K, None, seed=1, dtype=dtype).forward_dense(xs)
    for r in range(R):
        if layout == "expert":
            assert torch.equal(got[r], ref[r])  # same rows, same order, same float32 sum
        else:
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[r], ref[r], rtol=tol, atol=tol)


def test_dispatch_validates_arguments() -> None:
    world = LocalWorld(1, 4)
    backend = world.backend(0)
    x = torch.zeros(2, 4)
    idx = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(InvalidArgumentError, match="topk_idx"):
        dispatch(backend, x, idx.int(), torch.ones(2, 2))
    with pytest.raises(InvalidArgumentError, match="topk_idx"):
        dispatch(backend, x, torch.tensor([[0, 0], [1, 2]]), torch.ones(2, 2))  # duplicate expert
    res = dispatch(backend, x, torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(InvalidArgumentError, match="expert_out"):
        combine(torch.zeros(3, 5), res.handle)


# --------------------------------------------------------------------------- fake vs oracle
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("np_dtype", [np.float32, np.uint16])
def test_local_world_agrees_with_reference_oracle(layout: str, np_dtype: type) -> None:
    """The thread fake and ``ubep.reference`` are independent implementations of one spec."""
    reference = pytest.importorskip("ubep.reference")
    R, E, H, K = 3, 6, 8, 3
    rng = np.random.default_rng(4)
    counts = [5, 0, 7]
    idxs = [
        np.stack([rng.permutation(E)[:K] for _ in range(n)]) if n else np.zeros((0, K), np.int64)
        for n in counts
    ]
    idxs[0][2, 1] = -1
    ws = [rng.random((n, K), dtype=np.float32) for n in counts]
    xs = [rng.standard_normal((n, H)).astype(np.float32) for n in counts]
    if np_dtype == np.uint16:  # bf16 bits of the values
        xs = [(x.view(np.uint32) >> 16).astype(np.uint16) for x in xs]
    ref = reference.dispatch(xs, idxs, ws, E, layout=layout)
    world = LocalWorld(R, E, layout=layout)
    outs = [rng.standard_normal((len(r.recv_x), H)).astype(np.float32) for r in ref]
    if np_dtype == np.uint16:
        outs = [(o.view(np.uint32) >> 16).astype(np.uint16) for o in outs]
    ref_y = reference.combine(outs, ref)

    def body(rank: int) -> tuple[object, np.ndarray]:
        b = world.backend(rank)
        res = b.dispatch(xs[rank], idxs[rank], ws[rank])
        return res, b.combine(outs[rank], res.handle)

    got = run_threads(body, R)
    for r in range(R):
        res, y = got[r]
        for field in (
            "recv_x",
            "recv_topk_idx",
            "recv_topk_weights",
            "num_recv_tokens_per_expert",
            "recv_src_rank",
            "recv_src_token",
            "recv_src_k",
        ):
            np.testing.assert_array_equal(
                getattr(res, field), getattr(ref[r], field), err_msg=field
            )
        np.testing.assert_array_equal(y, ref_y[r])  # bit-exact combine
