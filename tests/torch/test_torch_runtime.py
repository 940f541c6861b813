"""ubep.torch on the real runtime: 2 processes, shared memory, the native data plane.

One ``launch`` runs every case (process start-up and ``import torch``/``transformers`` cost
seconds); each rank returns what it computed and the parent compares with single-process
oracles: the dense MoE layer, its float32 gradients, the eager Hugging Face model, and dense
sums for the DeepEP facade.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
transformers = pytest.importorskip("transformers")

from tests.torch._hf_configs import VOCAB, tiny_mixtral, tiny_qwen3_moe  # noqa: E402
from ubep.modes import LAYOUTS  # noqa: E402
from ubep.runtime import launch  # noqa: E402
from ubep.torch import MoELayer  # noqa: E402
from ubep.torch._runtime import make_backend  # noqa: E402

R, H, F, E, K, T = 2, 64, 32, 8, 3, 6
# MKL's sgemm splits its reductions by the number of threads it runs on, so the same matmul gives
# different low bits with 1 and 2 threads (seen on AMD EPYC). Ranks and the parent's dense oracles
# run with this many intra-op threads, whatever OMP_NUM_THREADS says, so "bit-exact" compares
# the same arithmetic.
COMPUTE_THREADS = 1


@pytest.fixture(scope="module", autouse=True)
def _pinned_compute_threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(COMPUTE_THREADS)
    yield
    torch.set_num_threads(before)


def _x(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(dtype)


def _probe(rank: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank))


def _qwen3() -> Any:
    return tiny_qwen3_moe(E, 2)


def _mixtral() -> Any:
    return tiny_mixtral(E)


def _build(make_cfg: Any, impl: str) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        make_cfg(), experts_implementation=impl
    ).eval()


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))


def _generate(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
    )


def _to_np(obj: Any) -> Any:
    # Tensors sent back through a pipe would be shared through file descriptors that die with
    # the rank; float32 numpy holds every value exactly (bf16 included).
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(torch.float32 if obj.is_floating_point() else obj.dtype).numpy()
    if isinstance(obj, dict):
        return {k: _to_np(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_to_np(v) for v in obj)
    return obj


def _t(a: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(a).to(dtype)


def _worker(group: Any) -> dict[str, Any]:
    import ubep.torch.hf as hf

    torch.set_num_threads(COMPUTE_THREADS)
    out: dict[str, Any] = {}
    opts = {"timeout_s": 30.0}  # a wait that cannot finish fails the test instead of hanging it
    for layout in LAYOUTS:
        for dtype in (torch.float32, torch.bfloat16):
            backend = make_backend(
                group,
                hidden=H,
                num_topk=K,
                num_experts=E,
                dtype=dtype,
                max_tokens_per_rank=T,
                layout=layout,
            )
            layer = MoELayer(H, F, E, K, backend, seed=3, dtype=dtype)
            with torch.no_grad():
                out[f"fwd-{layout}-{dtype}"] = layer(_x(group.rank, dtype))
            if dtype == torch.float32:  # a training step: gradients through the runtime
                x = _x(group.rank, dtype).requires_grad_(True)
                (layer(x) * _probe(group.rank)).sum().backward()
                out[f"grad-{layout}"] = {
                    "x": x.grad,
                    **{n: p.grad for n, p in layer.named_parameters()},
                }
            backend.close()
    from tests.torch import test_torch_deep_ep as dep  # the DeepEP flows, here on the real runtime

    out["deep_ep-normal"] = dep.normal_flow(group, group.rank)
    out["deep_ep-ll-fp8"] = dep.low_latency_flow(group, group.rank, True)
    out["deep_ep-two-batch"] = dep.two_batch_flow(group, group.rank)
    out["deep_ep-normal-fp8"] = dep.normal_fp8_flow(group, group.rank)
    hf.register(group, layout="expert", max_tokens_per_rank=16, **opts)
    for name, make_cfg in (("qwen3", _qwen3), ("mixtral", _mixtral)):
        model = _build(make_cfg, "ubep")
        hf.shard_experts(model, group.rank, group.num_ranks)
        with torch.no_grad():
            out[f"hf-{name}"] = (model(_ids(group.rank)).logits, _generate(model, _ids(group.rank)))
    return _to_np(out)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(_worker, R, timeout_s=240)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_on_two_processes_matches_dense(
    results: list[dict[str, Any]], layout: str, dtype: torch.dtype
) -> None:
    dense = MoELayer(H, F, E, K, None, seed=3, dtype=dtype)
    with torch.no_grad():
        ref = dense.forward_dense([_x(r, dtype) for r in range(R)])
    for r in range(R):
        got = _t(results[r][f"fwd-{layout}-{dtype}"], dtype)
        if layout == "expert":
            assert torch.equal(got, ref[r])  # bit-exact: same rows, same float32 order
        else:
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, ref[r], rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_gradients_on_two_processes_match_dense(
    results: list[dict[str, Any]], layout: str
) -> None:
    dense = MoELayer(H, F, E, K, None, seed=3)
    xs = [_x(r, torch.float32).requires_grad_(True) for r in range(R)]
    ys = dense.forward_dense(xs)
    sum((y * _probe(r)).sum() for r, y in enumerate(ys)).backward()
    tol = {"rtol": 1e-4, "atol": 1e-5}  # float32; gradient rows travel as float32 payloads
    got = [{k: _t(v) for k, v in results[r][f"grad-{layout}"].items()} for r in range(R)]
    torch.testing.assert_close(got[0]["router"] + got[1]["router"], dense.router.grad, **tol)
    for r in range(R):
        torch.testing.assert_close(got[r]["x"], xs[r].grad, **tol)
        sl = slice(r * E // R, (r + 1) * E // R)
        torch.testing.assert_close(got[r]["gate_up_proj"], dense.gate_up_proj.grad[sl], **tol)
        torch.testing.assert_close(got[r]["down_proj"], dense.down_proj.grad[sl], **tol)


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_hf_model_on_two_processes_matches_eager(results: list[dict[str, Any]], name: str) -> None:
    eager = _build(_qwen3 if name == "qwen3" else _mixtral, "eager")
    for r in range(R):
        logits, gen = results[r][f"hf-{name}"]
        with torch.no_grad():
            torch.testing.assert_close(_t(logits), eager(_ids(r)).logits, rtol=1e-4, atol=1e-4)
            assert torch.equal(torch.from_numpy(gen), _generate(eager, _ids(r)))


def test_decode_cli_ubep_and_gloo_agree_token_for_token() -> None:
    """The decode benchmark's (``python -m benchmarks.torch_decode``) machinery on a tiny shape:
    the gloo all_to_all baseline is an independent
    implementation of the same experts, so both must produce the same greedy tokens; with
    ``--overlap``'s rows, the two-batch overlap equals the serial micro-batches bit for bit."""
    from benchmarks.torch_decode import DecodeConfig, format_table, run_decode

    cfg = DecodeConfig(
        hidden=64,
        num_experts=8,
        top_k=2,
        moe_ffn=16,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab=64,
        batch=2,
        prompt_len=4,
        steps=4,
        warmup=1,
        dtype="fp32",
    )
    # --overlap's rows ride along (one launch): two micro-batches blocking / overlapped with
    # return_recv_hook, whose logits must agree bit for bit at every step
    results = run_decode(cfg, ("ubep", "gloo", "ubep-2mb", "ubep-tbo"), timeout_s=180)
    assert [r.backend for r in results] == ["ubep", "gloo", "ubep-2mb", "ubep-tbo"]
    assert results[0].tokens_match_ubep and results[1].tokens_match_ubep
    assert results[3].exact_vs_2mb is True
    assert [r.exact_vs_2mb for r in results[:3]] == [None, None, None]
    for r in results:
        assert 0 < r.tpot_min_ms <= r.tpot_p50_ms <= r.tpot_p99_ms <= r.tpot_max_ms
        assert 0 < r.comm_share < 1
    assert "tpot_p50_ms" in format_table(cfg, results)


def test_deep_ep_facade_on_two_processes(results: list[dict[str, Any]]) -> None:
    from tests.torch import test_torch_deep_ep as dep

    for r in range(R):
        y, combined_w, cached_ok = results[r]["deep_ep-normal"]
        dep.check_normal(r, _t(y, torch.bfloat16), _t(combined_w), cached_ok)
        dep.check_low_latency(r, _t(results[r]["deep_ep-ll-fp8"], torch.bfloat16), True)
        rq, rs, plain, cached_ok = results[r]["deep_ep-normal-fp8"]
        dep.check_normal_fp8((_t(rq, torch.uint8), _t(rs), _t(plain, torch.bfloat16), cached_ok))
        two = results[r]["deep_ep-two-batch"]
        dep.check_two_batches(r, {
            **two, "ys": [_t(y, torch.bfloat16) for y in two["ys"]],
            "blocking": [_t(y, torch.bfloat16) for y in two["blocking"]],
        })
