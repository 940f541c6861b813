"""The conformance suite of ``ubep.plane``: what every registered engine must do, through a
``ubep.Buffer``, against the single-process oracle (``ubep.reference``, ``ubep.quant``).

Parametrized over the engines (``worlds.ENGINES``): the native one-host engine, the MPI RMA
engine, the pure-numpy engine of this folder and the Triton engine (under Triton's
interpreter: its default run takes its own few modes, ``TRITON_LEAN``). Each test runs one
world per engine (a world is a launch: the modes of a test share it). The default run takes a
few modes per engine; the whole cross product (engine kind x sync x layout x quant) runs
under ``-m matrix``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest

from tests.plane.worlds import ENGINES, LostRank, die, run, transport
from ubep import Buffer, BufferConfig, reference, testing
from ubep.errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RemoteError,
    TimeoutError,
)
from ubep.expert_map import ExpertMap
from ubep.modes import BUFFER_LAYOUTS as LAYOUTS
from ubep.modes import ENGINES as KINDS
from ubep.modes import SYNCS
from ubep.quant import quantize

R, E, K, H = 2, 8, 2, 256
TOKENS = [6, 4]

Mode = tuple[str, str, str, "str | None"]  # engine kind, sync, layout, quant
ALL_MODES: list[Mode] = [
    (kind, sync, layout, quant)
    for kind, sync, layout, quant in itertools.product(KINDS, SYNCS, LAYOUTS,
                                                       (None, "e4m3", "int8"))
    if not (sync == "sp" and quant is not None)  # no sentinel in quantised rows (config)
]
# the default run: every engine kind, sync, layout and quant format at least once
LEAN_MODES: list[Mode] = [("asp", "sw", "expert", None), ("bsp", "tff", "rank", None),
                          ("asp", "dc", "rank", "e4m3"), ("bsp", "sp", "expert", None),
                          ("asp", "tff", "expert", "int8"), ("asp", "sw", "expert_padded", None),
                          ("bsp", "dc", "expert_padded", None),
                          ("asp", "tff", "expert_padded", "e4m3")]
# the Triton engine's (its interpreter is slow): every sync and layout it serves, and one mode
# of each kind it refuses
TRITON_LEAN: list[Mode] = [("asp", "sw", "expert", None), ("asp", "tff", "rank", None),
                           ("asp", "dc", "expert", None), ("asp", "sp", "rank", None),
                           ("bsp", "tff", "rank", None), ("asp", "dc", "rank", "e4m3"),
                           ("asp", "sw", "expert_padded", None)]


def _config(group: Any, mode: Mode, **extra: Any) -> BufferConfig:
    kind, sync, layout, quant = mode
    return BufferConfig(max_tokens_per_rank=8, hidden=H, num_topk=K, num_experts=E, dtype="bf16",
                        engine=kind, sync=sync, layout=layout, quant=quant, num_cores=1,
                        transport=transport(group), **({"timeout_s": 30.0} | extra))


def _refused(mode: Mode, engine: str) -> str | None:
    """The argument an engine refuses a mode by, else None: the RMA engine moves rows as they
    are (no quantised rows, no SP sentinels); the Triton engine runs ASP (no BSP) on
    unquantised rows (quant is the field it checks first)."""
    if engine == "mpi":
        return "quant" if mode[3] is not None else "sync" if mode[1] == "sp" else None
    if engine == "triton":
        return ("quant" if mode[3] is not None else "engine" if mode[0] == "bsp" else
                "layout" if mode[2] == "expert_padded" else None)
    return None


def _check_quantised(buf: Buffer, xs: list[np.ndarray], idxs: list[np.ndarray],
                     ws: list[np.ndarray], seed: int) -> list[str]:
    """A quantised dispatch: each received row is its token quantised (``ubep.quant``, the
    oracle of the kernels), routed as the reference routes; combine stays in ``dtype``."""
    cfg, r = buf.config, buf.rank
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    refs = reference.dispatch(xs, idxs, ws, E, layout=cfg.layout, **testing.oracle_options(cfg))
    rows = testing.defined(refs[r])  # a padded recv_x: the slots that hold a row
    values, scales = quantize(refs[r].recv_x[rows], cfg.quant or "")
    errors = [] if testing.same_bits(res.recv_x[rows], values) and testing.same_bits(
        res.recv_x_scales[rows], scales) else ["quantised rows differ"]
    errors += [e for e in testing.compare(_unquantised(res, refs[r]), refs[r])
               if "recv_x" not in e]
    outs = [testing.expert_outputs(cfg.dtype, ref.recv_x, seed * 10 + q)
            for q, ref in enumerate(refs)]
    y = buf.combine(outs[r], res.handle)
    if not testing.same_bits(y, reference.combine(outs, refs)[r]):
        errors.append("combine differs")
    return errors


def _unquantised(res: Any, ref: Any) -> Any:
    """``res`` with the reference's ``recv_x``: the rest compared field by field."""
    return type(res)(ref.recv_x, res.recv_topk_idx, res.recv_topk_weights,
                     res.num_recv_tokens_per_expert, res.recv_src_rank, res.recv_src_token,
                     res.recv_src_k, res.handle,
                     num_sent_rows_per_rank=res.num_sent_rows_per_rank)


