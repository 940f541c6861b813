"""The fault soak (``python -m benchmarks.soak --faults``).

Every rank runs dispatch + combine pairs on a Buffer with a short deadline and, drawn from a
seed shared by all ranks and indexed by the call epoch (``buf._epoch + 1``, equal on every rank
for the same collective call, even after resyncs), injects a fault into some of them. Inputs
are drawn from the same key, so every rank can compute the reference of exactly the call the
ranks made together. A rank whose call failed with anything but a clean rejection is out of
step: it stops calling and meets the others in an exchange of "lost / pairs done" flags (a
peer still calling fails its next call, since this rank no longer takes part), after which
every rank resyncs. The exchange is also how a block ends: every rank there, none lost.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.soak.plan import (
    Block,
    Call,
    call_inputs,
    dispatch_diffs,
    draw_call,
    expert_outputs,
    make_blocks,
    progress_bar,
)
from ubep import reference
from ubep.buffer import Buffer
from ubep.errors import RemoteError, UbepError
from ubep.runtime import launch
from ubep.testing import same_bits

__all__ = ["FAULT_KINDS", "Fault", "FaultSettings", "check_contracts", "draw_fault",
           "format_fault_summary", "run_fault_soak"]


FAULT_KINDS = ("sigstop", "thread", "stale_handle", "bad_input", "garbage", "mismatch")
_BAD_DISPATCH = ("x_shape", "x_dtype", "expert_range", "expert_negative", "expert_uint64",
                 "ragged_topk_idx")
_BAD_COMBINE = ("expert_out_shape", "ragged_expert_out")
_ROTATION_EPOCH = 3  # every block's second pair has a fault, kinds in rotation (coverage)
_LATE_S = 0.15  # thread fault: a peer enters the call this late, so the main thread waits in it
_CLEAN = ("InvalidArgumentError", "RemoteError(clean)")


@dataclass(frozen=True)
class FaultSettings:
    """What the fault soak injects and how long it waits."""

    seed: int
    timeout_s: float = 1.0  # every Buffer's deadline (a SIGSTOP lasts longer)
    rate: float = 0.25  # share of pairs with a fault, besides the rotation pair of each block
    resync_timeout_s: float = 30.0
    exchange_timeout_s: float = 300.0
    calls_per_block: int = 20
    kinds: tuple[str, ...] = FAULT_KINDS  # the kinds to draw from (a subset to reproduce one)


@dataclass(frozen=True)
class Fault:
    """One injected fault (drawn by :func:`draw_fault`, the same on every rank)."""

    kind: str
    rank: int  # the stopped rank (sigstop, by rank 0's helper thread), else the rank that injects
    phase: str  # "dispatch" or "combine": the call it happens during (or instead of)
    peer: int  # garbage: whose segment is written; thread: who enters late; sigstop: 0 (stops)
    delay_s: float  # sigstop, garbage: from the start of the call to the injection
    hold_s: float  # sigstop: how long the rank stays stopped (longer than timeout_s)
    detail: str  # bad_input: which argument is bad and how
    seed: int  # garbage bytes and offsets


def draw_fault(settings: FaultSettings, num_ranks: int, block_index: int,
               epoch: int) -> Fault | None:
    """The fault of the pair whose dispatch is call ``epoch`` of block ``block_index`` (or None).

    Every field is drawn whatever the kind, so the stream does not depend on it.
    """
    rng = np.random.default_rng([settings.seed, num_ranks, block_index, epoch, 0xFA17])
    roll = rng.random()
    pick = settings.kinds[int(rng.integers(len(settings.kinds)))]
    phase = str(rng.choice(["dispatch", "combine"]))
    rank = int(rng.integers(num_ranks))
    stopped = int(rng.integers(1, num_ranks))
    peer = (rank + int(rng.integers(1, num_ranks))) % num_ranks
    delay = float(rng.uniform(0.0, 0.002))  # calls last ~0.1-5 ms: mostly during one
    hold = settings.timeout_s * float(rng.uniform(1.3, 2.5))
    bad_d, bad_c = str(rng.choice(_BAD_DISPATCH)), str(rng.choice(_BAD_COMBINE))
    seed = int(rng.integers(1 << 30))
    if epoch == _ROTATION_EPOCH:
        kind = settings.kinds[(settings.seed + block_index) % len(settings.kinds)]
    elif roll < settings.rate:
        kind = pick
    else:
        return None
    if kind == "stale_handle":
        phase = "combine"  # a handle only goes to combine
    return Fault(
        kind=kind, rank=stopped if kind == "sigstop" else rank, phase=phase,
        peer=0 if kind == "sigstop" else peer,
        delay_s=delay, hold_s=hold,
        detail=(bad_d if phase == "dispatch" else bad_c) if kind == "bad_input" else "",
        seed=seed,
    )


def _epoch_call(seed: int, num_ranks: int, block_index: int, epoch: int, block: Block) -> Call:
    """The inputs of the pair that starts at call ``epoch`` (the same on every rank)."""
    return draw_call(np.random.default_rng([seed, num_ranks, block_index, epoch]), num_ranks,
                      block.max_tokens)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return "RemoteError(clean)" if exc.clean else "RemoteError"
    if isinstance(exc, UbepError):
        return type(exc).__name__
    return f"foreign:{type(exc).__name__}"  # not a ubep error: a violation of its own


def _bad_dispatch_args(detail: str, block: Block, x: np.ndarray, idx: np.ndarray,
                       w: np.ndarray) -> tuple[Any, Any, Any]:
    """This rank's dispatch arguments made bad in the way ``detail`` names."""
    if detail == "x_shape":
        return np.zeros((x.shape[0], block.hidden + 1), x.dtype), idx, w
    if detail == "x_dtype":
        return x.astype(np.float64), idx, w
    if detail == "ragged_topk_idx":
        return x, [[0] * block.num_topk, [0] * (block.num_topk + 1)], w
    if x.shape[0] == 0:  # no slot to put a bad id in: one token
        x = np.zeros((1, block.hidden), x.dtype)
        idx = np.full((1, block.num_topk), -1, np.int64)
        w = np.zeros((1, block.num_topk), np.float32)
    if detail == "expert_uint64":  # 2**64 - 1 must not pass for -1 (a masked slot)
        bad = np.where(idx < 0, 0, idx).astype(np.uint64)
        bad[0, 0] = np.uint64(2**64 - 1)
        return x, bad, w
    idx = idx.copy()
    idx[0, 0] = block.num_experts + 3 if detail == "expert_range" else -2
    return x, idx, w


