"""M2N in the simulator: attention dies dispatch to disjoint expert dies and combine back.

An M2N deployment of ``A`` attention dies and ``N`` expert dies is one fabric of ``A + N``
dies, placed one of two ways: ``"pooled"``, attention dies first (``[0, A)``), then the expert
dies, so that each pool fills whole nodes where the counts allow; or ``"mixed"``, the expert
dies spread evenly over the dies (every ``(A + N) / N``-th), so that each node holds both and
part of the traffic stays under the first switch tier, where the hierarchical mapping can
prefer it. The ``num_experts`` experts are spread over the expert dies in order,
``num_experts // N`` each (``ubep.m2n``'s placement, the expert map a Buffer with
``expert_ranks`` runs); only the attention dies hold tokens.
The plans are ``ubep.sched``'s for that physical routing (``ubep.sim.replicas``, as any
expert map reaches the simulator), timed by the same executors as every other experiment.

Co-located EP at equal die count is the same picks on the same ``A + N`` dies, every die
holding both: the ``A * tokens`` tokens spread evenly over all dies and the experts over all
dies, expert ``e`` on die ``e % (A + N)`` (``ceil(num_experts / (A + N))`` slots per die, the
spare ones empty).

No paper reports M2N on these fabrics: every number is a prediction of the model, with the
interval of the assumed constants (CM384; docs/SIMULATOR.md 3.3) and of the routing's seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..expert_map import ExpertMap
from ..m2n import m2n_expert_map
from ..routing import uniform_topk
from ..sched.combine import combine_plans
from ..sched.plan import Plan
from ..topology import Topology
from .api import make_plans, simulate
from .calib import load_fabric, topology_for
from .experiments import ExperimentResult, _band, _us, provenance
from .fabric import FabricModel
from .presets import PRESETS
from .workload import CANN_EP, UBEP, UBEP_NO_MAPPING, System, Workload, core_split

__all__ = ["PLACEMENTS", "M2NCase", "m2n", "m2n_plans", "m2n_topology", "time_m2n"]

#: Where the pools sit: M2N ``pooled`` / ``mixed`` (module docstring), or co-located EP.
PLACEMENTS = ("pooled", "mixed", "colocated")


@dataclass(frozen=True)
class M2NCase:
    """One MoE layer of an M2N (or, with ``placement="colocated"``, co-located) deployment.

    Attributes:
        attention_dies, expert_dies: the pools (``A`` and ``N``); the fabric has ``A + N``.
        tokens_per_attention_die: each attention die's batch (``T``).
        hidden, itemsize: dispatch rows of ``hidden * itemsize`` bytes (1: W8A8).
        num_topk, num_experts: the model's routing (DeepSeek-V3: 8 of 256).
        combine_itemsize: bytes per element of the combine rows (BF16).
        placement: ``"pooled"`` or ``"mixed"`` (M2N, module docstring), or ``"colocated"``:
            the same ``A * T`` tokens and experts on all ``A + N`` dies instead.
        seed: the routing's seed (one draw of ``A * T`` tokens, split over the dies).
    """

    attention_dies: int
    expert_dies: int
    tokens_per_attention_die: int = 128
    hidden: int = 7168
    itemsize: int = 1
    num_topk: int = 8
    num_experts: int = 256
    combine_itemsize: int = 2
    placement: str = "pooled"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("attention_dies", "expert_dies", "tokens_per_attention_die", "hidden",
                     "itemsize", "num_topk", "num_experts", "combine_itemsize"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidArgumentError(name, value, "must be a positive integer")
        if self.num_experts % self.expert_dies:
            raise InvalidArgumentError("expert_dies", self.expert_dies, f"num_experts="
                                       f"{self.num_experts} is not a multiple of it")
        if self.num_topk > self.num_experts:
            raise InvalidArgumentError("num_topk", self.num_topk, "exceeds num_experts")
        if self.placement not in PLACEMENTS:
            raise InvalidArgumentError("placement", self.placement,
                                       f"must be one of {PLACEMENTS}")

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    @property
    def num_ranks(self) -> int:
        return self.attention_dies + self.expert_dies

    @property
    def expert_ranks(self) -> tuple[int, ...]:
        """The dies that hold experts (all of them when co-located)."""
        R, N = self.num_ranks, self.expert_dies
        if self.colocated:
            return tuple(range(R))
        if self.placement == "mixed":  # die (i + 1) * R / N - 1: the last of each stride
            return tuple((i + 1) * R // N - 1 for i in range(N))
        return tuple(range(self.attention_dies, R))

    @property
    def slots_per_rank(self) -> int:
        return -(-self.num_experts // len(self.expert_ranks))

    def expert_map(self) -> ExpertMap:
        """Logical expert -> its physical slot (``slots_per_rank`` per die)."""
        R, S = self.num_ranks, self.slots_per_rank
        if not self.colocated:
            return m2n_expert_map(self.num_experts, self.expert_ranks, R)
        return ExpertMap(tuple(((e % R) * S + e // R,) for e in range(self.num_experts)))

    def tokens(self) -> list[int]:
        """Tokens per die: ``T`` on each attention die (M2N), or the same total spread evenly
        over every die, the first dies one more where it does not divide (co-located)."""
        A, T, R = self.attention_dies, self.tokens_per_attention_die, self.num_ranks
        if not self.colocated:
            experts = set(self.expert_ranks)
            return [0 if r in experts else T for r in range(R)]
        base, extra = divmod(A * T, R)
        return [base + (r < extra) for r in range(R)]

    def routing(self) -> list[np.ndarray]:
        """Every die's logical ``topk_idx``: one seeded uniform draw of all ``A * T`` tokens,
        cut in die order (so both placements route the very same picks)."""
        every = uniform_topk(self.attention_dies * self.tokens_per_attention_die,
                             self.num_experts, self.num_topk, seed=self.seed)
        cuts = np.cumsum(self.tokens())[:-1]
        return [np.ascontiguousarray(p) for p in np.split(every, cuts)]

    def workload(self) -> Workload:
        """The per-die workload Appendix A's core split reads (a sender's batch and slots)."""
        return Workload(tokens_per_rank=max(self.tokens()), hidden=self.hidden,
                        itemsize=self.itemsize, num_topk=self.num_topk,
                        experts_per_rank=self.slots_per_rank,
                        combine_itemsize=self.combine_itemsize)


def m2n_topology(family: str, num_ranks: int) -> tuple[Topology, str]:
    """The topology of ``num_ranks`` dies of ``family`` and the fabric family that times it:
    NVL72 beyond 72 dies is NVL72 domains under a second switch tier (``nvl576``'s model, an
    extrapolation)."""
    row = PRESETS[family]
    if row.wider and num_ranks > row.max_ranks:
        family = row.wider
    return topology_for(family, num_ranks), family


@lru_cache(maxsize=16)
def _plans(case: M2NCase, system: System, topology: Topology, n_s: int | None,
           n_c: int | None) -> tuple[Plan, ...]:
    return tuple(make_plans(case.routing(), topology,
                            num_experts=case.slots_per_rank * case.num_ranks,
                            policy=system.policy, num_send_cores=n_s, num_count_cores=n_c,
                            layout=system.layout, expert_map=case.expert_map()))


def m2n_plans(case: M2NCase, system: System, topology: Topology,
              fabric: FabricModel) -> tuple[Plan, ...]:
    """Every die's dispatch plan (ASP: Appendix A's core split of a sender's batch)."""
    if topology.num_ranks != case.num_ranks:
        raise InvalidArgumentError("topology", topology.num_ranks,
                                   f"needs {case.num_ranks} dies (attention + expert)")
    n_s, n_c = core_split(case.workload(), system, topology, fabric)
    return _plans(case, system.with_(name=""), topology, n_s, n_c)


