"""Jobs of two ranks on the one GPU (NCCL refuses two ranks on one GPU, so they join over gloo,
with CUDA tensors in every collective), each rank its own process:

  oom          a real allocator OOM in rank 1's last backward (the one that syncs gradients; its
               memory capped after step 0 so the planned micro-batch no longer fits): recovered,
               the micro-batch halved, the step redone, the result the uncapped run's;
  gloo-shares  rank 1 throttled (it runs its forward 4 times over): the shares move to rank 0;
  cpu-gpu      rank 0 on cuda:0, rank 1 on the CPU: float64 parameters after uneven steps equal
               one process's on the whole batch.

Under --dry the last two run with both ranks on the CPU.
"""

from __future__ import annotations

from pathlib import Path

from common import (Claims, gib, join_gloo, leave_group, main, micro_batches, plan, read_metrics, remaining, run_ranks,
                    token_data, token_loss, tower, worker_main)

SCRIPT = str(Path(__file__).resolve())


def _device(kind: str):
    import torch

    return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")


# -- oom --------------------------------------------------------------------------------------------
def scratch_in_backward(per_sample: int, on: list):
    """An op whose backward allocates per_sample bytes a sample (while on[0]): the allocation that
    runs out of memory for real, half-way through the backward, after some buckets were sent."""
    import torch

    class Scratch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if on[0]:
                buf = torch.empty(grad.shape[0] * per_sample, dtype=torch.uint8, device=grad.device)
                del buf
            return grad

    return Scratch.apply


def oom_job(rank: int, *, capped: bool, sizes: dict) -> dict:
    import torch

    import hetrain
    from hetrain import Rebalancing, Reporting

    device = torch.device("cuda", 0)
    micro, per_sample = 32, 128 * 2**20      # 4 GiB of scratch at 32 samples, 2 GiB at 16
    ht = hetrain.init(global_batch=2 * micro, max_steps=4, shuffle=False, precision="fp32",
                      plan=plan([("cuda:0", micro, micro)] * 2, 2 * micro), rebalancing=Rebalancing(enabled=False),
                      reporting=Reporting(verbose=False))
    on = [False]
    torch.manual_seed(0)
    model = tower(sizes["d"], sizes["layers"], sizes["vocab"], hook=scratch_in_backward(per_sample, on))
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, batches = ht.prepare(model, opt, token_data(2 * micro * 4, sizes["seq"], sizes["vocab"]))
    on[0] = rank == 1
    losses, cap = [], None
    for step in batches:
        micro_batches(ht, model, step)
        losses.append(ht.step().loss)
        if capped and rank == 1 and step.index == 0:
            # room for this step's peak less a quarter of the scratch (1 GiB): the planned micro-batch
            # of 32 now runs out of memory in its backward; one of 16 (half the scratch and the
            # activations) fits with 1 GiB and more to spare
            torch.cuda.synchronize()
            cap = torch.cuda.max_memory_reserved(device) - micro * per_sample // 4
            torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, 0)
            torch.cuda.empty_cache()
    stats = torch.cuda.memory_stats(device)
    out = {"ooms": ht.ooms, "redone": ht.redone_steps, "micro": [d.micro_batch for d in ht.plan.devices],
           "version": ht.plan.version, "losses": losses, "cap": cap, "allocator_ooms": stats.get("num_ooms", 0),
           "reserved_end": torch.cuda.memory_reserved(device)}
    params = [p.detach().clone() for p in model.parameters()]
    ht.close()
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()
    return out, start, params


def oom_worker(rank: int, world: int, sizes: dict) -> dict:
    join_gloo("cuda")
    clean, start, reference = oom_job(rank, capped=False, sizes=sizes)
    oomed, _, params = oom_job(rank, capped=True, sizes=sizes)
    update = max((r - s).abs().max().item() for r, s in zip(reference, start))
    diff = max((p - r).abs().max().item() for p, r in zip(params, reference))
    leave_group()
    return {"clean": clean, "oom": oomed, "update": update, "diff": diff}


