"""M2N (``BufferConfig(expert_ranks=)``): senders dispatch to the expert ranks and combine back,
bit-exact against the oracle given the same roles (``ubep.reference.dispatch(...,
expert_ranks=)``), every engine x sync x layout; bad role sets refused naming ``expert_ranks``
on every rank, and the next Buffer works."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ubep import modes, reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError
from ubep.expert_map import ExpertMap
from ubep.m2n import logical_experts, m2n_expert_map
from ubep.runtime import launch

RANKS = 4
EXPERTS = 12  # logical: divides over 1, 2 and 3 expert ranks
MODES = [(e, s, lay) for e in modes.ENGINES for s in modes.SYNCS for lay in modes.LAYOUTS]

# (expert_ranks, tokens per rank): senders send, expert ranks pass 0 but in the hybrid
ROLES: dict[str, tuple[tuple[int, ...], list[int]]] = {
    "1->3": ((1, 2, 3), [24, 0, 0, 0]),
    "3->1": ((3,), [24, 9, 17, 0]),
    "2->2": ((2, 3), [24, 11, 0, 0]),
    "hybrid": ((3, 1), [24, 13, 0, 5]),  # rank 1 holds experts and sends; order (3, 1)
}


def _config(expert_ranks: tuple[int, ...], mode: tuple[str, str, str], **extra: Any
            ) -> BufferConfig:
    engine, sync, layout = mode
    return BufferConfig(max_tokens_per_rank=24, hidden=256, num_topk=4, num_experts=EXPERTS,
                        dtype="bf16", engine=engine, sync=sync, layout=layout,
                        expert_ranks=expert_ranks, timeout_s=60.0, **extra)


def _serve(group: Any, roles: list[tuple[str, tuple[str, str, str], int]]) -> list[str]:
    errors: list[str] = []
    for name, mode, cores in roles:
        expert_ranks, tokens = ROLES[name]
        with Buffer(group, _config(expert_ranks, mode, num_cores=cores)) as buf:
            for step in range(2):
                seed = 1000 * step + len(errors)
                xs, idxs, ws = testing.inputs("bf16", EXPERTS, 4, 256, tokens, seed,
                                              "uniform" if step == 0 else "hot")
                errors += [f"{name} {mode} step {step}: {e}"
                           for e in testing.check_call(buf, xs, idxs, ws, seed)]
                res = buf.dispatch(xs[buf.rank], idxs[buf.rank], ws[buf.rank])
                if buf.rank not in expert_ranks and (
                        res.recv_x.shape[0] or res.num_recv_tokens_per_expert.shape != (0,)):
                    errors.append(f"{name} {mode}: sender {buf.rank} received rows or counts")
                if buf.config.num_experts != EXPERTS or buf.config.expert_ranks != expert_ranks:
                    errors.append(f"{name} {mode}: buf.config is not the caller's")
                buf.combine(res.recv_x, res.handle)
    return errors


def _plan() -> list[tuple[str, tuple[str, str, str], int]]:
    """Every mode for the disjoint 2->2, a rotating quarter of them for each other role set;
    one core per rank, and three (count and send cores: ubep.sched's Plan of the physical
    routing) for ASP in both layouts."""
    plan = [("2->2", m, 1) for m in MODES]
    for i, name in enumerate(("1->3", "3->1", "hybrid")):
        plan += [(name, MODES[j], 1) for j in range(i, len(MODES), 4)]
    plan += [("hybrid", ("asp", "sw", "expert"), 3), ("1->3", ("asp", "tff", "rank"), 3)]
    return plan


def test_every_role_set_is_bit_exact_against_the_oracle_with_the_roles() -> None:
    plan = _plan()
    assert {m for _, m, _ in plan} == set(MODES) and len(plan) == 30
    assert launch(_serve, RANKS, plan, timeout_s=600) == [[]] * RANKS


def test_the_oracle_places_the_experts_on_the_expert_ranks_only() -> None:
    """The oracle with roles (3, 1): logical expert e on rank (3, 1)[e // 6], local e % 6; the
    senders receive nothing; the rows named by recv_topk_idx are exactly the picks (closed
    form: every valid pick of every rank lands once)."""
    xs, idxs, ws = testing.inputs("bf16", EXPERTS, 4, 64, [10, 7, 0, 3], 5, "uniform")
    refs = reference.dispatch(xs, idxs, ws, EXPERTS, expert_ranks=(3, 1))
    emap = m2n_expert_map(EXPERTS, (3, 1), RANKS)
    for r, ref in enumerate(refs):
        owner = {3: 0, 1: 1}.get(r)
        want = 0 if owner is None else sum(int((idx[idx >= 0] // 6 == owner).sum())
                                           for idx in idxs)
        assert ref.recv_x.shape[0] == want, (r, want)
        assert ref.num_recv_tokens_per_expert.shape == ((0,) if owner is None else (6,))
        if owner is not None:  # logical ids, local expert e % 6, ascending per rank
            assert want > 0
            assert np.all(ref.recv_topk_idx // 6 == owner)
            assert np.all(np.diff(ref.recv_topk_idx % 6) >= 0)
            want_ids = sorted(int(e) for idx in idxs for e in idx[idx >= 0].ravel()
                              if e // 6 == owner)
            assert sorted(ref.recv_topk_idx.tolist()) == want_ids
            slots = emap.replicas
            assert np.all([slots[e][0] // 6 == r for e in ref.recv_topk_idx])


def test_the_rank_layout_names_local_experts_as_co_located_experts_do() -> None:
    """Rank layout, roles (3, 1): a row's id in slot k is the pick's local expert e % 6 where
    e lives on the receiver ((3, 1)[e // 6]), else -1 (closed form from the inputs)."""
    xs, idxs, ws = testing.inputs("bf16", EXPERTS, 4, 64, [10, 7, 0, 3], 6, "uniform")
    refs = reference.dispatch(xs, idxs, ws, EXPERTS, layout="rank", expert_ranks=(3, 1))
    for r, ref in enumerate(refs):
        for row, (src, tok) in enumerate(zip(ref.recv_src_rank, ref.recv_src_token,
                                             strict=True)):
            picks = idxs[int(src)][int(tok)]
            want = [int(e) % 6 if e >= 0 and (3, 1)[int(e) // 6] == r else -1 for e in picks]
            assert ref.recv_topk_idx[row].tolist() == want, (r, row)
        # one row per token with a pick on r (a sender receives none)
        place = (3, 1).index(r) if r in (3, 1) else -1
        assert ref.recv_x.shape[0] == sum(
            int(np.any((i >= 0) & (i // 6 == place), axis=1).sum()) for i in idxs)


def test_bad_role_sets_are_refused_at_the_config_naming_expert_ranks() -> None:
    for bad in ((), (1, 1), (-1,), ("a",), (True,), "13"):
        with pytest.raises(InvalidArgumentError) as info:
            _config(bad, MODES[0])
        assert info.value.argument == "expert_ranks"
    with pytest.raises(InvalidArgumentError) as info:  # 12 experts over 5 ranks
        BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=12,
                     dtype="bf16", expert_ranks=(0, 1, 2, 3, 4))
    assert info.value.argument == "expert_ranks"
    with pytest.raises(InvalidArgumentError) as info:
        _config((1,), MODES[0], expert_map=ExpertMap.identity(EXPERTS))
    assert info.value.argument == "expert_ranks"
    with pytest.raises(InvalidArgumentError) as info:
        _config((1,), MODES[0], on_peer_loss="mask")
    assert info.value.argument == "expert_ranks"  # and says what to use instead
    assert "on_peer_loss='raise'" in str(info.value)


def _out_of_range(group: Any) -> list[str]:
    seen = []
    try:
        Buffer(group, _config((1, 4), MODES[0]))  # rank 4 of a group of 4
        seen.append("built")
    except InvalidArgumentError as exc:
        seen.append(f"invalid {exc.argument}")
    with Buffer(group, _config((1, 3), MODES[0])) as buf:  # the next Buffer works
        xs, idxs, ws = testing.inputs("bf16", EXPERTS, 4, 256, [5, 0, 7, 0], 3, "uniform")
        seen += testing.check_call(buf, xs, idxs, ws, 3)
    return seen


def test_a_rank_out_of_the_group_is_refused_on_every_rank_naming_expert_ranks() -> None:
    assert launch(_out_of_range, RANKS, timeout_s=120) == [["invalid expert_ranks"]] * RANKS


def test_the_m2n_map_spreads_the_experts_over_the_expert_ranks_in_order() -> None:
    emap = m2n_expert_map(6, (2, 0), 3)  # 3 experts each: 0..2 on rank 2, 3..5 on rank 0
    assert emap.replicas == ((6,), (7,), (8,), (0,), (1,), (2,))
    assert logical_experts(np.array([6, 2, -1, 3]), emap).tolist() == [0, 5, -1, -1]