def time_m2n(case: M2NCase, system: System, topology: Topology,
             fabric: FabricModel | None = None, *, family: str = "cm384",
             mode: str = "analytic") -> tuple[float, float]:
    """``(dispatch_ns, combine_ns)`` of one layer of ``case`` under ``system``."""
    fab = fabric or load_fabric(family)
    plans = m2n_plans(case, system, topology, fab)
    dispatch = simulate(plans, topology, fab, engine=system.engine, sync=system.sync,
                        row_bytes=case.hidden * case.itemsize, op="dispatch", mode=mode)
    back = combine_plans(plans, topology, policy=system.policy)
    combine = simulate(back, topology, fab, engine=system.engine, sync=system.sync,
                       row_bytes=case.hidden * case.combine_itemsize, op="combine", mode=mode)
    return dispatch.latency_ns, combine.latency_ns


# ------------------------------------------------------------------------------ the experiment
ATTENTION_DIES = 64
EXPERT_DIES = (16, 32, 64)
SEEDS = (0, 1, 2)  # the routing's seeds the interval spans
# BSP/SW (CANN EP), ASP + Data-as-Flag with and without the hierarchical mapping
M2N_SYSTEMS = (CANN_EP, UBEP_NO_MAPPING, UBEP)


def _layer_band(case: M2NCase, system: System, topology: Topology, family: str,
                fabric: FabricModel | None) -> tuple[float, float, float, float]:
    """``(dispatch_ns, combine_ns, low_ns, high_ns)``: the layer (dispatch + combine) at the
    nominal constants and seed 0, and its interval: the hull over the routing's seeds and,
    for ASP on a fabric with fitted assumed constants, over their corners (``_band``)."""
    fab = fabric or load_fabric(family)
    dispatch, combine = time_m2n(case, system, topology, fab)
    layers = [dispatch + combine]
    for seed in SEEDS[1:]:
        layers.append(sum(time_m2n(replace(case, seed=seed), system, topology, fab)))
    if system.engine == "asp":
        _, lo, hi = _band(lambda f: sum(time_m2n(case, system, topology, f)), family, fabric)
        layers += [lo, hi]
    return dispatch, combine, min(layers), max(layers)