def _modes_body(group: Any, modes: list[Mode]) -> list[Any]:
    out = []
    for i, mode in enumerate(modes):
        try:
            buf = Buffer(group, _config(group, mode))
        except InvalidArgumentError as exc:
            out.append(("refused", exc.argument))
            continue
        with buf:
            xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, i, "uniform")
            check = _check_quantised if mode[3] is not None else testing.check_call
            out.append(("ran", check(buf, xs, idxs, ws, i)))
    return out


def _check_modes(engine: str, modes: list[Mode]) -> None:
    got = run(engine, R, _modes_body, modes)
    for mode, *ranks in zip(modes, *got, strict=True):
        want = _refused(mode, engine)
        if want is not None:
            assert all(g == ("refused", want) for g in ranks), (mode, ranks)
        else:
            assert all(g == ("ran", []) for g in ranks), (mode, ranks)


@pytest.mark.parametrize("engine", ENGINES)
def test_modes_bit_exact(engine: str) -> None:
    _check_modes(engine, TRITON_LEAN if engine == "triton" else LEAN_MODES)


def _four_body(group: Any, mode: Mode) -> list[str]:
    """Four ranks, one of them sending nothing."""
    with Buffer(group, _config(group, mode)) as buf:
        xs, idxs, ws = testing.inputs("bf16", E, K, H, [6, 4, 0, 5], 11, "uniform")
        return testing.check_call(buf, xs, idxs, ws, 11)


@pytest.mark.parametrize("engine", ENGINES)
def test_four_ranks_bit_exact(engine: str) -> None:
    assert run(engine, 4, _four_body, ("asp", "dc", "rank", None)) == [[]] * 4


@pytest.mark.matrix
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_every_mode_bit_exact(engine: str, kind: str) -> None:
    _check_modes(engine, [m for m in ALL_MODES if m[0] == kind])


def _routing_body(group: Any) -> list[list[str]]:
    """Redundant experts, then M2N, against the oracle."""
    out = []
    # six logical experts on eight slots: experts 0 and 5 have a replica each (slots 6, 7)
    emap = ExpertMap([[0, 6], [1], [2], [3], [4], [5, 7]])
    with Buffer(group, _config(group, ("asp", "sw", "expert", None), expert_map=emap)) as buf:
        xs, idxs, ws = testing.inputs("bf16", E - 2, K, H, TOKENS, 3, "hot")
        out.append(testing.check_call(buf, xs, idxs, ws, 3))
    for layout in LAYOUTS:
        mode = ("asp", "tff", layout, None)
        try:
            buf = Buffer(group, _config(group, mode, expert_ranks=(1,)))
        except InvalidArgumentError as exc:
            out.append([f"refused: {exc.argument}"])
            continue
        with buf:
            xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, 4, "uniform")
            out.append(testing.check_call(buf, xs, idxs, ws, 4))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_expert_map_and_m2n(engine: str) -> None:
    want = [[]] + [[f"refused: {refused}"] if (refused := _refused(
        ("asp", "tff", layout, None), engine)) else [] for layout in LAYOUTS]
    assert run(engine, R, _routing_body) == [want] * R


def _split_body(group: Any, sync: str, layout: str = "expert") -> list[str]:
    """Two dispatches in flight, hooks called out of order, then two combines in flight."""
    r = group.rank
    with Buffer(group, _config(group, ("asp", sync, layout, None))) as buf:
        ins = [testing.inputs("bf16", E, K, H, TOKENS, s, "uniform") for s in (5, 6)]
        pend = [buf.dispatch(x[r], i[r], w[r], return_recv_hook=True) for x, i, w in ins]
        try:
            _ = pend[0].recv_x  # not readable before its hook
            errors = ["recv_x readable before the hook"]
        except Exception:
            errors = []
        res = [pend[1].hook(), pend[0].hook()][::-1]
        refs = [reference.dispatch(x, i, w, E, layout=layout, **testing.oracle_options(buf.config))
                for x, i, w in ins]
        for got, ref in zip(res, refs, strict=True):
            errors += testing.compare(got, ref[r])
        outs = [[testing.expert_outputs("bf16", ref[q].recv_x, 7 + q) for q in range(R)]
                for ref in refs]
        ys = [buf.combine(o[r], got.handle, return_recv_hook=True) for o, got in
              zip(outs, res, strict=True)]
        for y, o, ref in zip(ys, outs, refs, strict=True):
            if not testing.same_bits(y.hook(), reference.combine(o, ref)[r]):
                errors.append("combine differs")
    return errors


