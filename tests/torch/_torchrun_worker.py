"""The per-rank program of tests/torch/test_torchrun.py, started by a real ``torchrun``.

    torchrun --standalone --nproc-per-node N -m tests.torch._torchrun_worker \
        SCENARIO[,...] OUT_DIR [ARGS]

(from the repository root, so ``tests`` and ``examples`` import as packages).

Each rank initialises torch.distributed (gloo, torchrun's env:// rendezvous), runs the scenarios
in order and
saves what it computed under OUT_DIR; the test compares those files with single-process oracles
(``ubep.reference``, the eager Hugging Face model). The inputs come from seeded generators that
the test calls too (:func:`case_inputs`).

Scenarios:
  example    examples/torchrun_dispatch.py's run() (it compares with ubep.reference itself).
  control    the adapter's exchange / allgather / barrier / check_peers.
  dispatch   ubep.Buffer(dist.group.WORLD, cfg) for each case of CASES.
  subgroups  (world of 4) EP groups {0, 2} and {1, 3} (group rank != world rank), both
             dispatching at once.
  trace      (world of 4) one line added to a DeepEP-style step: ``with ubep.trace.record``
             around the V1 facade's dispatch and combine on the world group and a Buffer on
             each EP subgroup; the facade's combine saved for the test's closed form.
  hf         a tiny Qwen3-MoE with experts_implementation="ubep" on dist.group.WORLD; rank 0 hits
             EOS first (ARGS: the EOS token id); generate with synced_gpus=True and with
             ubep.torch.hf.generate.
  other_host rank 1 claims another boot id: every rank must get ubep's error naming ubep.mpi.
  kill       (last) map_global's segments exist (not yet unlinked) when every rank SIGKILLs
             itself; the group's cleaner must remove them and its directory.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ubep
import ubep.trace
from ubep import testing

# (layout, torch dtype, sync): a BF16 expert-layout case and an FP8 rank-layout case (FP8 moves
# as opaque bytes; combine takes BF16 expert outputs).
CASES: list[tuple[str, torch.dtype, str]] = [
    ("expert", torch.bfloat16, "sp"),
    ("rank", torch.float8_e4m3fn, "tff"),
]
HIDDEN, TOP_K, EXPERTS_PER_RANK, MAX_TOKENS = 256, 4, 4, 24
HF_EXPERTS, HF_TOP_K, HF_NEW_TOKENS = 8, 3, 6


def case_inputs(
    case: int, num_ranks: int, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Every rank's x (storage dtype), topk_idx and topk_weights for ``CASES[case]``."""
    _, dtype, _ = CASES[case]
    tokens = [MAX_TOKENS - 3 * r for r in range(num_ranks)]  # unequal, as real batches are
    name = ubep.dtypes.dtype_of(dtype).name
    return testing.inputs(name, EXPERTS_PER_RANK * num_ranks, TOP_K, HIDDEN, tokens, seed,
                           "uniform")


def expert_outputs(case: int, recv_x: np.ndarray, seed: int) -> np.ndarray:
    """What the 'experts' return (the test recomputes it from the reference's recv_x)."""
    name = ubep.dtypes.dtype_of(CASES[case][1]).name
    return testing.expert_outputs(name, recv_x, seed)


def hf_prompt(rank: int) -> torch.Tensor:
    from tests.torch._hf_configs import VOCAB

    return torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(rank))


def hf_model(impl: str) -> Any:
    import transformers

    from tests.torch._hf_configs import tiny_qwen3_moe

    torch.manual_seed(0)
    cfg = tiny_qwen3_moe(HF_EXPERTS, HF_TOP_K, norm_topk_prob=True)
    return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=impl).eval()


def hf_generate_kwargs(prompt: torch.Tensor, eos: int | None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "attention_mask": torch.ones_like(prompt), "max_new_tokens": HF_NEW_TOKENS,
        "do_sample": False, "pad_token_id": 0,
    }
    if eos is None:
        kw["min_new_tokens"] = HF_NEW_TOKENS
    else:
        kw["eos_token_id"] = eos
    return kw


# --------------------------------------------------------------------------- scenarios
def run_dispatch(group: Any, seed: int, out: str, tag: str) -> None:
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    saved: dict[str, np.ndarray] = {}
    for case, (layout, dtype, sync) in enumerate(CASES):
        xs, idxs, ws = case_inputs(case, num_ranks, seed)
        cfg = ubep.BufferConfig(
            max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOP_K,
            num_experts=EXPERTS_PER_RANK * num_ranks, dtype=dtype, layout=layout, sync=sync,
        )
        with ubep.Buffer(group, cfg) as buf:
            assert buf.rank == rank and buf.num_ranks == num_ranks, (buf.rank, rank)
            res = buf.dispatch(xs[rank], idxs[rank], ws[rank], copy=True)
            y = buf.combine(expert_outputs(case, res.recv_x, seed * 100 + rank), res.handle)
        for f in testing.FIELDS:
            saved[f"{case}.{f}"] = np.asarray(getattr(res, f))
        saved[f"{case}.y"] = y
    np.savez(os.path.join(out, f"{tag}.{rank}.npz"), **saved)


def run_subgroups(out: str) -> None:
    world_rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    mine = world_rank % 2
    dist.barrier()  # both EP groups start their Buffers and dispatches together
    run_dispatch(groups[mine], seed=10 + mine, out=out, tag=f"sub{mine}")