def _bad_expert_out(detail: str, eo: np.ndarray) -> Any:
    if detail == "ragged_expert_out":
        return [[0] * eo.shape[1], [0]]
    return np.zeros((eo.shape[0] + 1, eo.shape[1]), eo.dtype)


def _write_garbage(segment: np.ndarray, layout: Any, fault: Fault) -> None:
    """A few KB of random bytes into a peer's control area [off_fail, off_land), in 1-3
    bursts (payload bytes are not protected but by sync='dc': they are left alone)."""
    rng = np.random.default_rng(fault.seed)
    lo, hi = int(layout.off_fail), int(layout.off_land)
    for _ in range(int(rng.integers(1, 4))):
        time.sleep(fault.delay_s)
        size = min(int(rng.integers(512, 2049)), hi - lo)
        off = lo + int(rng.integers(0, hi - lo - size + 1))
        segment[off:off + size] = rng.integers(0, 256, size, dtype=np.uint8)


def _stop_peer(pid: int, fault: Fault) -> None:
    time.sleep(fault.delay_s)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(fault.hold_s)
    finally:
        os.kill(pid, signal.SIGCONT)


def _handle_variant(buf: Buffer, prev: tuple[Any, np.ndarray] | None) -> str:
    """How the last dispatch's handle relates to ``buf`` (what a stale combine tests)."""
    if prev is None:
        return "no_handle"
    if prev[0].buffer_uid != buf.uid:
        return "other_buffer"
    return "same_generation" if prev[0].generation == buf._generation else "before_resync"


