"""What the vLLM tests share: where .venv-vllm is, the environment of every vLLM process,
starting them, waiting for them, and reading their results (``RESULT`` JSON lines)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.vllm._procs import stop_session, vllm_env

__all__ = ["BASE_ENV", "HERE", "ROOT", "SERVED", "START_S", "VLLM_PY", "engine_env", "results",
           "start", "tail", "wait_all", "why_no_vllm"]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# a vLLM process on this 2-core host: imports alone take about a minute when it is busy
START_S = 420.0
SERVED = "ubep serves the all2all"
# every vLLM process of the tests: a small CPU KV cache, ubep's all2all
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "UBEP_VLLM_ALL2ALL": "1", "PYTHONUNBUFFERED": "1"}


def why_no_vllm() -> str | None:
    if not VLLM_PY.exists():
        return f"{VLLM_PY.relative_to(ROOT)} is absent (make venv-vllm builds it)"
    probe = subprocess.run([str(VLLM_PY), "-c", "import vllm, ubep.vllm"], capture_output=True,
                           text=True, timeout=300, check=False)
    if probe.returncode != 0:
        return f"vLLM does not import in .venv-vllm: {probe.stderr.strip()[-300:]}"
    return None


def engine_env(**extra: str) -> dict[str, str]:
    return vllm_env(BASE_ENV, **extra)


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    out = log.open("w")
    return subprocess.Popen([str(VLLM_PY), *args], cwd=HERE, env=env, stdout=out,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_all(procs: list[subprocess.Popen[str]], timeout_s: float, logs: list[Path]) -> None:
    """Every process exits 0 by the deadline; one that exits otherwise fails the test at once
    with its own log (its DP peer may wait for it in torch.distributed's rendezvous)."""
    deadline = time.monotonic() + timeout_s
    pending = list(zip(procs, logs, strict=True))
    try:
        while pending:
            for proc, log in list(pending):
                rc = proc.poll()
                if rc is not None:
                    assert rc == 0, f"{log.name} exited {rc}:\n{tail(log)}"
                    pending.remove((proc, log))
            if pending and time.monotonic() > deadline:
                names = ", ".join(log.name for _, log in pending)
                pytest.fail(f"{names}: no result in {timeout_s:.0f} s:\n{tail(pending[0][1])}")
            time.sleep(0.2)
    finally:
        for proc in procs:
            stop_session(proc)


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def results(log: Path) -> dict[tuple[int, ...], list[int]]:
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[len("RESULT "):])
            out[tuple(item["prompt"])] = item["tokens"]
    return out
