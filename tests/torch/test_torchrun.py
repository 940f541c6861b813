"""ubep under a real ``torchrun`` (``python -m torch.distributed.run --standalone``: a free port).

Two jobs run tests/torch/_torchrun_worker.py as a module (4 ranks; 2 ranks, which also runs the
example's check),
and the tests compare what the ranks saved with single-process oracles: ``ubep.reference`` bit
for bit, the eager Hugging Face model for generate(). A job costs seconds (process start-up and
``import torch``), so each one covers several checks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import ubep.trace  # noqa: E402
from tests.torch import _torchrun_worker as worker  # noqa: E402
from ubep import reference  # noqa: E402
from ubep.testing import FIELDS, bits  # noqa: E402
from ubep.torch.group import _SLOT_BYTES  # noqa: E402
from ubep.trace.recorder import WORK_LABEL  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.torch._torchrun_worker"  # run with ``-m`` from REPO_ROOT
JOB_TIMEOUT_S = 180.0


def _torchrun(nproc: int, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc-per-node nproc -m module args`` to completion."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", module, *args]
    # One BLAS/OpenMP thread per rank: ranks outnumber cores, and nothing here may depend on it.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True, cwd=REPO_ROOT)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the job's own session: torchrun and its ranks
        out, err = proc.communicate()
        pytest.fail(f"torchrun job did not finish in {JOB_TIMEOUT_S}s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _ok(job: subprocess.CompletedProcess[str]) -> None:
    assert job.returncode == 0, f"torchrun failed ({job.returncode}):\n{job.stderr[-4000:]}"


def _check_dispatch(out: Path, tag: str, num_ranks: int, seed: int) -> None:
    """Every rank's saved dispatch fields and combine output equal ubep.reference's bits."""
    for case, (layout, _, _) in enumerate(worker.CASES):
        xs, idxs, ws = worker.case_inputs(case, num_ranks, seed)
        ref = reference.dispatch(xs, idxs, ws, worker.EXPERTS_PER_RANK * num_ranks,
                                 layout=layout)
        outs = [worker.expert_outputs(case, ref[r].recv_x, seed * 100 + r)
                for r in range(num_ranks)]
        ys = reference.combine(outs, ref)
        for r in range(num_ranks):
            got = np.load(out / f"{tag}.{r}.npz")
            for f in FIELDS:
                want = np.asarray(getattr(ref[r], f))
                a = got[f"{case}.{f}"]
                assert a.dtype == want.dtype and a.shape == want.shape, (tag, case, r, f)
                assert np.array_equal(bits(a), bits(want)), (tag, case, r, f)
            assert np.array_equal(bits(got[f"{case}.y"]), bits(ys[r])), (tag, case, r, "y")


@pytest.fixture(scope="module")
def four_rank_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-rank job: the world group, two EP groups at once, and a traced DeepEP-style step."""
    out = tmp_path_factory.mktemp("four_rank_job")
    _ok(_torchrun(4, WORKER, "dispatch,subgroups,trace", str(out)))
    return out


def test_world_of_4_and_two_ep_groups_of_2_dispatching_at_once(four_rank_job: Path) -> None:
    _check_dispatch(four_rank_job, "world", 4, seed=1)
    # Group {0, 2} and group {1, 3}: files are named by *group* rank, inputs seeded per group.
    _check_dispatch(four_rank_job, "sub0", 2, seed=10)
    _check_dispatch(four_rank_job, "sub1", 2, seed=11)


