"""Published results, reproduced in shape with hetrain's simulator from their published configurations.

Each result is the published ratio(s), the configuration they were measured on (a cluster spec and
a model preset, so `hetrain simulate` reproduces every row) and one function per simulator column
(RESULTS below). Ratios are compared, not absolute samples/s: docs/published-results.md says why
and explains each difference.

    seed     the seed's table (the product's founding figures): A100 120 samples/s alone, RTX 3090 80, both 190
    sailor   Sailor (Strati et al., SOSP 2025) Fig. 1: 16 A100 + 16 V100 ≈ 1.15× 16 A100 (OPT-350M)
    timm     timm PR #580: 2×A6000 + 2×2080Ti, EfficientNet-B0, 2000 → 2500 img/s with per-GPU batches

    python benchmarks/published.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hetrain.hardware.cluster import parse_cluster_spec  # noqa: E402
from hetrain.planning.cost import DEFAULT_EFFICIENCY, GRAD_ELEMENT_BYTES, Assignment, step_cost  # noqa: E402
from hetrain.planning.options import PlanOptions, ring_link  # noqa: E402
from hetrain.planning.presets import preset  # noqa: E402
from hetrain.planning.profile import ModelSpec  # noqa: E402
from hetrain.planning.simulate import Simulation, cluster_profiles, simulate  # noqa: E402
from hetrain.planning.topology import topology_sync  # noqa: E402

Figures = dict[str, float]      # metric (or absolute figure) -> value


def simulate_spec(cluster: str, model: ModelSpec, *, global_batch: int, precision: str = "bf16",
                  efficiency: float = DEFAULT_EFFICIENCY) -> Simulation:
    """What `hetrain simulate --cluster CLUSTER --model ... --global-batch B --precision P
    [--efficiency E]` computes."""
    parsed = parse_cluster_spec(cluster)
    grad_bytes = model.trainable * GRAD_ELEMENT_BYTES
    link = topology_sync(parsed, grad_bytes).link if parsed.topology.named else None
    profiles = cluster_profiles(parsed.devices, model, precision=precision, efficiency=efficiency)
    return simulate(profiles, global_batch=global_batch, grad_bytes=grad_bytes, link=link)


def by_name(sim: Simulation) -> dict[str, float]:
    return {s.name: s.samples_per_s for s in sim.strategies}


# -- 1. the seed's table ----------------------------------------------------------------------
SEED_CLUSTER, SEED_MODEL, SEED_BATCH = "a100-80g,rtx3090", "gpt2-124m", 256


def seed_dp() -> Figures:
    """A100 + RTX 3090, GPT-2 124M (the model is not stated; DESIGN's sync figure is for ~100M
    parameters), global batch 256, bf16."""
    sim = simulate_spec(SEED_CLUSTER, preset(SEED_MODEL), global_batch=SEED_BATCH)
    a100, r3090 = (row.standalone_samples_per_s for row in sim.devices)
    s = by_name(sim)
    together, ddp = s["hetrain"], s["plain DDP equal split"]
    return {"RTX 3090 / A100 alone": r3090 / a100, "together / A100": together / a100,
            "together / sum": together / (a100 + r3090), "equal-split DDP / A100": ddp / a100,
            "equal-split DDP / sum": ddp / (a100 + r3090),
            "A100 alone samples/s": a100, "RTX 3090 alone samples/s": r3090,
            "together samples/s": together, "equal-split DDP samples/s": ddp}


# -- 2. Sailor, Fig. 1 ------------------------------------------------------------------------
# GCP us-central1-a as Sailor's artifact profiles it: A100-40GB nodes of 4 (a2) and V100-16GB
# nodes of 4 (n1), basic_cluster_config.json; node links and the link between nodes are the peaks
# of its fitted bandwidth curves (providers/gcp/intra_node_bandwidths.json: 243 GB/s for 4 A100s,
# 68 GB/s for 4 V100s; multizone_bandwidths_het.json: 2.42 GB/s A100↔A100, 1.72 GB/s A100↔V100).
SAILOR_A100 = "; ".join(f"a{i}=4xa100-40g/243GB/s" for i in range(4))
SAILOR_V100 = "; ".join(f"v{i}=4xv100-16g/68GB/s" for i in range(4))
SAILOR_A100_ONLY = f"{SAILOR_A100}; net=2.42GB/s"
SAILOR_MIXED = f"{SAILOR_A100}; {SAILOR_V100}; net=1.72GB/s"     # the ring runs at its slowest hop
SAILOR_MODEL, SAILOR_BATCH, SAILOR_PRECISION = "opt-350m", 1024, "fp16"   # V100: no bf16
# What Sailor's own OPT-350 profiles (Planner/simulations/profiles_tmp.json, tp 1, best micro-batch)
# time: an A100-40 at 0.191 s of forward+backward per sample (5.6 TFLOP: ~9.5% of its 312 TFLOPS),
# a V100-16 at 0.625 s (0.31 of the A100; the catalog: 0.42 / 0.95 = 0.44). What-if inputs only.
SAILOR_PROFILED_EFFICIENCY, SAILOR_PROFILED_V100 = 0.095, round(0.95 * 0.191 / 0.625, 3)


def sailor_pair(*, efficiency: float = DEFAULT_EFFICIENCY, v100: float | None = None) -> tuple[Simulation, Simulation]:
    """16 A100 alone and 16 A100 + 16 V100; `v100`: the V100's speed instead of the catalog's."""
    model = preset(SAILOR_MODEL)
    mixed_spec = SAILOR_MIXED if v100 is None else SAILOR_MIXED.replace("4xv100-16g/", f"4xv100-16g:{v100}/")
    return tuple(simulate_spec(spec, model, global_batch=SAILOR_BATCH, precision=SAILOR_PRECISION,
                               efficiency=efficiency) for spec in (SAILOR_A100_ONLY, mixed_spec))


def sailor_dp() -> Figures:
    """hetrain's DP split of OPT-350M (global batch 1024, fp16) on 16 A100 + 16 V100 against 16
    A100. Sailor's throughput is iterations/s at a fixed global batch, so its ratio is a samples/s
    ratio. The what-ifs rerun the pair at Sailor's profiled speeds (inputs, not the cost model)."""
    alone, mixed = sailor_pair()
    a, m = by_name(alone), by_name(mixed)
    sum_a = sum(r.standalone_samples_per_s for r in alone.devices)
    sum_m = sum(r.standalone_samples_per_s for r in mixed.devices)
    return {"16 A100 + 16 V100 / 16 A100": m["hetrain"] / a["hetrain"],
            "equal-split DDP, mixed / 16 A100": m["plain DDP equal split"] / a["hetrain"],
            "compute bound (Σ standalone), mixed / A100": sum_m / sum_a,
            "16 A100 samples/s": a["hetrain"], "16 A100 + 16 V100 samples/s": m["hetrain"],
            "16 A100 + 16 V100 equal-split DDP samples/s": m["plain DDP equal split"],
            "16 A100 efficiency": alone.strategies[2].efficiency, "mixed efficiency": mixed.strategies[2].efficiency,
            "mixed exposed sync s": mixed.plan.predicted["comm_exposed_s"], "mixed step s": mixed.plan.predicted["step_s"],
            **{f"what-if {name}": _ratio(*sailor_pair(**kw)) for name, kw in (
                ("V100 at Sailor's 0.31", {"v100": SAILOR_PROFILED_V100}),
                ("A100 at Sailor's 9.5% of peak", {"efficiency": SAILOR_PROFILED_EFFICIENCY}),
                ("both", {"v100": SAILOR_PROFILED_V100, "efficiency": SAILOR_PROFILED_EFFICIENCY}))}}