class _FaultRank:
    """One rank's side of the fault soak: runs the pairs, injects, logs, counts."""

    def __init__(self, group: Any, settings: FaultSettings, bar: Any) -> None:
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.num_ranks
        self.settings = settings
        self.bar = bar
        self.log: list[dict[str, Any]] = []  # one entry per pair this rank started
        self.wrong: list[dict[str, Any]] = []  # reproducers of wrong answers
        self.calls_checked = 0
        self.resyncs = 0
        self.prev: tuple[Any, np.ndarray] | None = None  # the last dispatch's handle + outputs
        self.stoppers: list[threading.Thread] = []

    def run_block(self, buf: Buffer, block_index: int, block: Block) -> None:
        quota, pairs, lost = len(block.calls), 0, False
        while True:
            if lost or pairs >= quota:
                flags = self.group.allgather([lost, pairs], self.settings.exchange_timeout_s)
                # the pairs every rank started (a rank that went on alone made extra ones)
                pairs = min(int(p) for _, p in flags)
                if pairs >= quota and not any(bool(f) for f, _ in flags):
                    return
                buf.resync(self.settings.resync_timeout_s)
                self.resyncs += 1
                lost = False
                continue
            pairs += 1
            lost = self.pair(buf, block_index, block)
            if self.bar is not None:
                self.bar.update(1)

    def pair(self, buf: Buffer, bi: int, block: Block) -> bool:
        """One dispatch + combine pair; returns True if this rank lost step."""
        r, epoch = self.rank, buf._epoch + 1
        fault = draw_fault(self.settings, self.num_ranks, bi, epoch)
        call = _epoch_call(self.settings.seed, self.num_ranks, bi, epoch, block)
        xs, idxs, ws = call_inputs(block, call)
        refs = reference.dispatch(xs, idxs, ws, block.num_experts, layout=block.layout)
        outs = expert_outputs(block, refs, call.seed)
        entry: dict[str, Any] = {"block": bi, "epoch": epoch, "gen": buf._generation,
                                 "kind": fault.kind if fault else "none", "d": "-", "c": "-",
                                 "inj": False}
        self.log.append(entry)
        where = {"seed": self.settings.seed, "num_ranks": self.num_ranks, "block": bi,
                 "mode": block.mode(), "hidden": block.hidden, "epoch": epoch,
                 "fault": dataclasses.asdict(fault) if fault else None, "rank": r}
        prev = self.prev
        own = fault if fault is not None and fault.rank == r else None
        detail = own.detail if own is not None else ""
        if fault is not None:
            entry |= {"frank": fault.rank, "phase": fault.phase, "detail": fault.detail}
        if own is not None and own.kind in ("bad_input", "mismatch", "stale_handle"):
            entry["variant"] = _handle_variant(buf, prev)
            entry["inj"] = own.kind != "stale_handle" or prev is not None

        def mine(kind: str, phase: str | None = None) -> bool:
            """This rank replaces its call (bad input, stale handle, mismatched call)."""
            return own is not None and own.kind == kind and phase in (None, own.phase)

        def dispatch() -> Any:
            if mine("bad_input", "dispatch"):
                return buf.dispatch(*_bad_dispatch_args(detail, block, xs[r], idxs[r], ws[r]))
            if mine("mismatch", "dispatch"):  # combine while the others dispatch
                h, eo = prev if prev is not None else (None, outs[r])
                return buf.combine(eo, h)  # type: ignore[arg-type]  # None: no handle yet
            return buf.dispatch(xs[r], idxs[r], ws[r])

        res, entry["d"] = self.step(buf, fault, "dispatch", dispatch, entry)
        if entry["d"] != "ok":
            return entry["d"] not in _CLEAN
        if mine("bad_input", "dispatch") or mine("mismatch", "dispatch"):
            self.wrong.append(where | {"what": "a bad or mismatched dispatch returned data"})
            return True
        self.calls_checked += 1
        diffs = dispatch_diffs(res, refs[r])
        if diffs:
            self.wrong.append(where | {"what": f"dispatch fields differ: {diffs}"})
        self.prev = (res.handle, outs[r])

        def combine() -> Any:
            if mine("bad_input", "combine"):
                return buf.combine(_bad_expert_out(detail, outs[r]), res.handle)
            if mine("stale_handle") and prev is not None:  # the previous dispatch's handle
                return buf.combine(prev[1], prev[0])
            if mine("mismatch", "combine"):  # dispatch while the others combine
                return buf.dispatch(xs[r], idxs[r], ws[r])
            if block.zero_copy:
                eo = buf.get_combine_buffer(res.handle)
                eo[...] = outs[r]
                return buf.combine(eo, res.handle)
            return buf.combine(outs[r], res.handle)

        y, entry["c"] = self.step(buf, fault, "combine", combine, entry)
        if entry["c"] != "ok":
            return entry["c"] not in _CLEAN
        if mine("bad_input", "combine") or mine("mismatch", "combine") or (
                mine("stale_handle") and prev is not None):
            self.wrong.append(where | {"what": f"a {entry['kind']} combine returned data"})
            return True
        self.calls_checked += 1
        if not same_bits(y, reference.combine(outs, refs)[r]):
            self.wrong.append(where | {"what": "combine differs"})
        return False

    def step(self, buf: Buffer, fault: Fault | None, phase: str, action: Any,
             entry: dict[str, Any]) -> tuple[Any, str]:
        """Run ``action`` (one call) with this phase's injections around it."""
        helpers: list[threading.Thread] = []
        second: list[str] = []
        if fault is not None and fault.phase == phase:
            helpers = self._inject(buf, fault, entry, second)
        try:
            return action(), "ok"
        except Exception as exc:  # every outcome is logged; none may be wrong data
            entry[f"{phase[0]}msg"] = str(exc)[:300]  # for reproducers
            return None, _outcome(exc)
        finally:
            for t in helpers:
                t.join()
            if second:
                entry["thread"] = second[0]
                entry["inj"] = second[0] != "not injected"

    def _inject(self, buf: Buffer, fault: Fault, entry: dict[str, Any],
                second: list[str]) -> list[threading.Thread]:
        """Start this rank's helper threads for ``fault`` (or sleep, for the late rank)."""
        r, kind = self.rank, fault.kind
        target: Any = None
        if kind == "sigstop" and r == 0:
            target = (_stop_peer, self.group.peers[fault.rank].pid, fault)
        elif kind == "garbage" and r == fault.rank:
            target = (_write_garbage, buf._memory.segments[fault.peer].array, buf.layout, fault)
        elif kind == "thread" and r == fault.rank:
            target = (self._second_thread, buf, second)
        elif kind == "thread" and r == fault.peer:
            time.sleep(_LATE_S)  # so that the other rank's main thread waits inside its call
        if target is None:
            return []
        entry["inj"] = True
        thread = threading.Thread(target=target[0], args=target[1:], daemon=True)
        if kind == "sigstop":
            # not joined after the call: rank 0 goes on calling (and failing) while the peer
            # is stopped, so a stop lands both during and between calls
            self.join_stoppers()
            self.stoppers.append(thread)
            thread.start()
            return []
        thread.start()
        return [thread]

    def join_stoppers(self) -> None:
        """Wait for every SIGSTOP helper (each SIGCONTs its rank before it ends)."""
        for t in self.stoppers:
            t.join()
        self.stoppers = []

    @staticmethod
    def _second_thread(buf: Buffer, out: list[str]) -> None:
        """Once the main thread is inside its call, call dispatch from this thread: it must be
        refused with a plain UbepError without touching the call."""
        deadline = time.monotonic() + 2.0
        while not buf._lock.locked():
            if time.monotonic() > deadline:
                out.append("not injected")
                return
            time.sleep(0.0002)
        x = np.zeros((1, buf.config.hidden), buf._dtype.storage)
        idx = np.full((1, buf.config.num_topk), -1, np.int64)
        try:
            buf.dispatch(x, idx, np.zeros(idx.shape, np.float32))
            out.append("returned")
        except UbepError as exc:
            refused = type(exc) is UbepError and "another call is in progress" in str(exc)
            out.append("refused" if refused else _outcome(exc))
        except Exception as exc:
            out.append(_outcome(exc))


