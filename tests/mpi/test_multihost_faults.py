"""Network faults across namespaced hosts (tests/mpi/netns.py), each under
``on_peer_loss="raise"`` and ``"mask"`` (with the quorum, ``ubep.mpi.quorum``).

3 hosts x 1 rank, ``mpiexec --with-ft ulfm`` with Open MPI's heartbeat detector; the last host
is the victim. The fault strikes while the other ranks are inside a dispatch or a combine
(tests/mpi/_fault_worker.py waits for it):

* ``cut``: the victim host's link goes down (a partition: 2 ranks on one side, 1 on the other),
  and comes back up once every rank has reported; the hosts then run a new job, bit-exact;
* ``kill``: the victim host's ranks are SIGKILLed;
* ``stop``: the victim host's ranks are SIGSTOPped, continued once the others reported.

What every run must show: every call a rank completed, the one in flight at the fault
included, is bit-exact for the mask that rank reported after it; a rank that raised did so
within its bound; under ``raise`` nobody serves past the fault; under ``mask`` at most one side
serves on, and only the quorum side (the two ranks that hold more than half); the victim
never serves past the fault; nothing is left in any host's ``/dev/shm``.

A slow or lossy link (``tc netem``) runs where the kernel has the ``netem`` qdisc; it is skipped,
saying so, where it does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mpi import netns
from tests.mpi.multihost import MakeBed, no_shm_left, run_job, wait_for
from tests.mpi.test_mpi import DETECTOR, DETECTOR_TIMEOUT_S

pytestmark = pytest.mark.mpi

TIMEOUT_S = 2 * DETECTOR_TIMEOUT_S  # the Buffers' deadline: the detector reports a loss first
CALLS, FAULT_CALL = 6, 2
MARGIN_S = 6.0  # MPI's progress and the watchdog's grace on a loaded 2-core host
# a loss under "raise": one deadline; under "mask": the call's deadline, then the agreement
# (bounded by two deadlines), the rebuild and the call again
BOUND_S = {"raise": TIMEOUT_S + MARGIN_S, "mask": 3 * TIMEOUT_S + MARGIN_S}
LOSS_ERRORS = {"PeerLostError", "TimeoutError", "RemoteError", "RankMaskedError",
               "NoQuorumError", "CallLostError", "OutOfStepError"}


def _records(out: Path, ranks: list[int]) -> dict[int, Any]:
    return {r: json.loads((out / f"rec.{r}.json").read_text()) for r in ranks
            if (out / f"rec.{r}.json").exists()}


def run_fault(bed: netns.HostBed, tmp_path: Path, fault: str, policy: str, phase: str,
              mode: str = "asp:dc:expert", per_host: int = 1,
              extra_env: dict[str, str] | None = None) -> dict[int, Any]:
    """One job with one fault (module docstring) on ``per_host`` ranks per host, the last
    host's the victims; every rank's record that was written."""
    num_ranks = per_host * len(bed.hosts)
    victim_ranks = list(range(num_ranks - per_host, num_ranks))
    out = tmp_path / "job"
    out.mkdir()
    victim_host = bed.hosts[-1]
    engine, sync, layout = mode.split(":")
    env = {"UBEP_TEST_POLICY": policy, "UBEP_TEST_CALLS": str(CALLS),
           "UBEP_TEST_FAULT_CALL": str(FAULT_CALL), "UBEP_TEST_FAULT_AT": phase,
           "UBEP_TEST_VICTIMS": ",".join(map(str, victim_ranks)), "UBEP_TEST_ENGINE": engine,
           "UBEP_TEST_SYNC": sync, "UBEP_TEST_LAYOUT": layout,
           "UBEP_TEST_TIMEOUT_S": str(TIMEOUT_S)} | (extra_env or {})
    victims: list[int] = []

    def strike(proc: subprocess.Popen[str]) -> None:
        try:
            _strike(proc)
        except AssertionError as exc:  # a stalled job: say where every rank was
            for f in out.glob("stack.*"):  # the workers only: SIGUSR1 would end mpiexec
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(f.name.split(".")[1]), signal.SIGUSR1)
            time.sleep(1.0)
            dumps = "".join(f.read_text()[-3000:] for f in out.glob("stack.*"))
            recs = _records(out, list(range(num_ranks)))  # a rank that stopped early says why
            raise AssertionError(f"{exc}\n--- records\n{recs}\n--- stacks\n{dumps}") from None

    def _strike(proc: subprocess.Popen[str]) -> None:
        for r in range(num_ranks):
            wait_for(out / f"at.{r}", 120, proc)
        victims.extend(json.loads((out / f"at.{r}").read_text())["pid"] for r in victim_ranks)
        time.sleep(0.5)  # the others are inside the call, waiting for the victims' rows
        if fault == "cut":
            bed.cut(victim_host)
        elif fault in ("kill", "stop"):
            for pid in victims:
                os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        (out / "go").write_text("")
        for r in range(num_ranks - per_host):
            wait_for(out / f"rec.{r}.json", 120, proc)
        if fault == "stop":
            for pid in victims:
                os.kill(pid, signal.SIGCONT)
        if fault in ("cut", "stop"):
            for r in victim_ranks:
                wait_for(out / f"rec.{r}.json", 3 * TIMEOUT_S + 60, None)
        if fault == "cut":
            bed.heal(victim_host)

    try:
        _code, output = run_job(bed, per_host, ["-m", "tests.mpi._fault_worker", str(out)], env=env,
                               mca=DETECTOR, ft=True, timeout_s=240, while_running=strike)
    finally:
        bed.heal(victim_host)
        for pid in victims:  # a stopped victim must not outlive the test
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    got = _records(out, list(range(num_ranks)))
    assert all(r in got for r in range(num_ranks - per_host)), output[-4000:]
    return got


def check_fault(got: dict[int, Any], fault: str, policy: str) -> None:
    """The invariants of the module docstring, on the records of one run."""
    for r, rec in got.items():
        assert rec["errors"] == [], (r, rec["errors"][:5])  # every completed call bit-exact
        raised = rec["raised"]
        if raised is not None:
            assert raised["type"] in LOSS_ERRORS, (r, raised)
            assert raised["elapsed_s"] <= BOUND_S[policy], (r, raised)
            if r == 2:
                continue
            assert raised["call"] >= FAULT_CALL, (r, raised)  # nothing failed before the fault
    victim = got.get(2)
    if victim is not None:  # the victim never serves past the fault
        assert len(victim["calls"]) <= FAULT_CALL + (fault != "kill"), victim
        assert victim["raised"] is not None, victim
        assert len(victim["calls"]) == FAULT_CALL or victim["calls"][-1]["mask"] == [], victim
    serving = [r for r in (0, 1) if got[r]["raised"] is None]
    if policy == "raise":
        assert serving == [], {r: got[r]["raised"] for r in (0, 1)}
        return
    # mask: the two ranks hold the quorum (2 of 3): both serve on with the victim masked
    assert serving == [0, 1], {r: got[r]["raised"] for r in (0, 1)}
    assert got[0]["calls"] == got[1]["calls"]
    assert [c["mask"] for c in got[0]["calls"]][-1] == [2]
    assert len(got[0]["calls"]) == CALLS
    if fault == "cut" and victim is not None:  # the minority side raises, naming the quorum
        assert victim["raised"]["type"] == "NoQuorumError", victim
        assert "quorum" in victim["raised"]["message"], victim


_DEFAULT_RUN = {("cut", "dispatch", "raise"), ("cut", "dispatch", "mask"),
                ("kill", "dispatch", "mask"), ("stop", "combine", "mask")}
_MODES = ["asp:dc:expert", "bsp:sw:rank", "asp:tff:rank"]


def _fault_cases() -> list[Any]:
    """Each fault x phase x policy x mode; the default run keeps four of ASP/DC (the rest:
    ``pytest -m matrix``)."""
    cases = []
    for fault in ("cut", "kill", "stop"):
        for phase in ("dispatch", "combine"):
            for policy in ("raise", "mask"):
                for mode in _MODES:
                    default = mode == _MODES[0] and (fault, phase, policy) in _DEFAULT_RUN
                    marks = () if default else (pytest.mark.matrix,)
                    cases.append(pytest.param(fault, phase, policy, mode, marks=marks,
                                              id=f"{fault}-{phase}-{policy}-{mode}"))
    return cases


@pytest.mark.parametrize(("fault", "phase", "policy", "mode"), _fault_cases())
def test_fault_across_hosts(make_bed: MakeBed, tmp_path: Path, fault: str, phase: str,
                            policy: str, mode: str) -> None:
    bed = make_bed(3)
    got = run_fault(bed, tmp_path, fault, policy, phase, mode)
    check_fault(got, fault, policy)
    no_shm_left(bed)
    if fault == "cut":
        _healed_serves(bed, tmp_path, 1)


def _healed_serves(bed: netns.HostBed, tmp_path: Path, per_host: int) -> None:
    """After a healed cut the hosts serve a new job bit-exact."""
    out = tmp_path / "after.json"
    code, output = run_job(bed, per_host, ["-m", "ubep.tools.mpi_selftest", "--modes",
                                           "asp:dc:expert:bf16,bsp:sw:rank:bf16", "--json",
                                           str(out)], timeout_s=120)
    assert code == 0, output[-4000:]
    assert all(f["errors"] == [] for f in json.loads(out.read_text()))
    no_shm_left(bed)


@pytest.mark.parametrize(("min_live_ranks", "serving"), [
    (None, []), pytest.param("2", [0, 1, 2, 3], marks=pytest.mark.matrix)])
def test_an_even_partition_serves_on_neither_side_without_a_quorum(
        make_bed: MakeBed, tmp_path: Path, min_live_ranks: str | None,
        serving: list[int]) -> None:
    """2 hosts x 2 ranks, the link between them cut mid-dispatch, ``on_peer_loss="mask"``:
    each side holds 2 of 4 ranks, not more than half, so neither serves (every rank raises
    ``NoQuorumError``). With ``min_live_ranks=2`` both sides serve, each bit-exact for its own
    mask: the split brain the default quorum rules out."""
    bed = make_bed(2)
    env = {} if min_live_ranks is None else {"UBEP_TEST_MIN_LIVE_RANKS": min_live_ranks}
    got = run_fault(bed, tmp_path, "cut", "mask", "dispatch", per_host=2, extra_env=env)
    assert sorted(got) == [0, 1, 2, 3]
    for r, rec in got.items():
        assert rec["errors"] == [], (r, rec["errors"][:5])
        if r in serving:
            assert rec["raised"] is None, (r, rec["raised"])
            other = [2, 3] if r < 2 else [0, 1]
            assert rec["calls"][-1]["mask"] == other and len(rec["calls"]) == CALLS
        else:
            assert rec["raised"]["type"] == "NoQuorumError", (r, rec["raised"])
            assert "2 of 4" in rec["raised"]["message"], rec["raised"]
            assert rec["raised"]["elapsed_s"] <= BOUND_S["mask"], (r, rec["raised"])
            assert len(rec["calls"]) == FAULT_CALL
    no_shm_left(bed)
    _healed_serves(bed, tmp_path, 2)


def test_a_slow_lossy_link_stays_bit_exact(make_bed: MakeBed, tmp_path: Path) -> None:
    """2 hosts x 1 rank, the second host's link delayed 20 ms +- 5 ms and dropping 1 % of its
    packets (``tc netem``; TCP retransmits): every engine x sync x layout stays bit-exact.
    Skipped where the kernel has no ``netem`` qdisc."""
    bed = make_bed(2)
    reason = bed.netem(bed.hosts[1], ["delay", "20ms", "5ms", "loss", "1%"])
    if reason:
        pytest.skip(reason)
    out = tmp_path / "netem.json"
    code, output = run_job(bed, 1, ["-m", "ubep.tools.mpi_selftest", "--json", str(out)],
                           env={"UBEP_TIMEOUT_S": "120"}, timeout_s=400)
    assert code == 0, output[-4000:]
    assert all(f["errors"] == [] and len(f["modes"]) == 12 for f in json.loads(out.read_text()))
    no_shm_left(bed)


SOAK_ROUNDS = 20
_SOAK_CASES = [("cut", "dispatch", "mask"), ("cut", "combine", "raise"),
               ("kill", "dispatch", "mask"), ("stop", "combine", "mask")]


@pytest.fixture(scope="module")
def busy_loop() -> Iterator[None]:
    """One process spinning on a core for the whole soak (a host that is not idle)."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spin.kill()
    spin.wait()


@pytest.mark.matrix
@pytest.mark.parametrize("round_", range(SOAK_ROUNDS))
@pytest.mark.parametrize(("fault", "phase", "policy"), _SOAK_CASES)
def test_fault_soak_beside_a_busy_loop(busy_loop: None, make_bed: MakeBed, tmp_path: Path,
                                       fault: str, phase: str, policy: str,
                                       round_: int) -> None:
    """Each default fault case 20 times in a row beside a busy loop, every invariant checked
    each time (``pytest -m matrix -x -k soak``)."""
    bed = make_bed(3)
    got = run_fault(bed, tmp_path, fault, policy, phase)
    check_fault(got, fault, policy)
    no_shm_left(bed)