def m2n(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """M2N PREDICTION: 64 attention dies to 16/32/64 expert dies, against co-located EP."""
    if family not in ("cm384", "nvl72"):
        raise InvalidArgumentError("family", family, "m2n runs on cm384 or nvl72")
    rows, data = [], []
    for n in EXPERT_DIES:
        layer: dict[tuple[str, str], float] = {}
        for place in ("colocated", "pooled", "mixed"):
            case = M2NCase(ATTENTION_DIES, n, placement=place)
            topo, fam = m2n_topology(family, case.num_ranks)
            for system in M2N_SYSTEMS:
                d, c, lo, hi = _layer_band(case, system, topo, fam, fabric)
                layer[(place, system.name)] = d + c
                vs_bsp = layer[(place, CANN_EP.name)] / (d + c)
                rows.append([n, case.num_ranks, place, system.name, _us(d), _us(c),
                             _us(d + c), _us(lo), _us(hi), round(vs_bsp, 2)])
                data.append({"expert_dies": n, "dies": case.num_ranks, "placement": place,
                             "system": system.name, "fabric": fam, "dispatch_us": _us(d),
                             "combine_us": _us(c), "layer_us": _us(d + c),
                             "layer_interval_us": [_us(lo), _us(hi)],
                             "speedup_over_bsp": round(vs_bsp, 3)})
        cases = 3 * len(M2N_SYSTEMS)
        for row, entry in zip(rows[-cases:], data[-cases:], strict=True):
            place, name = str(entry["placement"]), str(entry["system"])
            ratio = layer[(place, name)] / layer[("colocated", name)]
            row.append(round(ratio, 2) if place != "colocated" else "-")
            entry["m2n_over_colocated"] = round(ratio, 3)
    hops = _pool_hops(family)
    return ExperimentResult(
        "m2n", f"M2N PREDICTION: {ATTENTION_DIES} attention dies to 16/32/64 expert dies, "
        f"against co-located EP on the same dies ({family})",
        ("expert_dies", "dies", "placement", "system", "dispatch_us", "combine_us", "layer_us",
         "lo_us", "hi_us", "speedup_over_bsp", "m2n_over_colocated"),
        tuple(tuple(r) for r in rows),
        ("PREDICTION of the model: no paper reports M2N on these fabrics",
         f"{ATTENTION_DIES} attention dies x 128 tokens, DeepSeek-V3 shape: hidden 7168, "
         "top-8 of 256 experts, dispatch W8A8 (1 B), combine BF16; uniform routing; "
         "layer = dispatch + combine",
         "pooled: attention dies [0, 64), expert dies after them; mixed: the expert dies "
         "spread evenly (every (64 + N) / N-th die); either way 256 / N experts per expert die "
         "(ubep.m2n's placement); colocated: the same 8192 tokens and the same picks spread "
         "over all 64 + N dies, every die holding experts (expert e on die e % dies)",
         "systems: CANN EP = bsp + expert_contiguous + sw; UBEP w/o mapping = asp + balanced "
         "+ sp (Data-as-Flag); UBEP = asp + hierarchical + sp",
         f"hop classes between the pools: {hops}",
         "interval: the hull over 3 routing seeds and, for ASP on cm384, the fitted constants "
         "at the ends of their leave-one-out spread; nvl72 has no fitted spread (seeds only)",
         "speedup_over_bsp: CANN EP's layer over this one, same placement; "
         "m2n_over_colocated: M2N's layer over co-located EP's, same system",
         *(("nvl72: 80-128 dies exceed one NVL72 domain: NVL72 domains of 72 GPUs under a "
            "second switch tier (nvl576's model, an EXTRAPOLATION)",) if family == "nvl72"
           else ())),
        {"rows": data, "family": family,
         "provenance": provenance("cm384" if family == "cm384" else "nvl72",
                                  ("uniform routing (a deployment's skew moves M2N's "
                                   "expert dies first: they receive every pick)",))},
    )


def _pool_hops(family: str) -> str:
    """Per placement and expert-die count, the share of attention -> expert die pairs at each
    hop class."""
    out = []
    for place in ("pooled", "mixed"):
        for n in EXPERT_DIES:
            case = M2NCase(ATTENTION_DIES, n, placement=place)
            topo, _ = m2n_topology(family, case.num_ranks)
            experts = np.asarray(case.expert_ranks)
            senders = np.setdiff1d(np.arange(case.num_ranks), experts)
            pair = topo.hop_matrix()[np.ix_(senders, experts)]
            shares = ", ".join(f"hop {h}: {float(np.mean(pair == h)):.2f}"
                               for h in np.unique(pair))
            out.append(f"{place} N={n}: {shares}")
    return "; ".join(out)


def draw(plt: Any, r: ExperimentResult) -> Any:
    """The layer per expert-die count: one bar per placement and system, its interval as an
    error bar (``ubep sim m2n --plot``)."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    rows = r.data["rows"]
    places, systems = ("colocated", "pooled", "mixed"), [s.name for s in M2N_SYSTEMS]
    colors = {"CANN EP": "#d62728", "UBEP w/o mapping": "#ff7f0e", "UBEP": "#2ca02c"}
    hatches = {"colocated": "", "pooled": "//", "mixed": ".."}
    width = 0.8 / (len(places) * len(systems))
    for i, (place, name) in enumerate((p, s) for p in places for s in systems):
        got = [row for row in rows if row["placement"] == place and row["system"] == name]
        x = np.arange(len(got)) + (i - (len(places) * len(systems) - 1) / 2) * width
        y = np.array([row["layer_us"] for row in got])
        band = np.array([row["layer_interval_us"] for row in got]).T
        ax.bar(x, y, width, color=colors[name], hatch=hatches[place], edgecolor="black",
               linewidth=0.3, label=f"{place}, {name}",
               yerr=np.abs(band - y), error_kw={"elinewidth": 0.6, "capsize": 1.5})
    ax.set_xticks(range(len(EXPERT_DIES)))
    ax.set_xticklabels([f"{n} expert dies ({ATTENTION_DIES + n} dies)" for n in EXPERT_DIES])
    ax.set_ylabel("dispatch + combine (us), predicted")
    ax.legend(fontsize=6, ncol=3)
    return fig