def rank_spec(cluster: str, model: ModelSpec, *, global_batch: int, precision: str = "bf16"):
    """What `hetrain simulate` ranks as every layout (planning/ranking.py) for this cluster."""
    from hetrain.planning.ranking import ModelState, rank_layouts

    parsed = parse_cluster_spec(cluster)
    grad_bytes = model.trainable * GRAD_ELEMENT_BYTES
    link = topology_sync(parsed, grad_bytes).link if parsed.topology.named else None
    profiles = cluster_profiles(parsed.devices, model, precision=precision)
    return rank_layouts(profiles, state=ModelState.from_spec(model, precision=precision),
                        options=PlanOptions(global_batch=global_batch, grad_bytes=grad_bytes, link=link))


def sailor_layouts() -> Figures:
    """The best of every layout hetrain ranks (DP, ZeRO-1, capacity, FSDP2, PP, DP×PP, TP) on each
    cluster: Sailor's own comparison is between its best 3D layouts."""
    model = preset(SAILOR_MODEL)
    alone, mixed = (rank_spec(spec, model, global_batch=SAILOR_BATCH, precision=SAILOR_PRECISION)
                    for spec in (SAILOR_A100_ONLY, SAILOR_MIXED))
    return {"16 A100 + 16 V100 / 16 A100": mixed.best.samples_per_s / alone.best.samples_per_s,
            "16 A100 best layout": alone.best.name, "16 A100 best samples/s": alone.best.samples_per_s,
            "mixed best layout": mixed.best.name, "mixed best samples/s": mixed.best.samples_per_s}


