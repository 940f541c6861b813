"""M2N: attention ranks dispatch to expert ranks and combine back, against co-located EP, an MPI
Alltoallv peer doing the same exchange, and the memcpy floor; the two-micro-batch pipeline
against back-to-back calls.

    python -m benchmarks.bench_m2n                          # default shape, 4 ranks: 2 -> 2
    python -m benchmarks.bench_m2n --repeats 60 --out benchmarks/results

Four ranks: ranks 0 and 1 send (``T`` tokens each), ranks 2 and 3 hold the ``E`` experts
(``BufferConfig(expert_ranks=(2, 3))``) and pass 0 tokens. Cases, side by side in one process
tree (the ubep cases alternate in rounds inside one ``ubep.launch`` group; the peer runs under
``mpiexec`` from this process, after them):

* ``m2n``: one dispatch plus its combine (the expert ranks answer with their ``recv_x``).
* ``co-located``: a plain Buffer, every rank holding ``E / 4`` experts and sending ``T / 2``
  tokens: the same total bytes over the same four processes.
* ``back-to-back``: two micro-batches, dispatch A, combine A, dispatch B, combine B, blocking.
* ``pipeline``: the same two micro-batches with split-phase calls (``return_recv_hook=True``),
  B's dispatch issued before A's combine, two calls in flight (examples/m2n_pingpong.py's
  order, without its stand-in compute: only the communication overlaps).
* ``mpi alltoallv``: the peers' expert-layout dispatch and combine
  (``benchmarks.peers.kernels``: counts ``Alltoall``, payload and metadata ``Alltoallv``,
  receive reorder) over ``mpi4py`` on the same physical routing (the expert ranks' sends are
  empty, nothing is sent to the attention ranks); its results are checked against
  ``ubep.reference`` before timing.

One sample runs from a barrier to the slowest rank's end; rows give min / median / max.

Byte formula (BF16, expert layout): a sender's dispatch moves ``T * K * H * 2`` B; the total
``M * T * K * H * 2`` B is the same in the co-located case (``4 * T/2``). The combine moves the
same rows back. The memcpy floor is one copy of ``T * K * H * 2`` B by each of the ``M``
senders at once (``harness.concurrent_copy``): a lower bound of the dispatch alone.

Four ranks on a 2-core host are oversubscribed: every rank's waits yield, the background core
of split-phase calls is off (the caller sends at the call and receives in the hook), and the
pipeline can only overlap the waits of one call with the work of another. Only ratios within
one run mean anything on a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    Stats,
    collective_spans,
    concurrent_copy,
    dispatch_combine,
    save_results,
)
from ubep import testing
from ubep.buffer import Buffer, BufferConfig
from ubep.expert_map import replica_table, route_topk
from ubep.m2n import m2n_expert_map
from ubep.runtime import launch

__all__ = ["Shape", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
RANKS = 4
EXPERT_RANKS = (2, 3)
CASES = ("m2n", "co-located", "back-to-back", "pipeline")


@dataclass(frozen=True)
class Shape:
    tokens: int = 128  # per sender
    hidden: int = 2048
    num_topk: int = 8
    num_experts: int = 16

    @property
    def senders(self) -> tuple[int, ...]:
        return tuple(r for r in range(RANKS) if r not in EXPERT_RANKS)

    def config(self, m2n: bool, tokens: int) -> BufferConfig:
        return BufferConfig(max_tokens_per_rank=tokens, hidden=self.hidden,
                            num_topk=self.num_topk, num_experts=self.num_experts, dtype="bf16",
                            expert_ranks=EXPERT_RANKS if m2n else None, timeout_s=60.0)

    def inputs(self, m2n: bool, seed: int) -> Any:
        """Every rank's inputs (logical routing): M2N senders ``T`` tokens, expert ranks 0;
        co-located: ``T * M / RANKS`` tokens on every rank."""
        co = self.tokens * len(self.senders) // RANKS
        tokens = [self.tokens if r in self.senders else 0 for r in range(RANKS)] if m2n else (
            [co] * RANKS)
        return testing.inputs("bf16", self.num_experts, self.num_topk, self.hidden, tokens,
                              seed, "uniform")

    @property
    def dispatch_bytes(self) -> int:
        """Bytes one sender's dispatch moves: T * K * H * 2."""
        return self.tokens * self.num_topk * self.hidden * 2