def _fault_worker(group: Any, blocks: list[Block], settings: FaultSettings,
                  progress: bool) -> dict[str, Any]:
    np.seterr(over="ignore", invalid="ignore")  # NaN/Inf payloads are valid data
    total = sum(len(b.calls) for b in blocks)
    bar = progress_bar(group, total, "fault soak") if progress else None
    me = _FaultRank(group, settings, bar)
    try:
        for bi, block in enumerate(blocks):
            with Buffer(group, block.config(settings.timeout_s)) as buf:
                me.run_block(buf, bi, block)
    finally:
        me.join_stoppers()  # never leave a peer stopped
    if bar is not None:
        bar.close()
    return {"rank": group.rank, "log": me.log, "wrong": me.wrong,
            "calls_checked": me.calls_checked, "resyncs": me.resyncs}


def _later_pairs(by_key: dict[tuple[int, int], dict[int, Any]], block: int, epoch: int) -> bool:
    return any(b == block and e > epoch for b, e in by_key)


def _tainted(log: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """Pairs an earlier fault may still reach into: garbage stays in a control area until the
    next resync, and rank 0 goes on calling while the rank it stopped is still stopped."""
    out: set[tuple[int, int]] = set()
    garbage: set[tuple[int, int]] = set()  # (block, generation) with garbage written
    stop: tuple[int, int] = (-1, -99)  # (block, index in the log) of the last sigstop pair
    for i, e in enumerate(log):
        key = (e["block"], e["epoch"])
        if (e["block"], e["gen"]) in garbage or (stop[0] == e["block"] and i - stop[1] <= 2):
            out.add(key)
        if e["kind"] == "garbage":
            garbage.add((e["block"], e["gen"]))
        if e["kind"] == "sigstop":
            stop = (e["block"], i)
    return out


def check_contracts(num_ranks: int, logs: list[list[dict[str, Any]]]) -> tuple[list[str], int]:
    """What each fault kind promises, checked on the pairs every rank made together from a clean
    state (no garbage left from before in this generation, no rank still stopped); returns the
    problems and the number of pairs checked.

    bad_input: InvalidArgumentError on the offender, RemoteError(clean) everywhere else, and the
    next pair (if fault-free) works on every rank without a resync. thread: the second thread is
    refused with a plain UbepError and the pair succeeds everywhere. stale_handle and mismatch:
    the call fails on every rank. Any rank, any pair: every exception is a UbepError.
    """
    by_key: dict[tuple[int, int], dict[int, Any]] = {}
    tainted: set[tuple[int, int]] = set()
    out: list[str] = []
    for r, log in enumerate(logs):
        tainted |= _tainted(log)
        for e in log:
            by_key.setdefault((e["block"], e["epoch"]), {})[r] = e
            if e["d"].startswith("foreign") or e["c"].startswith("foreign"):
                out.append(f"block {e['block']} epoch {e['epoch']} rank {r}: not a UbepError: "
                           f"{e['d']} / {e['c']}")
    checked = 0
    for (bi, epoch), per in sorted(by_key.items()):
        if len(per) < num_ranks or per[0]["kind"] == "none" or (bi, epoch) in tainted:
            continue
        checked += 1
        head = f"block {bi} epoch {epoch} {per[0]['kind']} {per[0].get('detail', '')}"
        for problem in _pair_contract(per, by_key, tainted, bi, epoch):
            said = {r: [e[m] for m in ("dmsg", "cmsg") if m in e] for r, e in per.items()}
            out.append(f"{head}: {problem}; messages {said}")
    return out, checked


def _pair_contract(per: dict[int, Any], by_key: dict[tuple[int, int], dict[int, Any]],
                   tainted: set[tuple[int, int]], bi: int, epoch: int) -> list[str]:
    e0 = per[0]
    kind, off, phase = e0["kind"], e0["frank"], e0["phase"]
    key = "d" if phase == "dispatch" else "c"
    got = {r: (e["d"], e["c"]) for r, e in per.items()}
    all_ok = all(d == "ok" and c == "ok" for d, c in got.values())
    if kind == "bad_input":
        want = {r: ("InvalidArgumentError" if r == off else "RemoteError(clean)") for r in per}
        if any(per[r][key] != w for r, w in want.items()):
            return [f"{phase} outcomes {got}, want {want}"]
        nxt_key = (bi, epoch + (1 if phase == "dispatch" else 2))
        nxt = by_key.get(nxt_key)
        if nxt_key in tainted:
            return []
        if nxt is None:
            return ["no rank made the next call"] if _later_pairs(by_key, bi, epoch) else []
        if len(nxt) < len(per):
            return [f"only ranks {sorted(nxt)} made the next call"]
        if nxt[0]["kind"] == "none" and not all(e["d"] == e["c"] == "ok" for e in nxt.values()):
            return [f"the next call failed: {[(e['d'], e['c']) for e in nxt.values()]}"]
    elif kind == "thread":
        second = per[off].get("thread", "not injected")
        if second not in ("refused", "not injected"):
            return [f"second thread: {second}"]
        if second == "refused" and not all_ok:
            return [f"the main call was affected: {got}"]
    elif kind in ("stale_handle", "mismatch") and per[off]["inj"]:
        if key == "c" and not all(d == "ok" for d, _ in got.values()):
            return []  # the dispatch before it already failed: nothing to check
        if any(e[key] == "ok" for e in per.values()):
            return [f"{phase} returned on some rank: {got}"]
    return []


def run_fault_soak(iterations: int, ranks: list[int], settings: FaultSettings, *,
                   progress: bool = True, timeout_s: float = 4 * 3600.0) -> dict[str, Any]:
    """The fault soak: ``iterations`` dispatch + combine pairs (split over ``ranks``)."""
    share = [iterations // len(ranks) + (i < iterations % len(ranks)) for i in range(len(ranks))]
    out: dict[str, Any] = {"settings": dataclasses.asdict(settings), "ranks": {}}
    for num_ranks, n in zip(ranks, share, strict=True):
        if not n:
            continue
        blocks = make_blocks(num_ranks, n, settings.seed, settings.calls_per_block)
        t0 = time.monotonic()
        found = launch(_fault_worker, num_ranks, blocks, settings, progress, timeout_s=timeout_s)
        out["ranks"][num_ranks] = _fault_summary(num_ranks, found, len(blocks),
                                                 time.monotonic() - t0)
    runs = out["ranks"].values()
    out["wrong_answers"] = sum(v["wrong_answers"] for v in runs)
    out["violations"] = sum(len(v["violations"]) for v in runs)
    out["calls_checked"] = sum(v["calls_checked"] for v in runs)
    out["pairs"] = sum(v["pairs"] for v in runs)
    out["ok"] = out["wrong_answers"] == 0 and out["violations"] == 0
    return out


def _fault_summary(num_ranks: int, found: list[dict[str, Any]], blocks: int,
                   seconds: float) -> dict[str, Any]:
    logs = [f["log"] for f in found]
    errors: Counter[str] = Counter()
    kinds: dict[str, dict[str, Any]] = {
        k: {"pairs": 0, "injected": 0, "outcomes": Counter(), "variants": Counter()}
        for k in ("none", *FAULT_KINDS)}
    for r, log in enumerate(logs):
        for e in log:
            k = kinds[e["kind"]]
            k["pairs"] += r == 0
            k["injected"] += bool(e["inj"])
            role = "@" if e.get("frank") == r else ""
            k["outcomes"][f"{role}{e['d']}/{e['c']}"] += 1
            if e["inj"] and "variant" in e:
                k["variants"][e["variant"]] += 1
            if e["inj"] and "thread" in e:
                k["variants"][f"thread {e['thread']}"] += 1
            errors.update(v for v in (e["d"], e["c"]) if v not in ("ok", "-"))
    wrong = [w for f in found for w in f["wrong"]]
    violations, checked = check_contracts(num_ranks, logs)
    everywhere: Counter[tuple[int, int]] = Counter(
        (e["block"], e["epoch"]) for log in logs for e in log if e["d"] == e["c"] == "ok")
    return {
        "num_ranks": num_ranks, "blocks": blocks, "seconds": round(seconds, 1),
        "pairs": len(logs[0]), "calls_checked": sum(f["calls_checked"] for f in found),
        "pairs_checked_everywhere": sum(n == num_ranks for n in everywhere.values()),
        "resyncs": found[0]["resyncs"], "wrong_answers": len(wrong), "wrong": wrong[:50],
        "errors": dict(errors.most_common()), "violations": violations,
        "contracts_checked": checked,
        "kinds": {k: v | {"outcomes": dict(v["outcomes"].most_common()),
                          "variants": dict(v["variants"])} for k, v in kinds.items()},
    }


def format_fault_summary(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"fault soak: seed {s['seed']}, timeout_s {s['timeout_s']}, fault rate {s['rate']} "
             f"(+ one rotation fault per block of {s['calls_per_block']} pairs), kinds "
             f"{','.join(s['kinds'])}"]
    for num_ranks, v in result["ranks"].items():
        lines.append(
            f"{num_ranks} ranks: {v['pairs']} dispatch+combine pairs in {v['blocks']} buffers, "
            f"{v['seconds']} s, {v['pairs_checked_everywhere']} of them checked on every rank; "
            f"calls checked bit for bit (all ranks): {v['calls_checked']}; "
            f"wrong answers: {v['wrong_answers']}; resyncs: {v['resyncs']}; contract "
            f"violations: {len(v['violations'])} in {v['contracts_checked']} fault pairs checked")
        lines.append("  errors by type (all ranks): " + ", ".join(
            f"{k} {n}" for k, n in v["errors"].items()))
        lines.append(f"  {'fault':<13}{'pairs':>6}{'injected':>9}  outcomes dispatch/combine "
                     "(all ranks; @: the fault's rank)")
        for kind, k in v["kinds"].items():
            outcomes = ", ".join(f"{o} {n}" for o, n in list(k["outcomes"].items())[:8])
            lines.append(f"  {kind:<13}{k['pairs']:>6}{k['injected']:>9}  {outcomes}")
            if k["variants"]:
                lines.append(f"  {'':<28}variants: " + ", ".join(
                    f"{o} {n}" for o, n in k["variants"].items()))
        for w in v["wrong"][:10]:
            lines.append(f"  WRONG: {w}")
        for problem in v["violations"][:10]:
            lines.append(f"  VIOLATION: {problem}")
    lines.append(f"fault soak: {'PASS' if result['ok'] else 'FAIL'} ({result['pairs']} pairs, "
                 f"{result['calls_checked']} checked calls, {result['wrong_answers']} wrong "
                 f"answers, {result['violations']} violations)")
    return "\n".join(lines)