def oom(args) -> dict:
    if args.rehearse:
        return {"status": "skip", "figure": "", "reason": "rehearsal: needs the CUDA allocator", "details": {}}
    c = Claims()
    sizes = {"d": 1024, "layers": 8, "vocab": 256, "seq": 256}
    ranks = run_ranks(SCRIPT, "oom", 2, timeout=remaining(args), out=args.scratch, params={"sizes": sizes})
    r0, r1 = ranks
    o = r1["oom"]
    c.note("uncapped run", {k: r1["clean"][k] for k in ("ooms", "micro", "losses")})
    c.note("capped run (rank 1)", {**{k: o[k] for k in ("ooms", "redone", "micro", "version", "losses",
                                                         "allocator_ooms")},
                                    "cap": gib(o["cap"]), "reserved at the end": gib(o["reserved_end"])})
    c.expect(o["allocator_ooms"] >= 1, f"the CUDA allocator ran out of memory for real on rank 1 "
                                       f"({o['allocator_ooms']} OOMs in its memory_stats)")
    c.expect(o["ooms"] >= 1 and o["micro"][1] < 32 and o["micro"][0] == 32,
             f"recovered: rank 1's micro-batch 32 -> {o['micro'][1]} in plan v{o['version']}, rank 0's kept")
    c.expect(o["redone"] >= 1 and r0["oom"]["redone"] == o["redone"],
             f"the step was redone on both ranks (the OOM broke the gradient sync): {r0['oom']['redone']}, {o['redone']}")
    c.expect(len(o["losses"]) == 4, "every step of the capped run finished")
    c.expect(max(r["diff"] for r in ranks) <= 0.02 * max(r1["update"], 1e-12),
             f"its parameters are the uncapped run's (max |diff| {max(r['diff'] for r in ranks):.2e} against "
             f"updates of {r1['update']:.2e})")
    return c.outcome(f"micro 32 -> {o['micro'][1]}, {o['ooms']} OOM(s), {o['redone']} redone, "
                     f"diff/update {max(r['diff'] for r in ranks) / max(r1['update'], 1e-12):.1e}")


# -- gloo-shares ------------------------------------------------------------------------------------
def shares_worker(rank: int, world: int, kind: str, sizes: dict, steps: int, metrics_dir: str) -> dict:
    import torch

    import hetrain
    from hetrain import Reporting

    join_gloo(kind)
    device = _device(kind)
    share, micro = sizes["share"], sizes["micro"]
    ht = hetrain.init(global_batch=2 * share, max_steps=steps, shuffle=False, precision="fp32",
                      plan=plan([(str(device), share, micro)] * 2, 2 * share),
                      reporting=Reporting(verbose=False, metrics_dir=metrics_dir))
    torch.manual_seed(0)
    raw = tower(sizes["d"], sizes["layers"], sizes["vocab"])
    model, opt, batches = ht.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-4),
                                     token_data(2 * share * steps, sizes["seq"], sizes["vocab"]))
    losses = []
    for step in batches:
        for mb in step:
            with mb:
                x, y = mb.batch
                logits = model(x)
                if rank == 1:        # the emulated slowdown: this device does its forward 4 times
                    with torch.no_grad():
                        for _ in range(3):
                            raw(x)
                ht.backward(token_loss(logits, y))
        losses.append(ht.step().loss)
    summary = ht.summary()
    ht.close()
    leave_group()
    return {"shares": summary["shares"], "rebalances": summary["rebalances"], "losses": losses,
            "busy": [r["busy_s"] for r in summary["ranks"]]}


