"""The simulator moves exactly the rows the plan names, to the slots the receiver expects."""

from __future__ import annotations

import numpy as np
import pytest

from ubep.errors import InvalidArgumentError
from ubep.routing import uniform_topk, zipf_topk
from ubep.sched.policies import schedule
from ubep.sim import build_spec, transfers
from ubep.sim.calib import load_fabric
from ubep.topology import cm384


def oracle(idx: np.ndarray, num_experts: int, num_ranks: int, layout: str) -> set[tuple]:
    """(dst_rank, expert, slot, token, k) straight from topk_idx, by brute force."""
    per_rank = num_experts // num_ranks
    out = set()
    if layout == "expert":
        for e in range(num_experts):
            rows = [(t, k) for t in range(idx.shape[0]) for k in range(idx.shape[1])
                    if idx[t, k] == e]
            for slot, (t, k) in enumerate(rows):
                out.add((e // per_rank, e, slot, t, k))
    else:
        for d in range(num_ranks):
            slot = 0
            for t in range(idx.shape[0]):
                ks = [k for k in range(idx.shape[1])
                      if idx[t, k] >= 0 and idx[t, k] // per_rank == d]
                if ks:
                    out.add((d, int(idx[t, ks[0]]), slot, t, ks[0]))
                    slot += 1
    return out


@pytest.mark.parametrize("layout", ["expert", "rank"])
@pytest.mark.parametrize("policy", ["expert_contiguous", "balanced", "hierarchical"])
def test_transfers_match_topk_oracle(policy: str, layout: str) -> None:
    topo = cm384(8, ranks_per_node=4, cores_per_rank=6)
    num_experts = 16
    idx = zipf_topk(40, num_experts, 4, seed=11, mask_prob=0.1)
    plan = schedule(idx, topo, rank=5, num_experts=num_experts, policy=policy, layout=layout)
    tr = transfers(plan, row_bytes=700, sync="sp")
    got = set(zip(tr.dst_rank.tolist(), tr.expert.tolist(), tr.slot.tolist(),
                  tr.src_token.tolist(), tr.src_k.tolist(), strict=True))
    assert len(got) == tr.dst_rank.size  # no row twice
    assert got == oracle(idx, num_experts, 8, layout)
    assert np.all(tr.nbytes == 700)
    np.testing.assert_array_equal(tr.core, plan.send_core)  # issue order is the plan's
    np.testing.assert_array_equal(tr.hop, [topo.hop(5, int(d)) for d in tr.dst_rank])
    tff = transfers(plan, row_bytes=700, sync="tff")
    assert np.all(tff.nbytes == 2 * 512)  # 700 B -> two blocks of 480 B payload


def test_spec_receive_slots_form_the_receive_buffer() -> None:
    topo = cm384(8, ranks_per_node=4, cores_per_rank=6)
    num_experts = 16
    plans = [schedule(uniform_topk(24, num_experts, 4, seed=r), topo, rank=r,
                      num_experts=num_experts, policy="hierarchical") for r in range(8)]
    spec = build_spec(plans, topo, load_fabric("cm384"), engine="asp", sync="sp", row_bytes=64)
    trs = [transfers(p, row_bytes=64) for p in plans]
    # The executor's units are the plans' transfers, rank after rank, in issue order.
    np.testing.assert_array_equal(spec.unit_dst, np.concatenate([t.dst_rank for t in trs]))
    np.testing.assert_array_equal(spec.unit_core, np.concatenate([t.core for t in trs]))
    # Each receive item is one row; per (dst, src, expert) region the slots are 0..n-1.
    assert np.array_equal(np.sort(spec.unit_item), np.arange(spec.num_items))
    src = spec.unit_src
    expert = np.concatenate([t.expert for t in trs])
    slot = np.concatenate([t.slot for t in trs])
    for key in set(zip(spec.unit_dst.tolist(), src.tolist(), expert.tolist(), strict=True)):
        m = (spec.unit_dst == key[0]) & (src == key[1]) & (expert == key[2])
        assert sorted(slot[m].tolist()) == list(range(int(m.sum())))
    # Items of one rank are in output order: (expert, src, slot) ascending.
    for d in range(8):
        m = spec.unit_dst == d
        order = np.argsort(spec.unit_item[m])
        keys = list(zip(expert[m][order], src[m][order], slot[m][order], strict=True))
        assert keys == sorted(keys)


def test_transfers_rejects_bad_input() -> None:
    topo = cm384(4, ranks_per_node=2, cores_per_rank=4)
    plan = schedule(uniform_topk(4, 4, 2, seed=0), topo, rank=0, num_experts=4)
    for kwargs, arg in (({"row_bytes": 0}, "row_bytes"), ({"row_bytes": 8, "sync": "x"}, "sync"),
                        ({"row_bytes": 8, "flag_bytes": 4}, "flag_bytes")):
        with pytest.raises(InvalidArgumentError) as exc:
            transfers(plan, **kwargs)  # type: ignore[arg-type]
        assert exc.value.argument == arg
    with pytest.raises(InvalidArgumentError):
        transfers("plan", row_bytes=8)  # type: ignore[arg-type]
