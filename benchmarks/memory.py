"""The largest model an emulated 80 GB + 24 GB pair trains, strategy by strategy, found by training it.

The pair is scaled 1 GB -> 1 MiB (`a100-80g@80MiB,rtx3090@24MiB`, speeds 1 : 0.67); emulated
devices count parameters, gradients, optimizer state, gathered units and saved activations and
raise torch.OutOfMemoryError past their cap, like a GPU. Every candidate width of the demo GPT is
*run* as a 2-process job under torchrun and "trains" when both ranks finish its steps (AdamW, so
its state exists from the second step on) without an OOM; a binary search finds the largest.

Study `strategies` (GPT 4 layers, seq 64, global batch 16, 3 steps): each strategy its fixed plan
(STRATEGIES below: shares, micro-batches, checkpointing per rank, state sharding). Study `capacity-full` (GPT 16 layers, seq 32, global batch 8, fp32): capacity-proportional full
sharding against even FSDP2, the same plan (shares 5 / 3 in one micro-batch each, checkpointing on
both): the largest model each trains and their ratio (bound (80 + 24) / (2 · 24) ≈ 2.17), then
throughput at a width both train, --rounds interleaved fresh jobs of --steps steps, the ratio of
the medians.

    python benchmarks/memory.py --json out.json [--study strategies|capacity-full|all] [--max-width 1024] [--smoke]
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Parser, add_smoke, apply_smoke, forked_ranks

SPEC = "a100-80g@80MiB,rtx3090@24MiB"
VOCAB, HEADS = 256, 4
STUDIES = {   # name: global batch, seq, layers, steps a trial, width step, memory margin
    "strategies": {"batch": 16, "seq": 64, "layers": 4, "steps": 3, "width_step": 8, "margin": None},
    "capacity-full": {"batch": 8, "seq": 32, "layers": 16, "steps": 2, "width_step": 4, "margin": 0.02},
}
STRATEGIES = {   # study: {name: (shares, micro-batches, checkpointing per rank, sharding)}
    "strategies": {
        "ddp": ((8, 8), (8, 8), (False, False), "none"),
        "hetrain-ckpt": ((10, 6), (10, 1), (False, True), "none"),
        "zero1": ((10, 6), (10, 1), (False, True), "zero1"),
        "fsdp": ((10, 6), (10, 1), (False, True), "fsdp"),
        "fsdp-whole": ((10, 6), (10, 6), (False, True), "fsdp"),
        "capacity": ((10, 6), (10, 1), (False, True), "capacity")},
    "capacity-full": {
        "fsdp": ((5, 3), (5, 3), (True, True), "fsdp"),
        "capacity-full": ((5, 3), (5, 3), (True, True), "capacity-full")},
}


def gpt(study: str, width: int):
    from hetrain.demo.gpt import GPT, GPTConfig

    s = STUDIES[study]
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=s["seq"], d_model=width, n_layers=s["layers"], n_heads=HEADS))


def n_params(study: str, width: int) -> int:
    return gpt(study, width).num_params()


# -- inside each worker process ----------------------------------------------------------------
def worker(study: str, strategy: str, width: int, steps: int, precision: str, out_dir: str) -> None:
    """One job of `strategy`'s fixed plan; rank{R}.json says ok (with its figures), oom or
    peer-failed, and a rank that did not train leaves at once (its peers may be gone)."""
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain import Memory, Rebalancing, Reporting
    from hetrain.emulation import Emulation
    from hetrain.planning.plan import DevicePlan, Plan

    s, rank = STUDIES[study], int(os.environ["RANK"])
    shares, micros, ckpt, sharding = STRATEGIES[study][strategy]
    plan = Plan(global_batch=s["batch"], devices=tuple(
        DevicePlan(rank=r, device=name, speed=speed, share=shares[r], micro_batch=micros[r], checkpointing=ckpt[r])
        for r, (name, speed) in enumerate((("a100-80g", 1.0), ("rtx3090", 0.67)))))
    memory = Memory(oom_recovery=False, **({"margin": s["margin"]} if s["margin"] is not None else {}))
    ht = hetrain.init(global_batch=s["batch"], plan=plan, emulation=Emulation(cluster=SPEC), memory=memory,
                      reporting=Reporting(verbose=False), rebalancing=Rebalancing(enabled=False),
                      max_steps=steps, precision=precision, timeout_s=120)    # each strategy runs exactly its plan
    torch.manual_seed(0)
    mdl = gpt(study, width)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (s["batch"] * steps, s["seq"]), generator=g),
                                          torch.randint(0, VOCAB, (s["batch"] * steps, s["seq"]), generator=g))
    result = {"rank": rank, "status": "ok"}
    try:
        model, opt, batches = ht.prepare(mdl, torch.optim.AdamW(mdl.parameters(), lr=1e-3), data,
                                         parallel=hetrain.DataParallel(sharding=sharding))
        for step in batches:
            for mb in step:
                with mb:
                    x, y = mb.batch
                    with ht.autocast():
                        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                    ht.backward(loss)
            ht.step()
        summary = ht.summary()
        result.update(measured=[m["measured"] for m in summary["memory"]],
                      planned=[m["planned"] for m in summary["memory"]], caps=[m["cap"] for m in summary["memory"]],
                      held=[m["held_state"] for m in summary["memory"]], samples_per_s=summary["samples_per_s"])
    except torch.OutOfMemoryError as e:
        result = {"rank": rank, "status": "oom", "error": str(e)[:300]}
    except hetrain.HetrainError as e:
        if "out of memory" not in e.what and "does not fit" not in e.what:
            raise
        result = {"rank": rank, "status": "oom", "error": e.what[:300]}
    except RuntimeError as e:     # a peer ran out of memory and left: gloo reports the lost connection
        result = {"rank": rank, "status": "peer-failed", "error": str(e)[:300]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    if result["status"] == "ok":
        ht.close()
    else:
        os._exit(3)


# -- the driver --------------------------------------------------------------------------------
FORK = False     # --smoke: each job's ranks forked (_common.forked_ranks), not torchrun's fresh processes


def trial(study: str, strategy: str, width: int, steps: int, precision: str) -> dict:
    """The job in 2 fresh processes: {'fits': True, rank 0's figures...} or {'fits': False,
    'oom_rank', 'error'}; anything but success or an OOM raises."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--worker", study, strategy, str(width), str(steps), precision, tmp]
        if FORK:
            codes = forked_ranks(__file__, 2, argv, env={"OMP_NUM_THREADS": "1"}, check=False)
            proc = subprocess.CompletedProcess(argv, next((c for c in codes if c), 0), "",
                                               "(the ranks' stderr: above)")
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, *argv]
            proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                  timeout=600)
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    statuses = [r["status"] for r in results]
    if proc.returncode == 0 and statuses == ["ok", "ok"]:
        return {"fits": True, **results[0]}
    if "oom" in statuses:
        oom = next(r for r in results if r["status"] == "oom")
        return {"fits": False, "oom_rank": oom["rank"], "error": oom["error"]}
    raise RuntimeError(f"{strategy} width {width}: neither trained nor ran out of memory (exit {proc.returncode}, "
                       f"{statuses}):\n{proc.stderr[-3000:]}")


