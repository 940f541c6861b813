"""Garbage in the control region, written at a chosen moment: an error, never data.

``Engine.poke`` arms a one-shot write that core 0 of a rank makes as its next dispatch or
combine reaches a chosen phase (phases.c): a third party with write access to the segment,
made deterministic. Each test writes chosen patterns into chosen control records (docs/
FORMATS.md, "Control records") and checks every rank's result against ``ubep.reference``: a
call returns the reference's answer or raises a ``UbepError``; after a failure every rank
resyncs and the next call is bit-exact again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case, bits, compare, make_inputs
from ubep import modes, reference
from ubep.buffer import Buffer
from ubep.errors import UbepError
from ubep.plane.records import CI_BYTES, FAIL_BYTES, IN_COUNTS, LINE_BYTES, ROUTE_IDX
from ubep.runtime import launch

# phase lists of phases.c: (kind 0 = dispatch, 1 = combine) -> number of phases
PHASES = {("asp", 0): 5, ("bsp", 0): 11, ("asp", 1): 4, ("bsp", 1): 6}
# the first phase after the routing is published (ASP ph_d_count, BSP ph_bsp_send)
AFTER_PUBLISH = 2


def _pair(buf: Buffer, case: Case, rank: int, poke: Any = None) -> str:
    """One dispatch + combine on inputs seeded by the call number, ``poke(buf, kind)`` arming
    a write before each: "ok", "WRONG ..." or the exception's class name."""
    cfg = buf.config
    seed = buf._epoch + 1
    xs, idxs, ws = make_inputs(case, cfg.num_experts, [8] * buf.num_ranks, seed, "uniform")
    refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)
    if poke is not None:
        poke(buf, 0)
    try:
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    except UbepError as exc:
        return type(exc).__name__
    bad = compare(res, refs[rank])
    if bad:
        return f"WRONG dispatch {seed}: {bad[:2]}"
    if poke is not None:
        poke(buf, 1)
    try:
        y = buf.combine(res.recv_x, res.handle)
    except UbepError as exc:
        return "ok/" + type(exc).__name__
    y_ref = reference.combine([np.ascontiguousarray(r.recv_x) for r in refs], refs)[rank]
    if not np.array_equal(bits(y), bits(y_ref)):
        return f"WRONG combine {seed + 1}"
    return "ok"


def _settle(buf: Buffer, case: Case, rank: int) -> str:
    """Resync (every rank does, so the ones a fault did not reach pair with the others)."""
    outcome = ""
    for _ in range(3):
        buf.resync(30.0)
        outcome = _pair(buf, case, rank)
        if outcome == "ok" or outcome.startswith("WRONG"):
            break
    return outcome


def _records(buf: Buffer, victim: int, kind: int) -> dict[str, tuple[int, int]]:
    """(offset, length) in ``victim``'s segment of each control record the next call of
    ``kind`` uses (its epoch parity, its dispatch's routing region)."""
    lay = buf.layout
    par = (buf._epoch + 1) & 1
    reg = buf._num_dispatches % lay.num_regions
    if kind == 1:
        reg = (buf._num_dispatches - 1) % lay.num_regions
    src = 1 - victim  # the peer's records in the victim's inbox
    inbox = lay.off_inbox + (src * 2 + par) * lay.inbox_bytes
    route = lay.off_route + reg * lay.route_stride
    return {
        "fail": (lay.off_fail + par * FAIL_BYTES, FAIL_BYTES),
        "entered": (lay.off_entered, 16),
        "done": (lay.off_done, 16),
        "recv_ready": (lay.off_recv_ready, 32),
        "comb_info": (lay.off_comb_info + par * CI_BYTES, 48),
        "barrier": (lay.off_barrier, LINE_BYTES),
        "inbox_counts": (inbox, 24),
        "inbox_flags": (inbox + 64, IN_COUNTS - 64),
        "inbox_per_expert": (inbox + IN_COUNTS, 4 * buf.num_local_experts),
        "route_header": (route, 24),
        "route_idx": (route + ROUTE_IDX, lay.route_w_off - ROUTE_IDX),
        "route_weights": (route + lay.route_w_off, lay.route_stride - lay.route_w_off),
    }