@pytest.mark.parametrize("engine", ENGINES)
def test_split_phase_calls(engine: str) -> None:
    assert run(engine, R, _split_body, "tff") == [[]] * R


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "triton" and
                                    getattr(e, "values", ("",))[0] != "triton"])
def test_split_phase_calls_padded(engine: str) -> None:
    """The padded layout's two receive regions in flight at once (DeepEP's two-batch
    overlap); the Triton engine refuses the layout (test_modes_bit_exact)."""
    assert run(engine, R, _split_body, "sw", "expert_padded") == [[]] * R


def _recv_valid_body(group: Any) -> list[tuple[bool, bool]]:
    """After 0, 1 and 2 further dispatches of other rows: what ``recv_x_valid`` says of the
    first dispatch's rows, beside whether they still hold what it returned (a snapshot)."""
    r, out = group.rank, []
    with Buffer(group, _config(group, ("asp", "sw", "expert", None))) as buf:
        xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, 20, "uniform")
        first = buf.dispatch(xs[r], idxs[r], ws[r])
        snapshot = testing.bits(first.recv_x).copy()  # a tensor of an engine's device too
        for seed in (21, 22, 23):
            out.append((buf.recv_x_valid(first.handle),
                        bool(np.array_equal(testing.bits(first.recv_x), snapshot))))
            xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, seed, "uniform")
            buf.dispatch(xs[r], idxs[r], ws[r])
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_recv_x_valid_says_whether_the_rows_are_still_there(engine: str) -> None:
    """The engine answers for its memory: a view its receive region fills again (the native
    and RMA engines' second dispatch after) is invalid, a fresh array (Triton's, numpy's) never
    is; never valid for rows that changed."""
    for rank in run(engine, R, _recv_valid_body):
        assert [valid for valid, _ in rank] == [same for _, same in rank], rank
        assert rank[0] == (True, True)  # right after its own dispatch