def largest(study: str, strategy: str, lo: int, hi: int, precision: str) -> tuple[int, dict, list[dict]]:
    """Binary search over widths lo..hi (multiples of the study's step) for the largest that
    trains: (width, its result, every width tried)."""
    step = STUDIES[study]["width_step"]
    tried, best, best_result = [], None, None
    a, b = max(1, lo // step), hi // step
    while a <= b:
        mid = (a + b) // 2
        width, t0 = mid * step, time.perf_counter()
        r = trial(study, strategy, width, STUDIES[study]["steps"], precision)
        tried.append({"width": width, "params": n_params(study, width), "trains": r["fits"]})
        print(f"  {strategy:<14} width {width:>4} ({n_params(study, width) / 1e6:5.2f}M params): "
              f"{'trains' if r['fits'] else 'out of memory on rank ' + str(r['oom_rank'])}  "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        if r["fits"]:
            best, best_result, a = width, r, mid + 1
        else:
            b = mid - 1
    if best is None:
        raise RuntimeError(f"{strategy}: even width {a * step} does not train")
    return best, best_result, tried


def strategies_study(args) -> dict:
    step, rows = STUDIES["strategies"]["width_step"], []
    for strategy in args.strategies.split(","):
        width, r, tried = largest("strategies", strategy, step, args.max_width, args.precision)
        shares, micros, ckpt, sharding = STRATEGIES["strategies"][strategy]
        rows.append({"strategy": strategy, "max_params": n_params("strategies", width), "d_model": width,
                     "peak_bytes_per_device": r["measured"], "planned_bytes_per_device": r["planned"],
                     "memory_cap_per_device": r["caps"], "shares": list(shares), "micro_batches": list(micros),
                     "checkpointing": list(ckpt), "sharding": sharding, "trials": len(tried)})
    base = rows[0]["max_params"]
    print(f"\n{'strategy':<14}{'max params':>12}{'vs ' + rows[0]['strategy']:>12}   peak per device (MiB ~ GB)")
    for row in rows:
        peaks = " / ".join(f"{b / 2**20:.1f}" for b in row["peak_bytes_per_device"])
        print(f"{row['strategy']:<14}{row['max_params'] / 1e6:>11.2f}M{row['max_params'] / base:>11.2f}x   {peaks}")
    return {"rows": rows, "setup": {"model": "GPT 4 layers, 4 heads, seq 64, vocab 256", "global_batch": 16,
                                    "precision": args.precision, "steps": STUDIES["strategies"]["steps"]}}


def capacity_full_study(args) -> dict:
    rows = {}
    for sharding in STRATEGIES["capacity-full"]:
        width, r, tried = largest("capacity-full", sharding, args.lo, args.hi, "fp32")
        rows[sharding] = {"d_model": width, "max_params": n_params("capacity-full", width),
                          "held_bytes_per_device": r["held"], "memory_cap_per_device": r["caps"], "trials": tried}
    ratio = rows["capacity-full"]["max_params"] / rows["fsdp"]["max_params"]
    print(f"largest trainable: fsdp {rows['fsdp']['max_params'] / 1e6:.2f}M (width {rows['fsdp']['d_model']}), "
          f"capacity-full {rows['capacity-full']['max_params'] / 1e6:.2f}M (width {rows['capacity-full']['d_model']}): "
          f"{ratio:.2f}x (bound (80 + 24) / (2 x 24) = 2.17x)", flush=True)
    both = rows["fsdp"]["d_model"]
    speeds = {s: [] for s in STRATEGIES["capacity-full"]}
    for k in range(args.rounds):
        for sharding in speeds:
            r = trial("capacity-full", sharding, both, args.steps, "fp32")
            if not r["fits"]:
                raise RuntimeError(f"{sharding} at width {both} ran out of memory in the throughput rounds")
            speeds[sharding].append(r["samples_per_s"])
            print(f"  round {k + 1}: {sharding:<14} width {both}: {r['samples_per_s']:.2f} samples/s", flush=True)
    median = {s: statistics.median(v) for s, v in speeds.items()}
    print(f"throughput at width {both}: fsdp {median['fsdp']:.2f}, capacity-full {median['capacity-full']:.2f} "
          f"samples/s: {median['capacity-full'] / median['fsdp']:.2f}x")
    return {"largest": rows, "param_ratio": ratio, "bound": (80 + 24) / (2 * 24),
            "throughput": {"d_model": both, "params": n_params("capacity-full", both), "samples_per_s": speeds,
                           "median": median, "ratio": median["capacity-full"] / median["fsdp"]},
            "setup": {"model": "GPT 16 layers, 4 heads, seq 32, vocab 256", "plan": {"shares": [5, 3],
                      "micro_batches": [5, 3], "checkpointing": [True, True]}, "optimizer": "AdamW",
                      "precision": "fp32", "memory_margin": STUDIES["capacity-full"]["margin"]}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        study, strategy, width, steps, precision, out = sys.argv[2:]
        return worker(study, strategy, int(width), int(steps), precision, out)
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--study", default="all", choices=[*STUDIES, "all"])
    p.add_argument("--strategies", default=",".join(STRATEGIES["strategies"]), help="study strategies: which")
    p.add_argument("--max-width", type=int, default=1024, help="study strategies: the widest searched")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="study strategies. auto: each card's own, computed in fp32 where this CPU runs it slowly "
                        "(activations then counted at fp32 size: an upper bound)")
    p.add_argument("--lo", type=int, default=64, help="study capacity-full: the narrowest searched")
    p.add_argument("--hi", type=int, default=256, help="study capacity-full: the widest searched")
    p.add_argument("--rounds", type=int, default=2, help="study capacity-full: interleaved throughput rounds")
    p.add_argument("--steps", type=int, default=6, help="study capacity-full: steps a throughput round")
    add_smoke(p)
    args = p.parse_args()
    # smoke: one width each (the search's bounds meet), one strategy, one throughput round
    apply_smoke(p, args, strategies="capacity", max_width=8, precision="fp32", lo=4, hi=4, rounds=1, steps=2)
    unknown = [s for s in args.strategies.split(",") if s not in STRATEGIES["strategies"]]
    if unknown:
        p.error(f"--strategies: unknown {', '.join(unknown)}; known: {', '.join(STRATEGIES['strategies'])}")
    if args.smoke:    # its throughput round is the search's own job (the same width and steps): run once
        globals()["trial"] = functools.cache(trial)
        globals()["FORK"] = True
    t0, out = time.perf_counter(), {"cluster": SPEC, "scale": "1 GB of the real cards -> 1 MiB emulated",
                                    "smoke": args.smoke}
    if args.study in ("strategies", "all"):
        out["strategies"] = strategies_study(args)
    if args.study in ("capacity-full", "all"):
        out["capacity_full"] = capacity_full_study(args)
    out["seconds"] = round(time.perf_counter() - t0)
    if args.json:
        from hetrain.hardware.host import host_facts

        Path(args.json).write_text(json.dumps({**out, "host": host_facts().to_dict()}, indent=2))


if __name__ == "__main__":
    main()
