"""transformers integration: experts_implementation="ubep" against the eager model.

Two ranks as threads (``LocalWorld``) each run the whole model on their own batch with the experts
expert-parallel; rank r's logits and greedy generations must equal the plain eager model's on
rank r's input in one process. Models are built in the main thread (one global RNG) from a seeded
tiny config, so every copy has the same weights; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
transformers = pytest.importorskip("transformers")

import ubep.torch.hf as hf  # noqa: E402
from _hf_configs import VOCAB, tiny_mixtral, tiny_qwen3_moe  # noqa: E402
from ubep.torch import LocalWorld, run_threads  # noqa: E402

E = 8
# float32 logits: eager adds experts in expert-id order in the model dtype, ubep in top-k order
# in float32 (the same sum, associated differently).
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _qwen3() -> Any:
    return tiny_qwen3_moe(E, 3, norm_topk_prob=True)


def _mixtral() -> Any:
    return tiny_mixtral(E)


def _build(make_cfg: Callable[[], Any], impl: str) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        make_cfg(), experts_implementation=impl
    ).eval()


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    hf.register(None)


@pytest.mark.parametrize(
    ("make_cfg", "layout"), [(_qwen3, "expert"), (_mixtral, "rank")]
)
def test_two_ranks_match_eager_forward_and_generate(
    make_cfg: Callable[[], Any], layout: str
) -> None:
    R = 2
    world = LocalWorld(R, E, layout=layout)
    ids = [
        torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(r))
        for r in range(R)
    ]
    models = [_build(make_cfg, "ubep") for _ in range(R)]
    for r, m in enumerate(models):
        assert hf.attach(m, world.backend(r)) == 2  # one experts module per layer
    hf.shard_experts(models[1], 1, R)  # one rank keeps only its own experts: same answers

    def body(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = models[rank]
        with torch.no_grad():
            logits = m(ids[rank]).logits
            # Fixed length: every rank must run every MoE layer equally often.
            gen = m.generate(
                ids[rank],
                attention_mask=torch.ones_like(ids[rank]),
                max_new_tokens=4,
                min_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
            )
        return logits, gen

    got = run_threads(body, R, timeout_s=120)
    eager = _build(make_cfg, "eager")
    for r in range(R):
        with torch.no_grad():
            logits = eager(ids[r]).logits
            gen = eager.generate(
                ids[r],
                attention_mask=torch.ones_like(ids[r]),
                max_new_tokens=4,
                min_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
            )
        torch.testing.assert_close(got[r][0], logits, **TOL)
        assert torch.equal(got[r][1], gen)


def test_shard_experts_keeps_the_local_slice() -> None:
    m = _build(_qwen3, "eager")
    full = [mod.gate_up_proj.detach().clone() for mod in hf._experts_modules(m)]
    assert hf.shard_experts(m, 1, 2) == 2
    for mod, before in zip(hf._experts_modules(m), full, strict=True):
        assert torch.equal(mod.gate_up_proj, before[E // 2 :])
        assert mod.down_proj.shape[0] == E // 2


def test_from_config_accepts_the_registered_name_and_needs_a_backend() -> None:
    m = _build(_qwen3, "ubep")
    assert m.config._experts_implementation == "ubep"
    with pytest.raises(ValueError, match="register"), torch.no_grad():
        hf._registry["group"] = None
        m(torch.zeros((1, 3), dtype=torch.int64))