def test_one_line_traces_a_deepep_step_into_one_file_with_every_rank_and_group(
        four_rank_job: Path) -> None:
    """``with ubep.trace.record("step.json")`` around a DeepEP-style step on 4 ranks: one merged
    file (the rank files gone) with every rank's cores and tasks, the facade's world group and
    each EP subgroup its own trace (named by its world ranks), a flow from every send to
    another rank landing on that rank; the calls inside stayed right (closed form, reference)."""
    out = four_rank_job
    assert not list(out.glob("step.rank*.json"))
    data = json.loads((out / "step.json").read_text())
    events = data["traceEvents"]
    for e in events:  # the trace event format's required fields
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], float | int) and e["dur"] >= 0, e
    traces = {t.label: t for t in ubep.trace.load(out / "step.json")}
    world = [t for label, t in traces.items()
             if "world ranks" not in label and label != WORK_LABEL]
    assert len(world) == 1 and world[0].label.startswith("deep_ep normal ("), sorted(traces)
    # the facade's own Python work: a named span per call, on each world rank
    for r in range(4):
        assert sorted(c.name for c in traces[WORK_LABEL].calls if c.rank == r) == [
            "deep_ep.combine", "deep_ep.dispatch", "deep_ep.get_dispatch_layout"]
    for members in ("0,2", "1,3"):
        subs = [t for label, t in traces.items() if label.endswith(f" world ranks {members}")]
        assert len(subs) == len(worker.CASES), sorted(traces)  # a Buffer per case
        assert all(t.ranks() == [0, 1] for t in subs)
    facade = world[0]
    assert facade.ranks() == [0, 1, 2, 3]
    for r in range(4):
        # the step's rows out and back; its combine's topk_weights are the ones the dispatch
        # received, so each source sums its own (deep_ep_agree.own_weights_sum): no third call
        assert sorted(c.name for c in facade.calls if c.rank == r) == ["combine", "dispatch"]
        tasks = {s.task for s in facade.spans if s.rank == r}
        assert {"send", "reduce"} <= tasks, (r, tasks)
    # flows: every send to another rank of the facade's trace lands on that rank's process
    pid_of = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    rank_of = {pid_of[f"{facade.label} (runtime) rank {r}"]: r for r in range(4)}
    flows = [e for e in events if e.get("cat") == "flow"]
    ends = {e["id"]: e["pid"] for e in flows if e["ph"] == "f"}
    starts = {e["id"]: e["pid"] for e in flows if e["ph"] == "s" and e["pid"] in rank_of}
    landed = Counter((rank_of[starts[i]], rank_of[ends[i]]) for i in starts)
    sent = Counter((s.rank, s.peer) for s in facade.spans if s.task == "send" and s.peer != s.rank
                   and s.rows > 0)
    assert sent and {k: v for k, v in landed.items() if k[0] != k[1]} == sent
    # identity experts, unit weights: a token comes back as its row times the ranks it visited
    experts_per_rank = worker.EXPERTS_PER_RANK
    for r in range(4):
        x, topk_idx = worker.trace_inputs(r, 4)
        visits = torch.tensor([len({int(e) // experts_per_rank for e in row}) for row in topk_idx])
        want = (x.float() * visits[:, None]).to(torch.bfloat16)
        got = torch.load(out / f"trace.{r}.pt")["y"]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), r
    _check_dispatch(out, "tsub0", 2, seed=20)
    _check_dispatch(out, "tsub1", 2, seed=21)


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    """One 2-rank job for five checks (start-up costs seconds): the example, the control plane,
    Hugging Face generate with rank 0 at EOS first, a group across "hosts", and every rank
    SIGKILLed with segments named.
    Returns the output directory and the eager model's generations with that EOS."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("two_rank_job")
    eager = worker.hf_model("eager")
    prompts = [worker.hf_prompt(r) for r in range(2)]
    with torch.no_grad():
        free = [eager.generate(p, **worker.hf_generate_kwargs(p, None)) for p in prompts]
        eos = _eos_that_stops_rank_0_first(free, prompts[0].shape[1])
        want = [eager.generate(p, **worker.hf_generate_kwargs(p, eos)) for p in prompts]
    assert want[0].shape[1] < want[1].shape[1]  # rank 0 really finishes first
    job = _torchrun(2, WORKER, "example,control,hf,other_host,kill", str(out), str(eos))
    # Every rank SIGKILLs itself at the end: a non-zero exit, and nothing after "kill" ran.
    assert job.returncode != 0
    assert (out / "kill.0.json").exists() and (out / "kill.1.json").exists(), job.stderr[-4000:]
    return out, want


def test_the_example_matches_the_reference_on_2_ranks(
    two_rank_job: tuple[Path, list[torch.Tensor]],
) -> None:
    out, _ = two_rank_job
    for r in range(2):  # the example compares every field with ubep.reference itself
        assert json.loads((out / f"example.{r}.json").read_text()) == {"equal_to_reference": True}


def test_control_plane_over_the_torch_group(
    two_rank_job: tuple[Path, list[torch.Tensor]],
) -> None:
    out, _ = two_rank_job
    got = [json.loads((out / f"control.{r}.json").read_text()) for r in range(2)]
    pids = [g["exchange"][r]["pid"] for r, g in enumerate(got)]  # each rank's own entry
    for g in got:
        assert g["cached"]
        assert g["exchange"] == [{"rank": 0, "pid": pids[0]}, {"rank": 1, "pid": pids[1]}]
        assert g["allgather"] == [[0], [1, 1]]
        assert g["allgather_long"] == ["x" * (_SLOT_BYTES - 10), "x" * (_SLOT_BYTES - 9)]
        assert g["peers"] == pids
        assert "keys by rank: ['a', 'b']" in g["mismatch"], g["mismatch"]


def test_hf_generate_with_one_rank_at_eos_first(
    two_rank_job: tuple[Path, list[torch.Tensor]],
) -> None:
    out, want = two_rank_job
    for r in range(2):
        got = torch.load(out / f"hf.{r}.pt")
        assert torch.equal(got["synced_gpus"], want[r]), (r, got["synced_gpus"], want[r])
        assert torch.equal(got["hf_generate"], want[r]), (r, got["hf_generate"], want[r])


def test_a_group_across_hosts_is_refused_naming_ubep_dist(
    two_rank_job: tuple[Path, list[torch.Tensor]],
) -> None:
    out, _ = two_rank_job
    for r in range(2):
        message = json.loads((out / f"other_host.{r}.json").read_text())["message"]
        assert "2 hosts" in message and "ubep.mpi" in message, message


def test_killed_ranks_leave_no_segment_and_no_directory(
    two_rank_job: tuple[Path, list[torch.Tensor]],
) -> None:
    out, _ = two_rank_job
    records = [json.loads((out / f"kill.{r}.json").read_text()) for r in range(2)]
    names = records[0]["segments"]
    assert names == records[1]["segments"] and len(names) == 2
    directory = records[0]["dir"]
    # The ranks are dead (torchrun has returned); the cleaner polls every 0.1 s.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
        if not left and not os.path.exists(directory):
            break
        time.sleep(0.05)
    assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]
    assert not os.path.exists(directory)


def _eos_that_stops_rank_0_first(free: list[torch.Tensor], prompt_len: int) -> int:
    """A token rank 0 generates at its 2nd step and rank 1 never generates (fixed-length
    greedy runs): with it as EOS, rank 0 stops after 2 tokens, rank 1 runs to the end."""
    first = free[0][0, prompt_len:].tolist()
    other = set(free[1][0, prompt_len:].tolist())
    token = first[1]
    assert token != first[0] and token not in other and token != 0, (first, other)
    return int(token)