def _ratio(alone: Simulation, mixed: Simulation) -> float:
    return by_name(mixed)["hetrain"] / by_name(alone)["hetrain"]


# -- 3. timm PR #580 --------------------------------------------------------------------------
TIMM_CLUSTER, TIMM_MODEL, TIMM_PRECISION = "2xrtx-a6000,2xrtx2080ti", "efficientnet-b0", "fp16"  # 2080 Ti: no bf16
TIMM_EQUAL, TIMM_SHARES = 200, (300, 300, 200, 200)     # per-GPU batches before and after the PR


def timm_dp() -> Figures:
    """Plain DDP at 200 per GPU (global 800) against the PR's 300/300/200/200 (global 1000) on the
    cost model, and hetrain's own split of the same 1000."""
    model = preset(TIMM_MODEL)
    equal = simulate_spec(TIMM_CLUSTER, model, global_batch=4 * TIMM_EQUAL, precision=TIMM_PRECISION)
    ours = simulate_spec(TIMM_CLUSTER, model, global_batch=sum(TIMM_SHARES), precision=TIMM_PRECISION)
    profiles = cluster_profiles(parse_cluster_spec(TIMM_CLUSTER).devices, model, precision=TIMM_PRECISION)
    options = PlanOptions(global_batch=sum(TIMM_SHARES), grad_bytes=model.trainable * GRAD_ELEMENT_BYTES)
    pr = step_cost([Assignment(profile=p, share=s, micro_batch=s) for p, s in zip(profiles, TIMM_SHARES)],
                   global_batch=options.global_batch, grad_bytes=options.grad_bytes, link=ring_link(profiles, options))
    ddp = by_name(equal)["plain DDP equal split"]
    het = by_name(ours)["hetrain"]
    return {"PR split / equal split": pr.samples_per_s / ddp, "hetrain split / equal split": het / ddp,
            "equal split img/s": ddp, "PR split img/s": pr.samples_per_s, "hetrain split img/s": het,
            "hetrain shares": "/".join(str(d.share) for d in ours.plan.devices)}


# -- the table --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Metric:
    name: str
    published: float
    why: str                     # why the simulated figure differs (or agrees)


@dataclass(frozen=True, kw_only=True)
class Result:
    key: str
    title: str
    source: str
    configuration: str           # how `hetrain simulate` is called for it
    metrics: tuple[Metric, ...]
    columns: dict[str, Callable[[], Figures]] = field(default_factory=dict)   # simulator -> figures


