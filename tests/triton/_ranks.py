"""Rank bodies of the Triton engine's tests (module-level: ``ubep.launch`` pickles them).

Every rank regenerates every rank's inputs from the seed, computes ``ubep.reference`` itself
and returns the mismatches of its own results, bit for bit (``ubep.testing``).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ubep import reference, testing
from ubep.errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RemoteError,
    TimeoutError,
)
from ubep.flags import DcCodec
from ubep.triton import TritonConfig, open_engine

NUM_TOPK = 3


@dataclass(frozen=True)
class Case:
    sync: str
    layout: str
    dtype: str
    hidden: int = 64

    def config(self, num_ranks: int, max_tokens: int, **extra: Any) -> TritonConfig:
        return TritonConfig(max_tokens_per_rank=max_tokens, hidden=self.hidden,
                            num_topk=NUM_TOPK, num_experts=4 * num_ranks, dtype=self.dtype,
                            layout=self.layout, sync=self.sync, num_send_programs=2,
                            **({"timeout_s": 60.0} | extra))


def storage(t: Any, dtype: str) -> np.ndarray:
    """A result tensor as ``ubep.dtypes`` storage (BF16 as its uint16 bits)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


def check_call(eng: Any, case: Case, tokens: list[int], seed: int, kind: str) -> list[str]:
    """One dispatch and one combine against the reference; the mismatches."""
    r = eng.rank
    E = eng.config.num_experts
    xs, idxs, ws = testing.inputs(case.dtype, E, NUM_TOPK, case.hidden, tokens, seed, kind)
    res = eng.dispatch(xs[r], idxs[r], ws[r])
    refs = reference.dispatch(xs, idxs, ws, E, layout=case.layout)
    errors = []
    for f in testing.FIELDS:
        got = getattr(res, f)
        got = storage(got, case.dtype) if f == "recv_x" else got.cpu().numpy()
        want = getattr(refs[r], f)
        if not testing.same_bits(got, want):
            errors.append(f"{case} seed {seed}: {f} {got.dtype}{got.shape} differs from the "
                          f"reference {want.dtype}{want.shape}")
    if not testing.same_bits(res.handle.send_dst_row, refs[r].handle.send_dst_row):
        errors.append(f"{case} seed {seed}: handle.send_dst_row differs from the reference")
    if eng.sync.name == "dc":
        errors += _dc_records(eng, res, refs[r])
    outs = [testing.expert_outputs(case.dtype, ref.recv_x, seed * 10 + q)
            for q, ref in enumerate(refs)]
    y = eng.combine(outs[r], res.handle)
    y_ref = reference.combine(outs, refs)[r]
    if not testing.same_bits(storage(y, eng.config.out_dtype), y_ref):
        errors.append(f"{case} seed {seed}: combine differs from the reference")
    return errors


def _dc_records(eng: Any, res: Any, ref: Any) -> list[str]:
    """Each source's published ``[count, checksum, epoch]`` is ``ubep.flags.DcCodec``'s over
    the rows it sent here, in receive order (the codec is the oracle of the format)."""
    rows = np.ascontiguousarray(ref.recv_x).view(np.uint8).reshape(len(ref.recv_x), -1)
    flags = eng.v_dflag.cpu().numpy().view(np.uint64).reshape(-1, 4)
    bad = []
    for s in range(eng.num_ranks):
        want = DcCodec().control(rows[ref.recv_src_rank == s], eng.epoch)
        if not np.array_equal(flags[s, :3], want):
            bad.append(f"DC record of source {s}: {flags[s, :3]} != codec's {want}")
    return bad


def run_cases(group: Any, cases: list[Case], seed: int, order: str | None = None,
              num_steps: int = 3) -> list[str]:
    """Each case on a fresh engine: ``num_steps`` calls (of three: the second with a rank of
    zero tokens and hot routing, the third reusing the first's routing-record parity)."""
    R = group.num_ranks
    errors: list[str] = []
    for i, case in enumerate(cases):
        with open_engine(group, case.config(R, 9)) as eng:
            if order is not None:  # "reverse", "shuffle", or "mixed": the two in turn
                how = order if order != "mixed" else ("reverse", "shuffle")[i % 2]
                eng.program_order = _orders(how, seed * 100 + i)
            steps = [([5, 7, 3, 9][:R], "uniform"), ([0, 9, 4, 2][:R], "hot"),
                     ([6, 2, 9, 1][:R], "uniform")][:num_steps]
            for j, (tokens, kind) in enumerate(steps):
                errors += check_call(eng, case, tokens, seed * 1000 + i * 10 + j, kind)
    return errors


def _orders(how: str, seed: int) -> Any:
    rng = random.Random(seed)

    def perm(name: str, grid: int) -> list[int]:
        p = list(range(grid))
        if how == "reverse":
            p.reverse()
        else:
            rng.shuffle(p)
        return p

    return perm


