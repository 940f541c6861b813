"""The peers of benchmarks/peers/run.py compute exactly what ubep.reference computes.

Correctness only (timing lives in benchmarks/): the MPI/gloo dispatch and combine the benchmark
races against ubep must return the reference's rows, metadata and combined outputs bit for bit,
so the comparison is of the same work. Two levels:

* in process: the numpy kernels (benchmarks/peers/kernels.py) over a thread-backed all-to-all,
  1, 2 and 4 ranks, both layouts, masked slots, a rank with no tokens, BF16 and 1-byte payloads;
  the torch kernels (benchmarks/peers/torch_kernels.py) likewise at 1 and 4 ranks;
* for real: each peer (Intel MPI, OpenMPI, MPICH via mpi4py; torch.distributed gloo) run by the
  benchmark's own launcher in its own venv at 4 ranks, every local-work variant it runs (torch
  and numpy). Skipped, with the reason, where that venv cannot be built (no registry, no torch
  wheel on disk).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.harness import Stats
from benchmarks.peers import check, workload
from benchmarks.peers import report as peers
from benchmarks.peers.env import PeerEnvError, ensure_env
from benchmarks.peers.kernels import decode_fields, make_peer

NUM_EXPERTS = workload.NUM_EXPERTS


class ThreadExchange:
    """An all-to-all between threads of one process: every rank posts, all read, all move on."""

    def __init__(self, shared: dict[str, Any], rank: int) -> None:
        self.shared = shared
        self.rank = rank
        self.num_ranks = int(shared["num_ranks"])

    def _post(self, item: object) -> list[Any]:
        self.shared["slots"][self.rank] = item
        self.shared["barrier"].wait()
        got = list(self.shared["slots"])
        self.shared["barrier"].wait()  # nobody overwrites a slot before everyone has read it
        return got

    def alltoall_counts(self, send: np.ndarray) -> np.ndarray:
        return np.stack([blocks[self.rank] for blocks in self._post(np.array(send))])

    def alltoallv_rows(
        self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray, recv_counts: np.ndarray
    ) -> None:
        starts = np.concatenate([[0], np.cumsum(send_counts)])
        pos = 0
        for src, (buf, st) in enumerate(self._post((send.copy(), starts))):
            block = buf[st[self.rank] : st[self.rank + 1]]
            assert len(block) == recv_counts[src], "receiver expected another row count"
            recv[pos : pos + len(block)] = block
            pos += len(block)

    def barrier(self) -> None:
        self.shared["barrier"].wait()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        return np.maximum.reduce(self._post(values.copy()))


_check_inputs = check.check_inputs
_expected = check.expected


def _assert_same(got: dict[str, np.ndarray], ref: Any, ref_y: np.ndarray, where: str) -> None:
    try:
        check.assert_same(got, ref, ref_y, where)
    except check.PeerCheckError as exc:
        pytest.fail(str(exc))


def _run_threads(
    inp: workload.Inputs, layout: str, variant: str = "numpy"
) -> list[dict[str, np.ndarray]]:
    num_ranks = len(inp.xs)
    shared: dict[str, Any] = {
        "num_ranks": num_ranks, "slots": [None] * num_ranks,
        "barrier": threading.Barrier(num_ranks, timeout=30),
    }
    outs: list[dict[str, np.ndarray]] = [{} for _ in range(num_ranks)]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            arrays = workload.peer_arrays(inp, r)  # FP8: the packed rows, and x_bf16
            x = arrays["x_bf16"] if variant == "torch+q" else arrays["x"]
            kw: dict[str, Any] = {
                "num_experts": NUM_EXPERTS, "num_topk": 8,
                "max_tokens": max(x.shape[0] for x in inp.xs), "hidden": inp.shape.hidden,
                "x_dtype": x.dtype, "out_dtype": inp.expert_outs[layout][r].dtype,
                "x_width": x.shape[1],
            }
            ex = ThreadExchange(shared, r)
            if variant == "torch+q":
                from benchmarks.peers.torch_kernels import make_torch_quantising_peer

                peer: Any = make_torch_quantising_peer(layout, ex, **kw)
            elif variant == "torch":
                from benchmarks.peers.torch_kernels import make_torch_peer

                peer = make_torch_peer(layout, ex, **kw)
            else:
                peer = make_peer(layout, ex, **kw)
            args = peer.prepare(x, inp.topk_idxs[r], inp.topk_weights[r])
            (expert_out,) = peer.prepare(inp.expert_outs[layout][r])
            for _ in range(2):  # a second call reuses the buffers: results must not change
                d = peer.dispatch(*args)
                out = decode_fields(d, layout, r, 8)
                out["recv_x"] = d.recv_x.copy()
                out["num_recv_tokens_per_expert"] = np.asarray(d.num_recv_tokens_per_expert)
                out["combined"] = np.array(peer.combine(expert_out), copy=True)
            outs[r] = out
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return outs


@pytest.mark.parametrize("layout", peers.LAYOUTS)
@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_kernels_match_reference_in_process(num_ranks: int, layout: str) -> None:
    for inp in _check_inputs(num_ranks):
        ref, ref_y = _expected(inp, layout)
        outs = _run_threads(inp, layout)
        for r in range(num_ranks):
            _assert_same(outs[r], ref[r], ref_y[r], f"{layout} rank {r}/{num_ranks}")


@pytest.mark.torch
@pytest.mark.parametrize("layout", peers.LAYOUTS)
@pytest.mark.parametrize("num_ranks", [1, 4])
def test_torch_kernels_match_reference_in_process(num_ranks: int, layout: str) -> None:
    pytest.importorskip("torch")
    for inp in _check_inputs(num_ranks):
        ref, ref_y = _expected(inp, layout)
        # FP8: the rows the caller quantised, and the peer that quantises in torch ops itself
        for variant in ("torch", "torch+q") if inp.shape.quantised else ("torch",):
            outs = _run_threads(inp, layout, variant=variant)
            for r in range(num_ranks):
                _assert_same(outs[r], ref[r], ref_y[r], f"{variant} {layout} rank {r}/{num_ranks}")


def test_check_sets_cover_fp8_with_a_zero_block() -> None:
    # The FP8 check set: BF16 tokens, more than one scale block, and a block of zeros (the
    # floor scale), on ranks that have tokens.
    (inp,) = [i for i in _check_inputs(4) if i.shape.quantised]
    assert inp.shape.hidden % 128 == 0 and inp.shape.hidden > 128
    assert all(x.dtype == np.uint16 for x in inp.xs)
    assert all(not x[0, :128].any() for x in inp.xs if len(x))


@pytest.mark.torch
def test_torch_fp8_quantiser_equals_ubep_quant() -> None:
    pytest.importorskip("torch")
    from benchmarks.peers.torch_kernels import TorchFp8Quantiser, as_torch
    from ubep import quant

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((37, 512), dtype=np.float32) * 30).astype(np.float32)
    x[3, 128:256] = 0  # the floor scale
    x[5, :128] *= 1e-7  # amax under the floor
    x[6, 0] = 1e30  # one huge element: the rest of its block rounds to (signed) zero
    x[7] = -x[7]
    bf16 = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    q = TorchFp8Quantiser(64, 512)
    packed = q(as_torch(bf16)).numpy()
    values, scales = quant.quantize(bf16, "e4m3")
    assert packed.shape == (37, quant.row_bytes(512))
    assert np.array_equal(packed[:, :512], values)
    assert np.array_equal(packed[:, 512:].copy().view(np.float32).view(np.uint32),
                          scales.view(np.uint32))
    assert np.array_equal(workload.pack_fp8(bf16), packed)


# Open MPI (ubep's own MPI) and gloo (torch.distributed) by default; the other two MPIs, each
# a peer environment of its own to build, with ``pytest -m matrix``
PEERS = [
    pytest.param("impi", marks=(pytest.mark.mpi, pytest.mark.matrix)),
    pytest.param("openmpi", marks=pytest.mark.mpi),
    pytest.param("mpich", marks=(pytest.mark.mpi, pytest.mark.matrix)),
    pytest.param("gloo", marks=pytest.mark.torch),
]


@pytest.mark.slow
@pytest.mark.parametrize("system", PEERS)
def test_peer_matches_reference(system: str, tmp_path: Path) -> None:
    try:
        ensure_env(system, quiet=True)
    except PeerEnvError as exc:
        pytest.skip(f"{system} environment cannot be built here: {exc}")
    # The benchmark's own pre-timing check (benchmarks/peers/check.py): every variant's rows,
    # metadata and combine output against ubep.reference, at 4 ranks.
    try:
        variants = check.check_peer(system, 4, tmp_path)
    except check.PeerCheckError as exc:
        pytest.fail(str(exc))
    # Every peer venv has torch (benchmarks/peers/env.py): both local-work variants ran, and
    # on the FP8 check set the one that quantises in torch ops.
    assert variants == ["torch", "numpy", "torch+q"]


@pytest.mark.parametrize("layout", peers.LAYOUTS)
def test_byte_formula_counts_reference_rows(layout: str) -> None:
    # Rows rank s sends = rows, over all receivers, whose reference source is s.
    for inp in _check_inputs(4):
        ref, _ = _expected(inp, layout)
        want = [sum(int((res.recv_src_rank == s).sum()) for res in ref) for s in range(4)]
        assert workload.rows_sent(inp, layout).tolist() == want
        h = inp.shape.hidden
        # FP8 rows: h E4M3 values + h/128 float32 scales
        per_row = {"bf16": 2 * h, "uint8": h, "fp8": h + 4 * (h // 128)}[inp.shape.dtype]
        mean_bytes = np.mean(want) * per_row
        assert workload.bytes_per_rank(inp, layout, "dispatch") == pytest.approx(mean_bytes)
        assert workload.bytes_per_rank(inp, layout, "combine") == pytest.approx(
            np.mean(want) * inp.shape.hidden * 2  # the benchmark combines in BF16
        )


def test_table_ratios_use_fastest_mpi_variant_and_floor() -> None:
    shape = workload.Shape(2, 128, 2048, "bf16", "uniform")
    # The fastest MPI variant is openmpi with numpy local work (200); a bare peer name is an
    # exchange-alone row and never counts as an MPI variant.
    medians = {"impi-torch": 300.0, "openmpi-torch": 250.0, "openmpi-numpy": 200.0,
               "mpich-numpy": 400.0, "gloo-torch": 150.0, "memcpy": 50.0}
    rows = [
        peers.Row(s, "rank", shape, "dispatch", 1e6, Stats(m * 0.9, m, m * 1.5, 5))
        for s, m in medians.items()
    ]
    cells = {c[2]: c for c in peers.table_rows(rows)}
    col = {name: i for i, name in enumerate(peers.TABLE_COLUMNS)}
    for system, med in medians.items():
        assert cells[system][col["ratio_vs_best_mpi"]] == pytest.approx(med / 200.0)
        assert cells[system][col["ratio_vs_floor"]] == pytest.approx(med / 50.0)
        assert cells[system][col["algbw_gbps"]] == pytest.approx(1e6 / (med * 1e3))


def test_floor_report_compares_against_the_fastest_variant() -> None:
    shape = workload.Shape(2, 128, 2048, "bf16", "uniform")
    medians = {"ubep-asp-sp": 55.0, "impi-torch": 100.0, "impi-numpy": 150.0,
               "openmpi-numpy": 120.0, "openmpi-torch": 90.0, "mpich-torch": 300.0,
               "gloo-numpy": 500.0, "gloo-torch": 400.0,
               "openmpi": 20.0, "gloo": 10.0}  # exchange-alone rows: not variants
    rows = [
        peers.Row(s, "rank", shape, op, 1e6, Stats(m, m, m, 3))
        for s, m in medians.items() for op in peers.OPS
    ]
    report = peers.floor_report(rows, [shape]).splitlines()
    by_name = {line.split("  ubep")[0].strip(): line.split() for line in report[2:]}
    # Best MPI is openmpi-torch (90): 55/90 = 0.61 > 0.6 fails; gloo's best is 400:
    # 55/400 = 0.1375 > 0.12 fails too.
    assert by_name["dispatch vs best MPI"][-1] == "FAIL"
    assert float(by_name["dispatch vs best MPI"][-3]) == pytest.approx(55 / 90, abs=1e-3)
    assert float(by_name["dispatch vs gloo"][-3]) == pytest.approx(55 / 400, abs=1e-3)
    assert by_name["dispatch vs gloo"][-1] == "FAIL"
    faster = [replace(r, stats=Stats(45.0, 45.0, 45.0, 3)) if r.system == "ubep-asp-sp" else r
              for r in rows]
    report = peers.floor_report(faster, [shape]).splitlines()
    verdicts = {line.split("  ubep")[0].strip(): line.split()[-1] for line in report[2:]}
    assert verdicts == {
        "dispatch vs best MPI": "PASS",  # 45/90 = 0.5 <= 0.6
        "dispatch vs gloo": "PASS",  # 45/400 = 0.11
        "combine vs best MPI": "PASS",  # 0.5 <= 0.5
        "combine vs gloo": "PASS",
    }


def test_quantising_rows_are_compared_with_quantising_mpi_rows() -> None:
    shape = workload.Shape(2, 128, 2048, "fp8", "uniform")
    medians = {"ubep-asp-sw": 40.0, "ubep-asp-sw+q": 60.0, "openmpi-torch": 100.0,
               "openmpi-torch+q": 300.0, "mpich-torch+q": 250.0}
    rows = [peers.Row(s, "rank", shape, "dispatch", 1e6, Stats(m, m, m, 3))
            for s, m in medians.items()]
    col = peers.TABLE_COLUMNS.index("ratio_vs_best_mpi")
    ratio = {c[2]: c[col] for c in peers.table_rows(rows)}
    assert ratio["ubep-asp-sw"] == pytest.approx(40 / 100)
    assert ratio["ubep-asp-sw+q"] == pytest.approx(60 / 250)
    assert ratio["openmpi-torch+q"] == pytest.approx(300 / 250)


def test_fp8_report_ratios_against_bf16_of_the_same_shape() -> None:
    fp8 = workload.Shape(2, 128, 2048, "fp8", "uniform")
    bf16 = replace(fp8, dtype="bf16")
    rows = [
        peers.Row("ubep-asp-sw", "rank", fp8, "dispatch", 520.0, Stats(30, 30, 30, 3)),
        peers.Row("ubep-bsp-sw", "rank", fp8, "dispatch", 520.0, Stats(20, 20, 20, 3)),
        peers.Row("ubep-asp-sw+q", "rank", fp8, "dispatch", 520.0, Stats(45, 45, 45, 3)),
        peers.Row("ubep-asp-sp", "rank", bf16, "dispatch", 1000.0, Stats(50, 50, 50, 3)),
        peers.Row("ubep-asp-sw", "rank", bf16, "dispatch", 1000.0, Stats(80, 80, 80, 3)),
    ]
    lines = peers.fp8_report(rows).splitlines()
    ubep = next(line.split() for line in lines if "caller-quantised" in line)
    # fastest fp8 ubep row (bsp-sw, 20) over the fastest bf16 ubep row (asp-sp, 50)
    assert "ubep-bsp-sw" in ubep and "ubep-asp-sp" in ubep
    assert float(ubep[-2]) == pytest.approx(0.52) and float(ubep[-1]) == pytest.approx(0.4)
    engine = next(line.split() for line in lines if "engine quantises" in line)
    assert float(engine[-1]) == pytest.approx(45 / 50)


def test_transport_names() -> None:
    assert peers.transport("openmpi-torch") == "openmpi"
    assert peers.transport("gloo-numpy") == "gloo"
    assert peers.transport("ubep-asp-sp") == "ubep-asp-sp"
    assert peers.transport("mpich-torch+q") == "mpich"
    assert peers.is_mpi("mpich-torch+q") and peers.quantises("mpich-torch+q")
    assert peers.quantises("ubep-bsp-dc+q") and not peers.quantises("ubep-bsp-dc")
    assert peers.is_mpi("impi-numpy") and not peers.is_mpi("impi")
    assert not peers.is_mpi("gloo-torch")


@pytest.mark.torch
def test_shared_layer_holds_torch_and_numpy_but_no_mpi(tmp_path: Path) -> None:
    # Peer venvs read this layer after their own site-packages: it gives them this
    # interpreter's torch and numpy, and never its MPI wheel, mpi4py or ubep (each peer loads
    # its own MPI and never imports ubep).
    import importlib.metadata as md

    from benchmarks.peers import shared_layer

    torch = pytest.importorskip("torch")
    layer = shared_layer.layer_for(tmp_path)
    if torch.__version__ != shared_layer.SHARED["torch"]:
        assert layer is None
        return
    assert layer is not None
    assert (layer / "torch").resolve() == Path(torch.__file__).resolve().parent
    assert (layer / "numpy").resolve() == Path(np.__file__).resolve().parent
    for name in ("mpi4py", "openmpi", "ubep"):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        assert not shared_layer.top_level_entries(dist) & {p.name for p in layer.iterdir()}
    # every entry is a symlink that resolves: nothing was copied, nothing dangles
    assert all(p.is_symlink() and p.exists() for p in layer.iterdir())