RESULTS = (
    Result(key="seed", title="seed: A100 + RTX 3090", source="the seed's reference figures (docs/published-results.md)",
           configuration=f"--cluster {SEED_CLUSTER} --model {SEED_MODEL} --global-batch {SEED_BATCH}",
           metrics=(
               Metric(name="RTX 3090 / A100 alone", published=80 / 120,
                      why="an input, not a prediction: the catalog's 3090 speed index is this measured ratio"),
               Metric(name="together / A100", published=190 / 120,
                      why="the 3090's share is as good as measured; the gap is the together/sum gap below"),
               Metric(name="together / sum", published=190 / 200,
                      why="the model hides a 21 ms PCIe sync under the backward (DESIGN: 100 ms); no data loading, "
                          "jitter or stragglers"),
               Metric(name="equal-split DDP / A100", published=2 * 80 / 120,
                      why="2 × the slower's speed, as published: equal shares wait for the 3090; the sync hides"),
           ), columns={"hetrain DP": seed_dp}),
    Result(key="sailor", title="Sailor Fig. 1: 16 A100 + 16 V100 vs 16 A100 (OPT-350M)",
           source="Strati et al., SOSP 2025, Fig. 1; configuration from the eth-easl/sailor artifact",
           configuration=(f"--cluster '{SAILOR_MIXED}' (and '{SAILOR_A100_ONLY}') --model {SAILOR_MODEL} "
                          f"--global-batch {SAILOR_BATCH} --precision {SAILOR_PRECISION}"),
           metrics=(
               Metric(name="16 A100 + 16 V100 / 16 A100", published=1.15,
                      why="DP only: a 1.4 GB fp32 gradient over 1.7-2.4 GB/s nets is exposed at 40% of peak; "
                          "Sailor plans 3D layouts on slower profiled compute (what-ifs)"),
           ), columns={"hetrain DP": sailor_dp, "hetrain best layout": sailor_layouts}),
    Result(key="timm", title="timm PR #580: 2×A6000 + 2×2080Ti, EfficientNet-B0",
           source="github.com/huggingface/pytorch-image-models/pull/580",
           configuration=f"--cluster {TIMM_CLUSTER} --model {TIMM_MODEL} --global-batch 800|1000 --precision fp16",
           metrics=(
               Metric(name="PR split / equal split", published=2500 / 2000,
                      why="agrees by arithmetic: both steps wait for a 2080 Ti's 200 samples, so 1000/800; "
                          "the A6000s (2.2× in the catalog) finish 300 first"),
           ), columns={"hetrain DP": timm_dp}),
)


def run(keys: list[str] | None = None) -> list[dict]:
    out = []
    for r in [r for r in RESULTS if not keys or r.key in keys]:
        figures = {name: fn() for name, fn in r.columns.items()}
        rows = []
        for m in r.metrics:
            sims = {name: f[m.name] for name, f in figures.items()}
            first = next(iter(sims.values()))
            rows.append({**asdict(m), "simulated": sims, "difference": first - m.published,
                         "relative": first / m.published - 1})
        out.append({"key": r.key, "title": r.title, "source": r.source, "configuration": r.configuration,
                    "rows": rows, "figures": figures})
    return out


def show(results: list[dict]) -> None:
    for r in results:
        print(f"\n{r['title']}  [{r['source']}]\n  hetrain simulate {r['configuration']}")
        cols = list(r["figures"])
        print(f"  {'result':<34} {'published':>9} " + " ".join(f"{c:>10}" for c in cols) + f" {'diff':>8}  why")
        for row in r["rows"]:
            sims = " ".join(f"{row['simulated'][c]:>10.3f}" for c in cols)
            print(f"  {row['name']:<34} {row['published']:>9.3f} {sims} {row['relative']:>+7.0%}  {row['why']}")
        for c, figs in r["figures"].items():
            extra = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figs.items()
                     if k not in {row["name"] for row in r["rows"]}]
            print(f"  {c}: " + "; ".join(extra))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows and figures here")
    p.add_argument("--only", action="append", choices=[r.key for r in RESULTS], help="one result (repeatable)")
    p.add_argument("--smoke", action="store_true", help="the same run: it takes seconds already (no processes)")
    args = p.parse_args()
    results = run(args.only)
    show(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