def refused(call: Callable[[], object], rank: int, culprit: int, argument: str, what: str,
            says: str | None = None) -> list[str]:
    """Run a call that bad input on rank ``culprit`` must refuse on every rank: there
    ``InvalidArgumentError`` naming ``argument``, on the other rank a clean ``RemoteError`` from
    ``culprit`` whose message says ``says`` (default: the argument). Returns the failures."""
    try:
        call()
    except InvalidArgumentError as e:
        return [] if (rank == culprit and e.argument == argument) else [f"rank {rank}: {e!r}"]
    except RemoteError as e:
        ok = rank != culprit and e.clean and e.rank == culprit and (says or argument) in e.message
        return [] if ok else [f"rank {rank}: {e!r}"]
    return [f"rank {rank}: {what} passed"]


def bad_inputs(group: Any, cases: list[Case]) -> list[str]:
    """:func:`bad_input` for each case."""
    return [e for case in cases for e in bad_input(group, case)]


def bad_input(group: Any, case: Case) -> list[str]:
    """Rank 1 gives bad input in dispatch, then rank 0 in combine: the offender raises an
    ``InvalidArgumentError`` naming the argument, every peer a clean ``RemoteError`` carrying
    it, nothing reached a peer, and the next call is bit-exact."""
    r = group.rank
    out: list[str] = []
    with open_engine(group, case.config(group.num_ranks, 9, timeout_s=120.0)) as eng:
        out += check_call(eng, case, [4, 5], 1, "uniform")
        xs, idxs, ws = testing.inputs(case.dtype, eng.config.num_experts, NUM_TOPK, case.hidden,
                                      [4, 5], 2, "uniform")
        if r == 1:
            idxs[1][0, 0] = eng.config.num_experts  # out of range
        before = eng.v_counts.cpu().numpy().copy()
        out += refused(lambda: eng.dispatch(xs[r], idxs[r], ws[r]), r, 1, "topk_idx",
                       "a dispatch with bad topk_idx on rank 1")
        # the offender released no count word here (its words, of both dispatch parities,
        # still carry the earlier calls')
        group.barrier()
        shape = (2, group.num_ranks, eng.lay.num_buckets)
        if r == 0 and not np.array_equal(eng.v_counts.cpu().numpy().reshape(shape)[:, 1],
                                         before.reshape(shape)[:, 1]):
            out.append("rank 1's counts reached rank 0 in the refused call")
        out += check_call(eng, case, [3, 6], 3, "uniform")
        if eng.sync.armed:  # SP: a payload holding the sentinel is bad input (on rank 0)
            xs, idxs, ws = testing.inputs(case.dtype, eng.config.num_experts, NUM_TOPK,
                                          case.hidden, [3, 6], 6, "uniform")
            xs[0].view(eng.dt.bits_dtype)[1, 5] = eng.dt.sentinel
            out += refused(lambda: eng.dispatch(xs[r], idxs[r], ws[r]), r, 0, "x",
                           "a dispatch of the sentinel", says="sentinel")
        xs, idxs, ws = testing.inputs(case.dtype, eng.config.num_experts, NUM_TOPK, case.hidden,
                                      [3, 6], 4, "uniform")
        res = eng.dispatch(xs[r], idxs[r], ws[r])
        eo = np.zeros((res.recv_x.shape[0] + (1 if r == 0 else 0), case.hidden),
                      dtype=testing.expert_outputs(case.dtype, xs[r][:0], 0).dtype)
        out += refused(lambda: eng.combine(eo, res.handle), r, 0, "expert_out",
                       "a combine with a bad expert_out on rank 0")
        out += check_call(eng, case, [5, 2], 5, "hot")
    return out


def lost_peer(group: Any, case: Case) -> str:
    """Rank 1 dies before a dispatch: rank 0 raises ``PeerLostError`` (it does not wait out
    the deadline), then ``OutOfStepError`` until a resync."""
    with open_engine(group, case.config(group.num_ranks, 8, timeout_s=120.0)) as eng:
        xs, idxs, ws = testing.inputs(case.dtype, eng.config.num_experts, NUM_TOPK, case.hidden,
                                      [4, 4], 1, "uniform")
        if group.rank == 1:
            os._exit(3)
        try:
            eng.dispatch(xs[0], idxs[0], ws[0])
            return "dispatch passed without its peer"
        except PeerLostError as e:
            first = repr(e)
        try:
            eng.dispatch(xs[0], idxs[0], ws[0])
            return "a call after the loss passed"
        except OutOfStepError:
            return "ok: " + first