def _garbage(pattern: str, length: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if pattern == "random":
        return rng.integers(0, 256, length, dtype=np.uint8).tobytes()
    if pattern == "ones":
        return b"\xff" * length
    if pattern == "small":  # plausible values: small integers and floats in every word
        return rng.integers(0, 4, length // 4, dtype=np.uint32).astype(np.uint32).tobytes()
    raise ValueError(pattern)


def _sweep(group: Any, case: Case, targets: list[tuple[int, int, str, int, str]]) -> list[str]:
    """Every rank: one checked pair per target (kind, phase, record, victim, pattern), the
    poke armed on rank ``victim`` (writing its own segment) or on the other rank (writing the
    victim's), then a resync after any failure. Returns this rank's log."""
    cfg = case.config(8, timeout_s=1.0, num_cores=1)
    log: list[str] = []
    with Buffer(group, cfg) as buf:
        for i, (kind, phase, record, victim, pattern) in enumerate(targets):
            writer = victim if i % 2 == 0 else 1 - victim

            def poke(b: Buffer, k: int, kind: int = kind, phase: int = phase,
                     record: str = record, victim: int = victim, writer: int = writer,
                     pattern: str = pattern, i: int = i) -> None:
                if k != kind or group.rank != writer:
                    return
                off, length = _records(b, victim, kind)[record]
                b._engine.kernel.poke(kind, phase, victim, off, _garbage(pattern, length, i))

            outcome = _pair(buf, case, group.rank, poke)
            log.append(f"{kind}/{phase}/{record}/{victim}/{pattern}: {outcome}")
            # every rank learns every outcome, so all of them resync after a failure anywhere
            if any(o != "ok" for o in group.allgather(outcome)):
                log.append("settle: " + _settle(buf, case, group.rank))
    return log


def _wrong(logs: list[list[str]]) -> list[str]:
    return [f"rank {r}: {e}" for r, log in enumerate(logs) for e in log if "WRONG" in e]


def _worker_own_route(group: Any, mode_list: list[tuple[str, str, str]]) -> list[str]:
    log = []
    for engine, sync, layout in mode_list:
        case = Case(engine, sync, layout, "bf16", 2, 128, "uniform")
        # victim 1 writes its own record (even targets) or rank 0 writes it (odd ones)
        targets = [(0, AFTER_PUBLISH, record, 1, pattern)
                   for record in ("route_idx", "route_weights")
                   for pattern in ("random", "small")]
        log += [f"{engine}+{sync}+{layout} {e}" for e in _sweep(group, case, targets)]
    return log


MODES = sorted({(m.engine, m.sync, m.layout) for m in modes.enumerate_modes()})


@pytest.mark.parametrize("engine", ["asp", "bsp"])
def test_garbage_in_a_routing_record_after_it_is_published(engine: str) -> None:
    """The routing record a rank publishes is rewritten after publication, in every mode: the
    rank's own metadata (recv_topk_idx, weights of the rows it sent itself) must not come from
    it, and a peer that reads it finds the checksum wrong. Was: the owner read its own record
    in place, and returned the garbage as its recv_topk_idx / weights."""
    logs = launch(_worker_own_route, 2, [m for m in MODES if m[0] == engine], timeout_s=300)
    assert not _wrong(logs), _wrong(logs)
    for log in logs:
        assert all(e.endswith(": ok") for e in log if " settle" in e), log
    # the writes reached a record a peer reads: some rank saw them, in every mode
    for mode in {e.split()[0] for e in logs[0]}:
        assert any("Error" in e for log in logs for e in log
                   if e.startswith(mode) and " settle" not in e), (mode, logs)


def _worker_every_record(group: Any, engine: str, sync: str, layout: str) -> list[str]:
    case = Case(engine, sync, layout, "bf16", 2, 128, "uniform")
    records = list(_records_names())
    targets = []
    for kind in (0, 1):
        for phase in range(1, PHASES[(engine, kind)]):
            for j, record in enumerate(records):
                if (phase + j) % 3:  # every record, every phase, a third of the pairs
                    continue
                targets.append((kind, phase, record, (phase + j) % 2,
                                ("random", "ones", "small")[(phase + j) // 3 % 3]))
    return _sweep(group, case, targets)


def _records_names() -> tuple[str, ...]:
    return ("fail", "entered", "done", "recv_ready", "comb_info", "barrier", "inbox_counts",
            "inbox_flags", "inbox_per_expert", "route_header", "route_idx", "route_weights")


@pytest.mark.parametrize(("engine", "sync", "layout"),
                         [("bsp", "tff", "rank"), ("asp", "sw", "expert"), ("asp", "dc", "rank"),
                          ("bsp", "sp", "expert")])
def test_garbage_in_every_control_record_at_every_phase(
        engine: str, sync: str, layout: str) -> None:
    logs = launch(_worker_every_record, 2, engine, sync, layout, timeout_s=600)
    assert not _wrong(logs), _wrong(logs)
    for log in logs:
        assert all(e.endswith(": ok") for e in log if e.startswith("settle")), log
