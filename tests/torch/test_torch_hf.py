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
from tests.torch._hf_configs import VOCAB, tiny_llama4, tiny_mixtral, tiny_qwen3_moe  # noqa: E402
from ubep.errors import InvalidArgumentError, TimeoutError  # noqa: E402
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
    with pytest.raises(InvalidArgumentError, match=r"ubep\.torch\.hf\.register\(group"):
        hf._registry["group"] = None
        with torch.no_grad():
            m(torch.zeros((1, 3), dtype=torch.int64))


def test_importing_ubep_torch_hf_makes_the_name_known() -> None:
    # A forgotten register() must end at ubep's message (above), not at transformers' generic
    # "not supported": importing ubep.torch.hf registers the name. Undo, then redo the import's
    # step.
    from transformers.integrations.moe import ExpertsInterface

    del ExpertsInterface._global_mapping["ubep"]
    with pytest.raises(ValueError, match="not supported"):
        _build(_qwen3, "ubep")
    hf._install()
    assert _build(_qwen3, "ubep").config._experts_implementation == "ubep"


def _llama4(impl: str) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        tiny_llama4(4), experts_implementation=impl
    ).eval()


def test_llama4_experts_bypass_the_interface_and_are_refused() -> None:
    # Llama4TextMoe calls its experts module directly: "ubep" would never run, and sharding it
    # would change the logits. Refused when built, attached or sharded; the model is untouched.
    with pytest.raises(InvalidArgumentError, match=r"Llama4TextExperts.*ExpertsInterface"):
        _llama4("ubep")
    m = _llama4("eager")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m(ids).logits
    with pytest.raises(InvalidArgumentError, match="Llama4TextExperts"):
        hf.shard_experts(m, 1, 2)
    with pytest.raises(InvalidArgumentError, match="Llama4TextExperts"):
        hf.attach(m, LocalWorld(2, 4).backend(0))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, before)


def _gen_kwargs(prompt: torch.Tensor, new_tokens: int, eos: int | None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "attention_mask": torch.ones_like(prompt), "max_new_tokens": new_tokens,
        "do_sample": False, "pad_token_id": 0,
    }
    if eos is None:
        kw["min_new_tokens"] = new_tokens
    else:
        kw["eos_token_id"] = eos
    return kw


def _rank0_stops_first(new_tokens: int) -> tuple[list[torch.Tensor], int, list[torch.Tensor]]:
    """Prompts, an EOS token that rank 0 generates at its 2nd step and rank 1 never does, and
    the eager model's generations with that EOS (rank 0's shorter)."""
    prompts = [
        torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(r))
        for r in range(2)
    ]
    eager = _build(_qwen3, "eager")
    with torch.no_grad():
        free = [eager.generate(p, **_gen_kwargs(p, new_tokens, None)) for p in prompts]
        first = free[0][0, 5:].tolist()
        eos = first[1]
        assert eos != first[0] and eos not in free[1][0, 5:].tolist() and eos != 0
        want = [eager.generate(p, **_gen_kwargs(p, new_tokens, eos)) for p in prompts]
    assert want[0].shape[1] == 5 + 2 < want[1].shape[1]
    return prompts, eos, want


def test_generate_keeps_a_finished_rank_serving_until_all_are_done() -> None:
    N = 6
    prompts, eos, want = _rank0_stops_first(N)
    world = LocalWorld(2, E, layout="expert", timeout_s=30)
    models = [_build(_qwen3, "ubep") for _ in range(2)]
    for r, m in enumerate(models):
        hf.attach(m, world.backend(r))

    def body(rank: int) -> torch.Tensor:
        p = prompts[rank]
        with torch.no_grad():
            return hf.generate(models[rank], p, **_gen_kwargs(p, N, eos))

    got = run_threads(body, 2, timeout_s=120)
    for r in range(2):
        assert torch.equal(got[r], want[r]), (r, got[r], want[r])
    # Rank 0 ran as many MoE calls as rank 1: one dispatch per layer and forward pass.
    assert world.num_calls["dispatch"] == 2 * N


def test_plain_generate_with_unequal_lengths_fails_naming_them() -> None:
    N = 4
    prompts, eos, _ = _rank0_stops_first(N)
    world = LocalWorld(2, E, layout="expert", timeout_s=1)
    models = [_build(_qwen3, "ubep") for _ in range(2)]
    for r, m in enumerate(models):
        hf.attach(m, world.backend(r))

    def body(rank: int) -> torch.Tensor:
        p = prompts[rank]
        with torch.no_grad():  # rank 0 stops after 2 tokens; rank 1 waits for its experts
            return models[rank].generate(p, **_gen_kwargs(p, N, eos))

    with pytest.raises(RuntimeError, match="rank 1") as info:
        run_threads(body, 2, timeout_s=60)
    assert isinstance(info.value.__cause__, TimeoutError)
    assert "unequal generate() lengths" in str(info.value.__cause__)