def resync(group: Any, case: Case) -> list[str]:
    """Rank 1 skips a dispatch: rank 0 times out; both resync and the next calls are
    bit-exact; a handle from before the resync is refused."""
    r = group.rank
    out: list[str] = []
    with open_engine(group, case.config(group.num_ranks, 8, timeout_s=120.0)) as eng:
        xs, idxs, ws = testing.inputs(case.dtype, eng.config.num_experts, NUM_TOPK, case.hidden,
                                      [4, 6], 1, "uniform")
        old = eng.dispatch(xs[r], idxs[r], ws[r])
        if r == 0:
            # a short deadline for the one call meant to time out, the usual for the others
            # (a loaded machine must not turn an ordinary wait into a timeout)
            usual = eng.config
            eng.config = dataclasses.replace(usual, timeout_s=2.0)
            try:
                eng.dispatch(xs[r], idxs[r], ws[r])
                out.append("a dispatch without its peer passed")
            except TimeoutError as e:
                out += [] if "still waiting after 2.0 s" in str(e) else [repr(e)]
            eng.config = usual
            try:
                eng.dispatch(xs[r], idxs[r], ws[r])
                out.append("a call after the timeout passed")
            except OutOfStepError:
                pass
        eng.resync()
        out += check_call(eng, case, [4, 6], 2, "uniform")
        try:
            eng.combine(storage(old.recv_x, case.dtype), old.handle)
            out.append(f"rank {r}: a handle from before the resync was taken")
        except (InvalidArgumentError, RemoteError):
            pass
        out += check_call(eng, case, [7, 1], 3, "hot")
    return out


def launch_log(group: Any, cases: list[Case]) -> list[tuple[str, list[str], dict[str, Any]]]:
    """Every launch (kernel, argument types, constexprs) of a dispatch and a combine per case."""
    log: list[tuple[str, list[str], dict[str, Any]]] = []
    for case in cases:
        with open_engine(group, case.config(group.num_ranks, 4)) as eng:
            eng.launch_log = log
            errors = check_call(eng, case, [4] * group.num_ranks, 1, "uniform")
            assert not errors, errors
    return log


def over_callers_memory(group: Any, case: Case) -> list[str]:
    """The engine on memory its caller mapped and owns (as a Buffer would give a registry
    row's engine), with the caller's uid and no collective of its own; then the local half of
    a resync on every rank, and calls exact after it."""
    from types import SimpleNamespace

    from ubep.triton.engine import TritonEngine
    from ubep.triton.layout import arena_bytes
    from ubep.triton.memory import ShmArena

    cfg = case.config(group.num_ranks, 8)
    mem = group.map_global(arena_bytes(cfg, group.num_ranks), "caller")
    group.barrier()
    mem.unlink()
    view = SimpleNamespace(rank=group.rank, num_ranks=group.num_ranks, topology=group.topology)
    out: list[str] = []
    try:
        eng = TritonEngine(view, cfg, arena=ShmArena.over(mem), uid=7)
        group.barrier()  # the caller's agreement: every region armed
        out += check_call(eng, case, [5, 3], 1, "uniform")
        group.barrier()  # no rank inside a call
        eng.restart(eng.epoch + 2)
        group.barrier()
        out += check_call(eng, case, [2, 8], 2, "hot")
        eng.close()
        out += [] if len(mem.local_array) else ["the engine closed its caller's memory"]
    finally:
        mem.close()
    return out


def back_to_back(group: Any, case: Case) -> list[str]:
    """Two dispatches with no call between them, then their combines: rank 1 reads its counts
    a second late, so rank 0, done with the first dispatch, has released the second's counts
    by then (they must not land where rank 1 still reads the first's)."""
    import time

    r = group.rank
    with open_engine(group, case.config(group.num_ranks, 8, timeout_s=120.0)) as eng:
        if r == 1:
            result = eng._result

            def late(*args: Any) -> Any:
                time.sleep(1.0)
                return result(*args)

            eng._result = late  # type: ignore[method-assign]
        E = eng.config.num_experts
        calls = [testing.inputs(case.dtype, E, NUM_TOPK, case.hidden, tokens, seed, "uniform")
                 for tokens, seed in (([6, 2], 1), ([3, 8], 2))]
        got = [eng.dispatch(xs[r], idxs[r], ws[r]) for xs, idxs, ws in calls]
        out: list[str] = []
        for (xs, idxs, ws), res, seed in zip(calls, got, (1, 2), strict=True):
            refs = reference.dispatch(xs, idxs, ws, E, layout=case.layout)
            out += [f"dispatch {seed}: {e}" for e in testing.compare(res, refs[r])]
            outs = [testing.expert_outputs(case.dtype, ref.recv_x, seed * 10 + q)
                    for q, ref in enumerate(refs)]
            y = eng.combine(outs[r], res.handle)
            if not testing.same_bits(y, reference.combine(outs, refs)[r]):
                out.append(f"combine {seed} differs from the reference")
    return out
