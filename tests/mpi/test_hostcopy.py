"""The once-per-host dispatch (ubep.mpi.hostcopy) on the in-process RMA transport
(tests/mpi/_fake_rma.py) with 2 hosts x 2 ranks (and 3 x 2, 13 tokens): results bit-exact
against ubep.reference in every layout it serves, each token's row crosses to another host
once (bytes counted at the transport against a brute-force count from the routing), a rank
copies its rows out of a gateway's landing that holds none of the gateway's own, and a forged
host record is refused, not used."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

R, P, T, HIDDEN, K = 4, 2, 16, 32, 4  # 4 experts a rank


def _cfg(layout: str = "expert", sync: str = "dc", engine: str = "asp", ranks: int = R,
         tokens: int = T) -> Any:
    from ubep.buffer import BufferConfig

    return BufferConfig(max_tokens_per_rank=tokens, hidden=HIDDEN, num_topk=K,
                        num_experts=4 * ranks, dtype="bf16", layout=layout, engine=engine,
                        sync=sync, timeout_s=5.0)


def _inputs(seed: int, ranks: int = R, tokens: int = T,
            ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, 2**16, (tokens, HIDDEN), dtype=np.uint16) & 0xBFFF
          for _ in range(ranks)]
    idxs = []
    for _ in range(ranks):
        idx = np.stack([rng.permutation(4 * ranks)[:K] for _ in range(tokens)]).astype(np.int64)
        idx[rng.random((tokens, K)) < 0.15] = -1  # some masked picks
        idxs.append(idx)
    ws = [rng.random((tokens, K)).astype(np.float32) for _ in range(ranks)]
    return xs, idxs, ws


def _exact(buf: Any, r: int, xs: list[np.ndarray], idxs: list[np.ndarray],
           ws: list[np.ndarray], layout: str) -> bool:
    from ubep import reference

    res = buf.dispatch(xs[r], idxs[r], ws[r])
    ranks, tokens = len(xs), len(xs[0])
    refs = reference.dispatch(xs, idxs, ws, 4 * ranks, layout=layout,
                              max_tokens=tokens if layout == "expert_padded" else None)
    outs = [ref.recv_x.copy() for ref in refs]
    y = buf.combine(outs[r], res.handle)
    y_ref = reference.combine(outs, refs)[r]
    rows = np.arange(len(refs[r].recv_x))
    if layout == "expert_padded":  # an empty slot's payload is left as it was
        rows = reference.defined_rows(refs[r].num_recv_tokens_per_expert, tokens * ranks)
    return bool(np.array_equal(res.recv_x[rows], refs[r].recv_x[rows])
                and np.array_equal(y, y_ref))


def _host_rows(idx: np.ndarray, r: int) -> int:
    """Brute force: the (token, other host) pairs of rank ``r``'s routing (4 experts a
    rank)."""
    pairs = {(t, int(e) // 4 // P) for t in range(len(idx)) for e in idx[t] if e >= 0}
    return sum(1 for _, h in pairs if h != r // P)


@pytest.mark.parametrize(("layout", "sync", "ranks", "tokens"), [
    ("expert", "dc", R, T), ("expert_padded", "dc", R, T), ("expert", "sw", R, T),
    ("rank", "dc", R, T), ("expert", "dc", 3 * P, 13), ("rank", "dc", 3 * P, 13)])
def test_a_token_crosses_once_per_host_and_results_are_exact(layout: str, sync: str,
                                                             ranks: int, tokens: int) -> None:
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer

    def body(g: Any) -> tuple[list[bool], int, int]:
        with Buffer(g, _cfg(layout, sync, ranks=ranks, tokens=tokens)) as buf:
            eng = buf._engine.kernel
            oks = []
            for seed in (1, 2, 3):
                xs, idxs, ws = _inputs(seed, ranks, tokens)
                for mem in (eng.data, eng.hosts.win):
                    mem.puts.clear()
                oks.append(_exact(buf, g.rank, xs, idxs, ws, layout))
                remote = [q for q in range(ranks) if q // P != g.rank // P]
                rows_bytes = sum(n for mem in (eng.data, eng.hosts.win) for q, n in mem.puts
                                 if q in remote)
            return oks, rows_bytes, _host_rows(idxs[g.rank], g.rank) * HIDDEN * 2

    for oks, wire, expected in run_ranks(FakeWorld(ranks, ranks_per_host=P), body):
        assert all(oks)
        assert wire == expected  # the last call's rows to other hosts: one per (token, host)


def test_a_gateway_without_rows_of_its_own_waits_for_its_hosts_landing() -> None:
    """Rank 0's tokens go to rank 3 only on host 1, whose gateway for rank 0 is rank 2: the
    rows land at rank 2, rank 3 copies its own from there, and both stay exact."""
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer

    xs, idxs, ws = _inputs(7)
    L = 4
    idxs[0] = np.stack([[0, 1, 3 * L + t % L, -1] for t in range(T)]).astype(np.int64)

    def body(g: Any) -> bool:
        with Buffer(g, _cfg()) as buf:
            return _exact(buf, g.rank, xs, idxs, ws, "expert")

    assert all(run_ranks(FakeWorld(R, ranks_per_host=P), body))


def test_the_host_copy_serves_asp_with_record_syncs_only() -> None:
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer

    cases = [("expert", "dc", "asp", True), ("expert", "tff", "asp", False),
             ("expert", "dc", "bsp", False), ("rank", "dc", "asp", True),
             ("rank", "tff", "asp", False)]

    def body(g: Any) -> list[bool]:
        got = []
        for layout, sync, engine, _ in cases:
            with Buffer(g, _cfg(layout, sync, engine)) as buf:
                got.append(buf._engine.kernel.hosts is not None)
        return got

    for got in run_ranks(FakeWorld(R, ranks_per_host=P), body):
        assert got == [on for *_, on in cases]


def test_a_host_record_naming_more_rows_than_its_bitmask_is_refused() -> None:
    """A record whose count disagrees with its token bitmask (forged, checksummed as a real
    one) ends the call with an internal error on the rank that reads it, naming the source."""
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer
    from ubep.errors import UbepError

    xs, idxs, ws = _inputs(5)

    def body(g: Any) -> str:
        with Buffer(g, _cfg()) as buf:
            eng = buf._engine.kernel
            if g.rank == 0:
                def forged(op: Any, x: np.ndarray, tokens_to: list[np.ndarray]) -> None:
                    del x, tokens_to  # instead of the real record, not after it (no race)
                    payload = np.zeros(eng.hosts.payload_bytes, np.uint8)
                    payload[:16] = np.array([T + 1, 0], "<u8").view(np.uint8)
                    payload[16:] = 0xFF
                    for d in (2, 3):
                        eng.proto.put_record(eng.ctrl, d, eng.cl.slot(
                            eng.cl.host, op.par, 0, eng.cl.host_rec), payload, op.epoch)

                eng.hosts.send = forged
            try:
                buf.dispatch(xs[g.rank], idxs[g.rank], ws[g.rank])
            except UbepError as exc:
                return str(exc)
            return ""

    got = run_ranks(FakeWorld(R, ranks_per_host=P), body)
    assert any("rank 0's host record" in m for m in got[2:]), got

