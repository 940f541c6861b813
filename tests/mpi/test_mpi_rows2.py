"""Combine's rows to other hosts as two-sided messages (ubep.mpi.rows2), on the in-process
RMA transport (tests/mpi/_fake_rma.py, MPI's matching rules, eager and rendezvous sends):
bit-exact against ubep.reference in every layout, every row to another host travels in a
message and none by a put (bytes counted at the transport against a brute-force count from the
routing), and a message of an abandoned call that arrives after the ranks resynced and moved on
is never taken by a later call, nor left behind."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

R, P, T, K, L = 4, 2, 16, 4, 4  # 4 ranks, 2 a host, 4 experts a rank


def _cfg(layout: str = "expert", hidden: int = 32, timeout_s: float = 5.0,
         engine: str = "asp", sync: str = "dc") -> Any:
    from ubep.buffer import BufferConfig

    return BufferConfig(max_tokens_per_rank=T, hidden=hidden, num_topk=K, num_experts=L * R,
                        dtype="bf16", layout=layout, engine=engine, sync=sync,
                        timeout_s=timeout_s)


def _inputs(seed: int, hidden: int = 32,
            ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, 2**16, (T, hidden), dtype=np.uint16) & 0xBFFF for _ in range(R)]
    idxs = []
    for _ in range(R):
        idx = np.stack([rng.permutation(L * R)[:K] for _ in range(T)]).astype(np.int64)
        idx[rng.random((T, K)) < 0.15] = -1  # some masked picks
        idxs.append(idx)
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(R)]
    return xs, idxs, ws


def _references(seed: int, layout: str, hidden: int = 32) -> tuple[Any, ...]:
    """Inputs, reference dispatch, expert outputs (each seed its own values) and combine."""
    from ubep import reference

    xs, idxs, ws = _inputs(seed, hidden)
    refs = reference.dispatch(xs, idxs, ws, L * R, layout=layout,
                              max_tokens=T if layout == "expert_padded" else None)
    outs = [(ref.recv_x ^ np.uint16(seed)) & np.uint16(0xBFFF) for ref in refs]
    return xs, idxs, ws, refs, outs, reference.combine(outs, refs)


def _exact(buf: Any, r: int, seed: int, layout: str = "expert", hidden: int = 32) -> bool:
    xs, idxs, ws, _refs, outs, ys = _references(seed, layout, hidden)
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    return bool(np.array_equal(buf.combine(outs[r], res.handle), ys[r]))


def _remote_picks(idx: np.ndarray, r: int, layout: str) -> int:
    """Brute force: the rows rank ``r``'s tokens get back from other hosts: one per pick
    there (expert layouts), one per (token, rank there) (rank layout)."""
    if layout == "rank":
        pairs = {(t, int(e) // L) for t in range(T) for e in idx[t] if e >= 0}
        return sum(1 for _, q in pairs if q // P != r // P)
    return sum(1 for t in range(T) for e in idx[t] if e >= 0 and int(e) // L // P != r // P)


@pytest.mark.parametrize(("layout", "hidden", "engine", "sync"), [
    ("expert", 32, "asp", "dc"), ("expert", 256, "asp", "dc"), ("rank", 256, "asp", "dc"),
    ("expert_padded", 32, "asp", "dc"), ("expert", 256, "asp", "sw"),
    ("expert", 256, "bsp", "tff")])
def test_rows_to_other_hosts_travel_as_messages_and_results_are_exact(
        layout: str, hidden: int, engine: str, sync: str) -> None:
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer

    def body(g: Any) -> tuple[list[bool], int, int, int]:
        with Buffer(g, _cfg(layout, hidden, engine=engine, sync=sync)) as buf:
            eng = buf._engine.kernel
            oks = []
            for seed in (1, 2, 3):
                eng.cland.puts.clear()
                eng.two.comm.sends.clear()
                oks.append(_exact(buf, g.rank, seed, layout, hidden))
            remote = [q for q in range(R) if q // P != g.rank // P]
            put = sum(n for q, n in eng.cland.puts if q in remote)
            sent = sum(n for q, n in eng.two.comm.sends if q in remote)
            return oks, put, sent, len(remote)

    world = FakeWorld(R, ranks_per_host=P)
    out = run_ranks(world, body)
    _, idxs, _ = _inputs(3, hidden)
    for src in range(R):  # what each source gets back is what the others sent it
        oks, put, _, _ = out[src]
        assert all(oks) and put == 0
    total_sent = sum(o[2] for o in out)
    total_rows = sum(_remote_picks(idxs[s], s, layout) for s in range(R))
    records = sum(o[3] for o in out) * 24  # one [rows][dispatch][epoch] record per pair
    assert total_sent == total_rows * hidden * 2 + records



def test_a_late_message_of_an_abandoned_combine_is_never_taken_by_a_later_one() -> None:
    """Every rank its own host. The last rank stops before a combine: the others time out and
    move on. It resumes, runs the abandoned combine (its rows now go out, but a slow link holds
    them), every rank resyncs, and only once the others wait in the next combine does the link
    deliver the old rows. They carry an older call's epoch: no later receive takes them (a
    later call stays bit-exact), they are drained, and nothing is left in any mailbox."""
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer
    from ubep.errors import RemoteError, TimeoutError

    world = FakeWorld(R)
    victim = R - 1
    timeout_s = 1.0
    failed = [threading.Event() for _ in range(R)]
    waiting = [threading.Event() for _ in range(R)]

    def body(g: Any) -> tuple[str, list[bool], bool]:
        r = g.rank
        with Buffer(g, _cfg(timeout_s=timeout_s)) as buf:
            oks = [_exact(buf, r, 1)]
            xs, idxs, ws, _refs, outs, _ys = _references(2, "expert")
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            g.barrier()
            err = ""
            if r == victim:  # "SIGSTOP" before the combine, "SIGCONT" once the others failed
                world.stopped.add(victim)
                for q in range(victim):
                    assert failed[q].wait(30)
                world.resume(victim)
                world.delayed.add(victim)  # what it sends now arrives late
                with pytest.raises((TimeoutError, RemoteError)):
                    buf.combine(outs[r], res.handle)
            else:
                try:
                    buf.combine(outs[r], res.handle)
                except (TimeoutError, RemoteError) as exc:
                    err = type(exc).__name__
                failed[r].set()
            buf.resync()
            xs, idxs, ws, _refs, outs, ys = _references(3, "expert")
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            if r == victim:  # the old rows land while the others' receives are posted
                for q in range(victim):
                    assert waiting[q].wait(30)
                time.sleep(0.3)
                world.release(victim)
            else:
                waiting[r].set()
            oks.append(bool(np.array_equal(buf.combine(outs[r], res.handle), ys[r])))
            oks.append(_exact(buf, r, 4))
            g.barrier()
            drained = buf._engine.kernel.two.done()
            g.barrier()
            return err, oks, drained

    out = run_ranks(world, body)
    errs = [out[q][0] for q in range(victim)]
    assert set(errs) <= {"TimeoutError", "RemoteError"} and "TimeoutError" in errs, errs
    assert all(all(oks) and drained for _, oks, drained in out), out
    assert not any(world.mail.unexpected.values())  # every old message drained
    assert not any(world.mail.posted.values())  # every receive matched or cancelled
