"""A ``recv_x`` view whose receive region a later dispatch has reused: combine refuses it on
every rank (before any peer memory is touched), the next call is exact, and
``Buffer.recv_x_valid`` tells the caller beforehand. The oracle is ``ubep.reference``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ubep
from ubep import reference, testing

_SHAPE = {"num_experts": 8, "num_topk": 2, "hidden": 128}
_TOKENS = [5, 4]


def _batch(seed: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    return testing.inputs("fp32", _SHAPE["num_experts"], _SHAPE["num_topk"], _SHAPE["hidden"],
                          _TOKENS, seed, "uniform")


def _combined_ref(batch: tuple[list[np.ndarray], ...], r: int, layout: str) -> np.ndarray:
    refs = reference.dispatch(*batch, _SHAPE["num_experts"], layout=layout)
    return reference.combine([ref.recv_x for ref in refs], refs)[r]


def _worker(group: Any, engine: str, sync: str, path: str) -> dict[str, Any]:
    cfg = ubep.BufferConfig(max_tokens_per_rank=8, dtype="fp32", engine=engine, sync=sync,
                            **_SHAPE)
    r, out = group.rank, {}
    with ubep.Buffer(group, cfg) as buf:
        def combine(view: Any, handle: Any) -> np.ndarray:
            if path == "hook":
                return buf.combine(view, handle, return_recv_hook=True).hook()
            return buf.combine(view, handle)

        batches = [_batch(seed) for seed in range(4)]
        results = [buf.dispatch(*(part[r] for part in batches[0]))]
        out["valid_after_0"] = buf.recv_x_valid(results[0].handle)
        results.append(buf.dispatch(*(part[r] for part in batches[1])))
        out["valid_after_1"] = buf.recv_x_valid(results[0].handle)
        # one dispatch later the view still holds its rows: combined exactly
        y0 = combine(results[0].recv_x, results[0].handle)
        out["exact_while_valid"] = np.array_equal(y0, _combined_ref(batches[0], r, "expert"))
        results.append(buf.dispatch(*(part[r] for part in batches[2])))
        out["valid_after_2"] = buf.recv_x_valid(results[0].handle)
        # rank 0 passes dispatch 0's view, reused by dispatch 2; rank 1 a fresh copy of its rows
        stale = results[0].recv_x if r == 0 else results[1].recv_x.copy()
        handle = results[0].handle if r == 0 else results[1].handle
        try:
            combine(stale, handle)
            out["error"] = None
        except ubep.UbepError as exc:
            out["error"] = (type(exc).__name__, str(exc))
        # nothing lost: the next calls are exact
        y2 = combine(results[2].recv_x, results[2].handle)
        out["next_exact"] = np.array_equal(y2, _combined_ref(batches[2], r, "expert"))
        res3 = buf.dispatch(*(part[r] for part in batches[3]))
        y3 = combine(res3.recv_x.copy(), res3.handle)
        out["after_exact"] = np.array_equal(y3, _combined_ref(batches[3], r, "expert"))
    return out


@pytest.mark.parametrize(("engine", "sync", "path"), [
    ("asp", "sw", "blocking"), ("asp", "tff", "hook"), ("bsp", "sw", "blocking"),
])
def test_a_reused_view_is_refused_on_every_rank_and_the_next_call_is_exact(
        engine: str, sync: str, path: str) -> None:
    got = ubep.launch(_worker, 2, engine, sync, path)
    for out in got:
        assert out["valid_after_0"] and out["valid_after_1"] and not out["valid_after_2"]
        assert out["exact_while_valid"] and out["next_exact"] and out["after_exact"]
    kind0, msg0 = got[0]["error"]
    assert kind0 == "InvalidArgumentError"
    assert "expert_out" in msg0 and "overwritten by dispatch 2" in msg0 and "dispatch 0" in msg0
    kind1, msg1 = got[1]["error"]
    assert kind1 == "RemoteError" and "rank 0" in msg1