def gloo_shares(args) -> dict:
    c = Claims()
    kind = "cpu" if args.dry or args.rehearse else "cuda"
    sizes = ({"d": 128, "layers": 2, "vocab": 64, "seq": 32, "share": 16, "micro": 8} if kind == "cpu" else
             {"d": 512, "layers": 4, "vocab": 256, "seq": 2048, "share": 32, "micro": 8})
    steps = 12 if kind == "cpu" else 14
    metrics_dir = str(Path(args.scratch) / "shares-metrics")
    r0, _ = run_ranks(SCRIPT, "shares", 2, timeout=remaining(args), out=args.scratch,
                      params={"kind": kind, "sizes": sizes, "steps": steps, "metrics_dir": metrics_dir})
    moves = [(m["step"], m["shares_before"], m["shares_after"]) for m in read_metrics(metrics_dir)
             if m.get("event") == "rebalance"]
    c.note("rebalances (step, before, after)", moves)
    c.note("busy seconds per rank over the run", [round(b, 3) for b in r0["busy"]])
    c.expect(r0["rebalances"] >= 1 and r0["shares"][0] > r0["shares"][1],
             f"the shares moved to the unthrottled rank 0 ({sizes['share']}/{sizes['share']} -> "
             f"{r0['shares'][0]}/{r0['shares'][1]}, {r0['rebalances']} rebalance(s))")
    c.expect(all(x == x for x in r0["losses"]), "every step's loss is finite")
    where = f"both on {kind}"
    return c.outcome(f"{where}: shares {sizes['share']}/{sizes['share']} -> {r0['shares'][0]}/{r0['shares'][1]}")


# -- cpu-gpu ----------------------------------------------------------------------------------------
def small_net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


def net_data():
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 * 3, 16, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, x[:, :1].sin() + 0.1 * x[:, 1:2])


def cpu_gpu_worker(rank: int, world: int, kind: str) -> dict:
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain import Reporting

    mine = kind if rank == 0 else "cpu"
    join_gloo(mine)
    ht = hetrain.init(global_batch=64, max_steps=3, shuffle=False, precision="fp32", reporting=Reporting(verbose=False),
                      plan=plan([(str(_device(kind)), 40, 8), ("cpu", 24, 8)], 64))
    model = small_net()
    model, opt, batches = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), net_data())
    for step in batches:
        for mb in step:
            with mb:
                x, y = mb.batch
                ht.backward(F.mse_loss(model(x), y))
        ht.step()
    out = {"device": str(ht.device), "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()]}
    ht.close()
    leave_group()
    return out


def cpu_gpu(args) -> dict:
    import torch
    import torch.nn.functional as F

    c = Claims()
    kind = "cpu" if args.dry or args.rehearse else "cuda"
    ranks = run_ranks(SCRIPT, "cpu_gpu", 2, timeout=remaining(args), out=args.scratch, params={"kind": kind},
                      rank_env={1: {"CUDA_VISIBLE_DEVICES": ""}})
    model, data = small_net(), net_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(3):     # one process, the whole global batch of 64 a step (shuffle=False: in order)
        x, y = data.tensors[0][s * 64:(s + 1) * 64], data.tensors[1][s * 64:(s + 1) * 64]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    ref = [p.detach().flatten() for p in model.parameters()]
    diffs = [max((torch.tensor(q, dtype=torch.float64) - r).abs().max().item() for q, r in zip(got["params"], ref))
             for got in ranks]
    c.note("devices", [r["device"] for r in ranks])
    c.expect(ranks[0]["device"].startswith(kind) and ranks[1]["device"] == "cpu",
             f"rank 0 on {kind}, rank 1 on the CPU (got {[r['device'] for r in ranks]})")
    c.expect(max(diffs) <= 1e-10, f"3 steps of 40+24 samples in float64 equal one process on 64 "
                                  f"(max |diff| per rank {', '.join(f'{d:.1e}' for d in diffs)})")
    return c.outcome(f"{ranks[0]['device']}+cpu over gloo, max |diff| {max(diffs):.1e} against one process")


WORKERS = {"oom": oom_worker, "shares": shares_worker, "cpu_gpu": cpu_gpu_worker}
STEPS = {
    "oom": (oom, "a real CUDA allocator OOM"),
    "gloo-shares": (gloo_shares, None),
    "cpu-gpu": (cpu_gpu, None),
}

if __name__ == "__main__":
    if not worker_main(WORKERS):
        main(STEPS)