def _pipeline(buf: Any, a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    pa = buf.dispatch(*a, return_recv_hook=True)
    ra = pa.hook()
    pb = buf.dispatch(*b, return_recv_hook=True)
    ca = buf.combine(ra.recv_x, ra.handle, return_recv_hook=True)
    rb = pb.hook()
    cb = buf.combine(rb.recv_x, rb.handle, return_recv_hook=True)
    ca.hook()
    cb.hook()


def _serve(group: Any, shape: Shape, repeats: int, rounds: int) -> dict[str, list[int]]:
    r = group.rank
    a, b = shape.inputs(True, 0), shape.inputs(True, 1)
    co = shape.inputs(False, 0)
    mine = {name: tuple(t[r] for t in ins) for name, ins in (("a", a), ("b", b), ("co", co))}
    spans: dict[str, list[int]] = {name: [] for name in CASES}
    with Buffer(group, shape.config(True, shape.tokens)) as m2n, \
            Buffer(group, shape.config(False, shape.tokens * len(shape.senders) // RANKS)) as col:
        for case, ins in (("m2n", a), ("co-located", co)):  # correct before timed
            buf = m2n if case == "m2n" else col
            errors = testing.check_call(buf, *ins, 7)
            if errors:
                raise AssertionError(f"rank {r}, {case}: {errors}")
        work = {
            "m2n": lambda: dispatch_combine(m2n, *mine["a"]),
            "co-located": lambda: dispatch_combine(col, *mine["co"]),
            "back-to-back": lambda: (dispatch_combine(m2n, *mine["a"]),
                                     dispatch_combine(m2n, *mine["b"])),
            "pipeline": lambda: _pipeline(m2n, mine["a"], mine["b"]),
        }
        for _ in range(rounds):
            for name in CASES:
                got = collective_spans(group.barrier, work[name], 3, max(1, repeats // rounds))
                spans[name] += got.ravel().tolist()
    return spans


def _slowest(per_rank: list[dict[str, list[int]]], name: str) -> Stats:
    spans = np.array([p[name] for p in per_rank], dtype=np.int64).reshape(len(per_rank), -1, 2)
    return Stats.from_samples_us(((spans[..., 1].max(0) - spans[..., 0].min(0)) / 1e3).tolist())


# --- the MPI Alltoallv peer (mpiexec worker: python -m benchmarks.bench_m2n --mpi-peer ...) ---


def _physical(shape: Shape, inputs: Any) -> list[np.ndarray]:
    """The M2N physical routing of every rank (one replica per expert: the hop row is moot)."""
    emap = m2n_expert_map(shape.num_experts, EXPERT_RANKS, RANKS)
    per_rank = shape.num_experts // len(EXPERT_RANKS)
    table = replica_table(emap, np.zeros(RANKS, np.int64), (), per_rank)
    return [route_topk(idx, table) for idx in inputs[1]]


def _mpi_peer(shape: Shape, repeats: int, out: str) -> None:
    from mpi4py import MPI

    from benchmarks.peers.kernels import make_peer
    from benchmarks.peers.mpi_worker import MpiExchange
    from ubep import reference

    comm = MPI.COMM_WORLD
    ex = MpiExchange(comm)
    r = ex.rank
    xs, idxs, ws = shape.inputs(True, 0)
    phys = _physical(shape, (xs, idxs, ws))
    slots = shape.num_experts // len(EXPERT_RANKS) * RANKS
    peer = make_peer("expert", ex, num_experts=slots, num_topk=shape.num_topk,
                     max_tokens=shape.tokens, hidden=shape.hidden, x_dtype=np.dtype(np.uint16),
                     out_dtype=np.dtype(np.uint16))
    # correct before timed: the peer's receive and combine against the oracle with the roles
    got = peer.dispatch(xs[r], phys[r], ws[r])
    refs = reference.dispatch(xs, idxs, ws, shape.num_experts, expert_ranks=EXPERT_RANKS)
    y = peer.combine(np.ascontiguousarray(got.recv_x))
    y_ref = reference.combine([ref.recv_x for ref in refs], refs)[r]
    ok = bool(np.array_equal(got.recv_x, refs[r].recv_x) and np.array_equal(y, y_ref))

    def pair() -> None:
        res = peer.dispatch(xs[r], phys[r], ws[r])
        peer.combine(np.ascontiguousarray(res.recv_x))

    spans = collective_spans(ex.barrier, pair, 3, repeats)
    every = comm.gather({"ok": ok, "spans": spans.ravel().tolist(),
                         "library": MPI.Get_library_version().strip().split(",")[0]}, root=0)
    ex.free()
    if r == 0:
        Path(out).write_text(json.dumps(every))


def _run_mpi_peer(shape: Shape, repeats: int) -> tuple[Stats, str] | str:
    """The peer's stats and MPI library, or why it did not run."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    exe = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if exe is None:
        return "no mpiexec"
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1"}
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "peer.json")
        cmd = [exe, "--oversubscribe", "--mca", "osc", "^ucx", "-n", str(RANKS), sys.executable,
               "-m", "benchmarks.bench_m2n", "--mpi-peer", json.dumps(asdict(shape)),
               str(repeats), str(out)]
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=600, check=False)
        if proc.returncode != 0 or not out.exists():
            return f"mpiexec exited {proc.returncode}: {proc.stderr[-400:]}"
        every = json.loads(out.read_text())
    if not all(e["ok"] for e in every):
        raise AssertionError("the MPI peer's M2N results differ from ubep.reference")
    spans = np.array([e["spans"] for e in every], dtype=np.int64).reshape(RANKS, -1, 2)
    us = (spans[..., 1].max(0) - spans[..., 0].min(0)) / 1e3
    return Stats.from_samples_us(us.tolist()), every[0]["library"]


def _fmt(s: Stats) -> str:
    return f"{s.min_us:10.1f} {s.median_us:10.1f} {s.max_us:10.1f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--out", default=None, help="write m2n.{txt,json} here")
    ap.add_argument("--mpi-peer", nargs=3, metavar="ARG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mpi_peer:
        shape_json, repeats, out = args.mpi_peer
        _mpi_peer(Shape(**json.loads(shape_json)), int(repeats), out)
        return
    shape = Shape()
    load_before, start = os.getloadavg()[0], time.monotonic()
    M = len(shape.senders)
    per_rank = launch(_serve, RANKS, shape, args.repeats, 4, timeout_s=1200)
    stats = {name: _slowest(per_rank, name) for name in CASES}
    floor = concurrent_copy(M, [shape.dispatch_bytes], repeats=args.repeats)[0]
    peer = _run_mpi_peer(shape, args.repeats)
    m2n = stats["m2n"]
    lines = [
        f"shape: {shape}; {RANKS} ranks: senders {shape.senders} -> expert ranks "
        f"{EXPERT_RANKS} ({shape.num_experts // len(EXPERT_RANKS)} experts each), bf16, "
        "expert layout, asp + sw",
        f"byte formula: a sender's dispatch = T * K * H * 2 = {shape.dispatch_bytes} B, total "
        f"M * T * K * H * 2 = {M * shape.dispatch_bytes} B (co-located: {RANKS} ranks x "
        f"{shape.tokens * M // RANKS} tokens, the same total); combine moves the same rows back",
        "floor: one copy of T * K * H * 2 B by each sender at once (a bound of the dispatch "
        "alone)",
        f"host: {os.cpu_count()} cores for {RANKS} ranks: oversubscribed (waits yield; no "
        "background core for split-phase calls)",
        "",
        f"{'us':28s} {'min':>10s} {'median':>10s} {'max':>10s}  to m2n  to floor",
    ]
    rows: list[tuple[str, Stats]] = [
        ("m2n dispatch + combine", m2n),
        ("co-located dispatch+combine", stats["co-located"]),
    ]
    result: dict[str, Any] = {"shape": asdict(shape), "ranks": RANKS,
                              "expert_ranks": list(EXPERT_RANKS),
                              "dispatch_bytes_per_sender": shape.dispatch_bytes}
    if isinstance(peer, str):
        lines.append(f"(MPI peer not run: {peer})")
        result["mpi_peer"] = peer
    else:
        rows.append(("mpi alltoallv (same m2n)", peer[0]))
        result["mpi_library"] = peer[1]
    rows += [("2 micro-batches back-to-back", stats["back-to-back"]),
             ("2 micro-batches pipelined", stats["pipeline"]), ("memcpy floor", floor)]
    for name, s in rows:
        lines.append(f"{name:28s} {_fmt(s)}  {s.median_us / m2n.median_us:6.2f}"
                     f"  {s.median_us / floor.median_us:8.2f}")
    pipe = stats["pipeline"].median_us / stats["back-to-back"].median_us
    lines += ["", f"pipelined / back-to-back (medians): {pipe:.2f}"]
    if not isinstance(peer, str):
        lines.append(f"m2n / mpi alltoallv (medians): {m2n.median_us / peer[0].median_us:.2f} "
                     f"({peer[1]})")
    result["stats"] = {name: asdict(s) for name, s in rows}
    result["machine"] = {"cpus": os.cpu_count(), "load_before": load_before,
                         "load_after": os.getloadavg()[0], "seconds": time.monotonic() - start}
    lines.append(f"load average before / after: {load_before:.1f} / "
                 f"{result['machine']['load_after']:.1f}")
    save_results(args.out, "m2n", "\n".join(lines), result)


if __name__ == "__main__":
    main()
