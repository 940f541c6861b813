"""vLLM on CPU: DP=1, TP=2 (vLLM's shared-memory TP) and DP=2 + EP over ubep, side by side.

Two random-initialised Qwen3-MoE models (``tests/vllm/_make_model.py``): ``tiny`` (hidden 128,
8 experts top-2) and ``wide`` (hidden 2048, 32 experts top-4), 2 layers, float32. For each
model every mode runs in one process tree under ``.venv-vllm`` (``make venv-vllm``),
``benchmarks/vllm_worker.py`` per vLLM process, each for ``--rounds`` rounds after a warm-up:

* output tokens/s: the round's generated tokens (``BATCH`` prompts x ``MAX_TOKENS``, all DP
  ranks) over the slowest rank's wall time;
* decode step: (time of ``MAX_TOKENS`` tokens - time of 1 token) / (``MAX_TOKENS`` - 1);
* ubep's share of the MoE blocks' time: ubep's dispatch + combine over the time inside the
  ``Qwen3MoeSparseMoeBlock`` forwards (router, experts kernel, dispatch, combine), per rank.

Bytes ubep moves per MoE block and decode step on a rank (rank layout): dispatch sends each
token's ``hidden * 4`` bytes once to every rank holding one of its experts, combine the same
back. Each worker computes on a core of its own (``BIND``). A vLLM engine takes minutes to
start on this host, so modes run one after another (not alternated call by call);
min/median/max are over rounds. Run::

    .venv/bin/python -m benchmarks.bench_vllm --rounds 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.vllm._procs import free_port, stop_session, sweep_vllm_shm, vllm_env, vllm_shm

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = ROOT / "benchmarks" / "vllm_worker.py"
MAKE_MODEL = ROOT / "tests" / "vllm" / "_make_model.py"
MODES = ("dp1", "tp2", "dp2ep")
# one compute thread per worker, one core each: DP=1 on core 0 (what vLLM picks by itself here,
# keeping core 1 for its frontend; two threads on both cores ran 10x slower on this busy host),
# TP=2 one core per TP worker ("|" separates them), DP=2 one per DP rank (vLLM's automatic
# binding cannot place two workers on this host's one NUMA node)
BIND = {"dp1": ("0",), "tp2": ("0|1",), "dp2ep": ("0", "1")}
DEADLINE_S = 900.0


def _env(**extra: str) -> dict[str, str]:
    return vllm_env({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                     "UBEP_VLLM_ALL2ALL": "1", "PYTHONUNBUFFERED": "1"}, **extra)


def _run(model: Path, mode: str, rounds: int, logdir: Path) -> list[dict[str, Any]]:
    ranks = 2 if mode == "dp2ep" else 1
    port = free_port()
    procs, logs = [], []
    before = vllm_shm()
    for rank in range(ranks):
        extra = ({"VLLM_DP_RANK": str(rank), "VLLM_DP_SIZE": "2",
                  "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(port)}
                 if ranks > 1 else {})
        extra["VLLM_CPU_OMP_THREADS_BIND"] = BIND[mode][rank]
        log = logdir / f"{model.name}_{mode}_{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen(
            [str(VLLM_PY), str(WORKER), str(model), mode, str(rounds)], env=_env(**extra),
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + DEADLINE_S
    try:
        for proc, log in zip(procs, logs, strict=True):
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            if rc != 0:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"{log.name}: exited {rc}:\n{tail}")
    finally:
        for proc in procs:
            stop_session(proc)
        sweep_vllm_shm(before)
    out = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("RESULT "):
                out.append(json.loads(line[7:]))
    return out


def _mmm(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def summarise(results: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """Per-round aggregates over the DP ranks, then min/median/max over rounds."""
    rounds = len(results[0]["samples"])
    tps, step_ms, share = [], [], []
    for i in range(rounds):
        ranks = [r["samples"][i] for r in results]
        tps.append(sum(s["tokens"] for s in ranks) / max(s["full_s"] for s in ranks))
        step_ms.append(max((s["full_s"] - s["prefill_s"]) / (max_tokens - 1) for s in ranks)
                       * 1e3)
        moe = sum(s["moe_ns"] for s in ranks)
        share.append(sum(s["dispatch_ns"] + s["combine_ns"] for s in ranks) / moe if moe else 0.0)
    return {"tokens_per_s": _mmm(tps), "decode_step_ms": _mmm(step_ms),
            "ubep_share_of_moe": _mmm(share)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args()
    if not VLLM_PY.exists():
        raise SystemExit(f"{VLLM_PY} is absent: make venv-vllm")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = Path(tmp) / name
            subprocess.run([str(VLLM_PY), str(MAKE_MODEL), str(model), name], check=True,
                           capture_output=True, timeout=600)
            for mode in MODES:
                results = _run(model, mode, args.rounds, Path(tmp))
                summary = summarise(results, results[0]["max_tokens"])
                rows.append({"model": name, "mode": mode, **summary})
                print(_line(rows[-1]), flush=True)
    text = _table(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vllm.txt").write_text(text + "\n")
        (args.out / "vllm.json").write_text(json.dumps(rows, indent=1) + "\n")


def _line(row: dict[str, Any]) -> str:
    t, s, u = row["tokens_per_s"], row["decode_step_ms"], row["ubep_share_of_moe"]
    return (f"{row['model']:5} {row['mode']:6} tok/s {t[0]:8.1f} {t[1]:8.1f} {t[2]:8.1f}  "
            f"step_ms {s[0]:8.2f} {s[1]:8.2f} {s[2]:8.2f}  ubep/moe {u[1]:6.1%}")


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("model mode   output tokens/s (min median max)  decode step ms (min median max)  "
            "ubep share of MoE (median)  tok/s vs dp1")
    out = [head]
    base = {r["model"]: r["tokens_per_s"][1] for r in rows if r["mode"] == "dp1"}
    for r in rows:
        ratio = r["tokens_per_s"][1] / base[r["model"]] if r["model"] in base else float("nan")
        out.append(f"{_line(r)}  x{ratio:.2f}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