TRACE_TOKENS = 16


def trace_inputs(rank: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s BF16 rows of small integers (any sum of a few is exact in BF16) and its
    top-k experts (distinct per row) for the trace scenario."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(-4, 5, (TRACE_TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    experts = EXPERTS_PER_RANK * num_ranks
    topk_idx = torch.stack([torch.randperm(experts, generator=g)[:TOP_K]
                            for _ in range(TRACE_TOKENS)])
    return x, topk_idx


def run_trace(out: str) -> None:
    from ubep import deep_ep

    world_rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    x, topk_idx = trace_inputs(world_rank, world)
    experts = EXPERTS_PER_RANK * world
    weights = torch.ones(TRACE_TOKENS, TOP_K)
    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 26)
    with ubep.trace.record(os.path.join(out, "step.json")):  # the line a user adds
        ntr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
            topk_idx=topk_idx, topk_weights=weights)
        y, _, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)  # identity experts
        mine = world_rank % 2
        run_dispatch(groups[mine], seed=20 + mine, out=out, tag=f"tsub{mine}")
    torch.save({"y": y}, os.path.join(out, f"trace.{world_rank}.pt"))


def run_example(out: str) -> None:
    """examples/torchrun_dispatch.py's check, on this job's world group."""
    from examples import torchrun_dispatch

    ok = torchrun_dispatch.run(dist.group.WORLD)
    with open(os.path.join(out, f"example.{dist.get_rank()}.json"), "w") as f:
        json.dump({"equal_to_reference": ok}, f)


def run_control(out: str) -> None:
    """The adapter's control plane: cached per torch group, exchange/allgather in group-rank
    order, a key mismatch named on every rank, barrier, check_peers."""
    import ubep.torch.group as tg

    rank = dist.get_rank()
    group = tg.from_torch(dist.group.WORLD, timeout_s=30)
    record: dict[str, Any] = {"cached": tg.from_torch(dist.group.WORLD) is group}
    record["exchange"] = group.exchange("step", {"rank": rank, "pid": os.getpid()})
    record["allgather"] = group.allgather([rank] * (rank + 1))  # unequal sizes
    # a JSON string that just fits the all-gather's slot (after its 8-byte length) on rank 0,
    # one byte more on rank 1: the second round
    record["allgather_long"] = group.allgather("x" * (tg._SLOT_BYTES - 10 + rank))
    try:
        group.exchange("a" if rank == 0 else "b", rank)
        record["mismatch"] = ""
    except ubep.UbepError as exc:
        record["mismatch"] = str(exc)
    group.barrier()
    group.check_peers()
    record["peers"] = [p.pid for p in group.peers]
    with open(os.path.join(out, f"control.{rank}.json"), "w") as f:
        json.dump(record, f)


def run_hf(out: str, eos: int) -> None:
    import ubep.torch.hf as hf

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    hf.register(dist.group.WORLD, layout="expert")
    model = hf_model("ubep")
    hf.shard_experts(model, rank, num_ranks)  # keep only this rank's experts
    prompt = hf_prompt(rank)
    with torch.no_grad():
        synced = model.generate(prompt, synced_gpus=True, **hf_generate_kwargs(prompt, eos))
        ours = hf.generate(model, prompt, **hf_generate_kwargs(prompt, eos))
    torch.save({"synced_gpus": synced, "hf_generate": ours}, os.path.join(out, f"hf.{rank}.pt"))


def run_other_host(out: str) -> None:
    import ubep.torch.group as tg

    rank = dist.get_rank()
    real = tg.host_identity
    if rank == 1:  # pretend to be another machine
        tg.host_identity = lambda: real() | {"boot_id": "another-machine"}
    try:
        tg.TorchGroup(dist.group.WORLD, timeout_s=30)
        message = ""
    except ubep.UbepError as exc:
        message = str(exc)
    finally:
        tg.host_identity = real
    with open(os.path.join(out, f"other_host.{rank}.json"), "w") as f:
        json.dump({"message": message}, f)


def run_kill(out: str) -> None:
    import ubep.torch.group as tg

    rank = dist.get_rank()
    group = tg.from_torch(dist.group.WORLD, timeout_s=30)
    mem = group.map_global(1 << 16, "buffer")  # every segment named until unlink()
    names = [s.name for s in mem.segments]  # type: ignore[attr-defined]
    assert all(os.path.exists(os.path.join("/dev/shm", n)) for n in names)
    with open(os.path.join(out, f"kill.{rank}.json"), "w") as f:
        json.dump({"segments": names, "dir": group.rendezvous, "pids": [p.pid for p in
                                                                          group.peers]}, f)
    group.barrier()  # both ranks have written their record
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    scenarios, out, extra = argv[1].split(","), argv[2], argv[3:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for scenario in scenarios:
        if scenario == "dispatch":
            run_dispatch(dist.group.WORLD, seed=1, out=out, tag="world")
        elif scenario == "subgroups":
            run_subgroups(out)
        elif scenario == "trace":
            run_trace(out)
        elif scenario == "example":
            run_example(out)
        elif scenario == "control":
            run_control(out)
        elif scenario == "hf":
            run_hf(out, int(extra[0]))
        elif scenario == "other_host":
            run_other_host(out)
        elif scenario == "kill":  # last: it ends the job
            run_kill(out)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