def _bad_input_body(group: Any) -> list[Any]:
    """Rank 1's expert id out of range (the data plane finds it), then rank 0's ``x`` of the
    wrong width (the Buffer's checks): each a clean reject on every rank, the next call
    right."""
    r, out = group.rank, []
    with Buffer(group, _config(group, ("asp", "sw", "expert", None))) as buf:
        xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, 8, "uniform")
        bad = [i.copy() for i in idxs]
        bad[1][0, 0] = E + 3
        for x, idx in ((xs[r], bad[r]), (xs[r][:, :H // 2] if r == 0 else xs[r], idxs[r])):
            try:
                buf.dispatch(x, idx, ws[r])
                out.append("no error")
            except InvalidArgumentError as exc:
                out.append(("bad", exc.argument))
            except RemoteError as exc:
                out.append(("remote", exc.rank, exc.clean))
        out.append(testing.check_call(buf, xs, idxs, ws, 8))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_input_is_a_clean_reject_on_every_rank(engine: str) -> None:
    got = run(engine, R, _bad_input_body)
    assert got[0] == [("remote", 1, True), ("bad", "x"), []]
    assert got[1] == [("bad", "topk_idx"), ("remote", 0, True), []]


def _signature_body(group: Any, kind: str) -> list[Any]:
    """The ranks' calls differ only in their signatures (``Buffer.sign``): rank 1's capacity
    word, then its dtype word: each call fails on every rank as bad input naming what differs
    with both values, before any row moved; the next call, signed alike, is right."""
    from ubep.buffer.signature import Signature

    r, out = group.rank, []
    with Buffer(group, _config(group, (kind, "sw", "expert", None))) as buf:
        xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, 11, "uniform")
        base = Signature("dispatch", "bfloat16", H, E, 8, K)
        bad = [Signature("dispatch", "bfloat16", H, E, 16, K),
               Signature("dispatch", "float16", H, E, 8, K)]
        for sig in bad:
            if not buf.sign((sig if r == 1 else base).word):
                return ["unsigned"]
            try:
                buf.dispatch(xs[r], idxs[r], ws[r])
                out.append("no error")
            except InvalidArgumentError as exc:
                out.append(("bad", exc.argument, str(exc)))
            except (RemoteError, OutOfStepError) as exc:
                out.append((type(exc).__name__, str(exc)))
            if kind == "bsp" and isinstance(out[-1], tuple) and out[-1][0] != "bad":
                buf.resync()  # BSP has sent its rows when the counts come in: out of step
        buf.sign(base.word)
        out.append(testing.check_call(buf, xs, idxs, ws, 11))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_signatures_that_differ_fail_the_call_on_every_rank(engine: str) -> None:
    got = run(engine, R, _signature_body, "asp")
    assert got[0][-1] == [] and got[1][-1] == [], got  # the next call, signed alike: right
    for case, (argument, field) in enumerate((("num_max_dispatch_tokens_per_rank", "capacity"),
                                              ("x", "dtype"))):
        outs = [out[case] for out in got]
        # a rank that found the difference names it; a peer may have seen its notice first
        # (a clean RemoteError carrying it)
        assert any(o[0] == "bad" for o in outs), outs
        for r, o in enumerate(outs):
            if o[0] == "bad":
                assert o[1] == argument and f"{field} " in o[2] and f"on rank {1 - r}" in o[2]
            else:
                assert o[0] == "RemoteError" and "differs" in o[1], o
    caps = [o[2] for o in (out[0] for out in got) if o[0] == "bad"]
    assert any("capacity 16 on rank 1" in c or "16 on rank 1" in c for c in caps), caps


@pytest.mark.parametrize("engine", ["shm", "mpi"])
def test_signatures_that_differ_under_bsp_lose_step_and_resync(engine: str) -> None:
    got = run(engine, R, _signature_body, "bsp")
    for out in got:
        assert all(o != "no error" for o in out[:2]) and out[-1] == [], out


def _lost_peer_body(group: Any) -> Any:
    with Buffer(group, _config(group, ("asp", "dc", "expert", None), timeout_s=20.0)) as buf:
        xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, 9, "uniform")
        assert testing.check_call(buf, xs, idxs, ws, 9) == []
        group.barrier(20.0)
        if group.rank == 1:
            return die(group)
        t0 = time.monotonic()
        try:
            buf.dispatch(xs[0], idxs[0], ws[0])
            return "no error"
        except PeerLostError:
            lost = "peer lost"
        try:  # the Buffer refuses every later call, at once
            buf.dispatch(xs[0], idxs[0], ws[0])
            return "served after a loss"
        except PeerLostError:
            return lost, time.monotonic() - t0 < 15.0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_lost_peer_fails_the_survivors_calls(engine: str) -> None:
    got = run(engine, R, _lost_peer_body, lossy=True)
    assert isinstance(got[1], LostRank)
    assert got[0] == ("peer lost", True)


def _resync_body(group: Any, mode: Mode, timeout_s: float) -> list[Any]:
    """Rank 1 skips a dispatch: rank 0's times out and the Buffer refuses calls; after resync
    on both, calls are bit-exact again and a handle of before is refused."""
    r, out = group.rank, []
    with Buffer(group, _config(group, mode, timeout_s=timeout_s)) as buf:
        xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, 10, "uniform")
        old = buf.dispatch(xs[r], idxs[r], ws[r])
        group.barrier(30.0)
        if r == 0:
            try:
                buf.dispatch(xs[r], idxs[r], ws[r])
                out.append("no error")
            except TimeoutError:
                out.append("timeout")
            try:
                buf.dispatch(xs[r], idxs[r], ws[r])
            except OutOfStepError:
                out.append("out of step")
        group.barrier(30.0)
        buf.resync(30.0)
        out.append(testing.check_call(buf, xs, idxs, ws, 10))
        try:
            buf.combine(old.recv_x, old.handle)
            out.append("old handle taken")
        except InvalidArgumentError as exc:
            out.append(exc.argument)
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_resync_after_a_lost_step(engine: str) -> None:
    # the Triton engine runs ASP only, and its calls' waits under the interpreter take far
    # longer than a native engine's: a deadline its ordinary calls never reach, even loaded
    mode, timeout_s = (("asp", "tff", "rank", None), 10.0) if engine == "triton" else (
        ("bsp", "tff", "rank", None), 3.0)
    got = run(engine, R, _resync_body, mode, timeout_s)
    assert got == [["timeout", "out of step", [], "handle"], [[], "handle"]]
