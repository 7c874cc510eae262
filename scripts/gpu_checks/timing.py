"""Timing truth: each figure hetrain's clocks report, against CUDA events around the same work.

Kernels run after the host call returns, so a clock read without a synchronize or an event
measures launch time. The rebalancer and the pipeline re-split act on these figures:

  timing-dp        a data-parallel job (world of one) in bf16 and fp16, 4 micro-batches a step,
                   and bf16 with one micro-batch under activation checkpointing: each step's
                   compute_s (metrics.jsonl), the loop's own compute figure, and the optimizer
                   step's busy time, each against events around the user's forward+backward and
                   around ht.step();
  timing-pipeline  a one-stage pipeline (every piece a CUDA stage runs: forward, loss, backward),
                   each piece's figure against events around it.

The model is an MLP tower with large matrix products and few kernels: device time far above
launch time, so a clock that reads launch time is off by a factor, not by a margin.
"""

from __future__ import annotations

import math
from pathlib import Path

from common import Claims, Clock, device_of, main, median, plan, read_metrics, ratio, token_data, token_loss, tower

STEPS, WARM = 8, 2            # steps run, of which the first WARM are not compared (cuBLAS setup, caches)
BATCH = 64


def sizes(args) -> dict:
    if args.rehearse:
        return {"d": 32, "layers": 2, "vocab": 64, "seq": 8}
    return {"d": 2048, "layers": 8, "vocab": 1024, "seq": 256}


# -- internal figures (hetrain's internals change: adapt these two reads, nothing else) -----------
def read_loop_compute_s(ht):
    """The loop's own compute figure of the last step (forward + backward as the host clock saw
    them; the step's agreement table's compute_s), or None where it is gone."""
    hooks = getattr(ht.job, "hooks", None)
    read = getattr(hooks, "attempt_compute_s", None)
    return read() if callable(read) else getattr(hooks, "compute_s", None)


def read_optimizer_s(ht):
    """The busy time of the last step outside its micro-batches (the optimizer step), as the
    rebalancer is fed it, or None where it is gone."""
    hooks = getattr(ht.job, "hooks", None)
    read = getattr(hooks, "last_fixed_s", None)
    return read() if callable(read) else getattr(vars(ht).get("_loop"), "fixed_s", None)


# -- timing-dp ------------------------------------------------------------------------------------
def dp_run(args, *, precision: str, micro: int, checkpointing: str, metrics_dir: str) -> dict:
    import torch

    import hetrain
    from hetrain import Memory, Rebalancing, Reporting

    s = sizes(args)
    device = device_of(args)
    ht = hetrain.init(global_batch=BATCH, max_steps=STEPS, precision=precision, shuffle=False,
                      plan=plan([(str(device), BATCH, micro)], BATCH),
                      memory=Memory(activation_checkpointing=checkpointing, blocks="Block"),
                      rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False, metrics_dir=metrics_dir))
    torch.manual_seed(0)
    model = tower(s["d"], s["layers"], s["vocab"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, batches = ht.prepare(model, opt, token_data(BATCH * STEPS, s["seq"], s["vocab"]))
    clock = Clock(ht.device)
    rows = []
    for step in batches:
        marks = []
        for mb in step:
            with mb:
                a = clock.mark()
                x, y = mb.batch
                with ht.autocast():
                    loss = token_loss(model(x), y)
                ht.backward(loss)
                marks.append((a, clock.mark()))
        o0 = clock.mark()
        ht.step()
        o1 = clock.mark()
        clock.settle()
        rows.append({"events_compute_s": sum(clock.seconds(a, b) for a, b in marks),
                     "events_optimizer_s": clock.seconds(o0, o1), "loop_compute_s": read_loop_compute_s(ht),
                     "optimizer_s": read_optimizer_s(ht), "micro_batches": len(marks)})
    ht.close()
    for row, line in zip(rows, [m for m in read_metrics(metrics_dir) if "step" in m and "event" not in m]):
        row["compute_s"], row["sync_s"] = line["devices"][0]["compute_s"], line["devices"][0]["sync_s"]
    return {"rows": rows[WARM:]}


def timing_dp(args) -> dict:
    c = Claims()
    figures = []
    cases = (("bf16", 16, "none"), ("fp16", 16, "none"), ("bf16", BATCH, "all"))
    for precision, micro, ckpt in cases:
        name = f"{precision}, {BATCH // micro} micro-batch{'es' if micro < BATCH else ''}" + \
               (", checkpointing" if ckpt == "all" else "")
        print(f"- {name}", flush=True)
        rows = dp_run(args, precision=precision, micro=micro, checkpointing=ckpt,
                      metrics_dir=str(Path(args.scratch) / f"timing-{precision}-{micro}"))["rows"]
        truth = median(r["events_compute_s"] for r in rows)
        got = median(r.get("compute_s", math.nan) for r in rows)
        opt_truth = median(r["events_optimizer_s"] for r in rows)
        c.note(name, {"events forward+backward ms": round(truth * 1e3, 2),
                      "metrics compute_s ms": round(got * 1e3, 2),
                      "metrics sync_s ms": round(median(r.get("sync_s", math.nan) for r in rows) * 1e3, 2),
                      "events optimizer ms": round(opt_truth * 1e3, 2)})
        c.expect(0.85 <= ratio(got, truth) <= 1.2,
                 f"{name}: metrics.jsonl compute_s is the events' forward+backward "
                 f"({got * 1e3:.1f} ms vs {truth * 1e3:.1f} ms, x{ratio(got, truth):.2f})")
        figures.append(f"{precision}{'/ckpt' if ckpt == 'all' else ''} x{ratio(got, truth):.2f}")
        loop = [r["loop_compute_s"] for r in rows if r["loop_compute_s"] is not None]
        if loop:
            c.expect(0.85 <= ratio(median(loop), truth) <= 1.25,
                     f"{name}: the loop's compute figure is the events' ({median(loop) * 1e3:.1f} ms, "
                     f"x{ratio(median(loop), truth):.2f})")
        else:
            c.note(f"{name}: the loop's compute figure", "not readable here (read_loop_compute_s)")
        opt = [r["optimizer_s"] for r in rows if r["optimizer_s"] is not None]
        if opt and ckpt != "all":
            got_opt = median(opt)
            c.expect(abs(got_opt - opt_truth) <= max(0.3 * opt_truth, 5e-4),
                     f"{name}: the optimizer step's busy time is the events' around ht.step() "
                     f"({got_opt * 1e3:.2f} ms vs {opt_truth * 1e3:.2f} ms, x{ratio(got_opt, opt_truth):.2f})")
            figures[-1] += f", opt x{ratio(got_opt, opt_truth):.2f}"
        elif not opt:
            c.note(f"{name}: the optimizer's busy time", "not readable here (read_optimizer_s)")
    return c.outcome("compute " + "; ".join(figures))


# -- timing-pipeline ------------------------------------------------------------------------------
def build_one_stage(module, device, *, micro_batches: int, precision: str):
    """hetrain's pipeline stage (every piece metered as the runtime meters it) holding the whole
    model, its loss over row ids, and the runtime's schedule: (stage, loss, schedule). Internal:
    adapt here when the stage's construction changes."""
    from torch.distributed.pipelining import Schedule1F1B

    from hetrain.runtime.devices.precision_policy import PrecisionPolicy
    from hetrain.runtime.layouts.pipeline.blocks import param_storage_ptrs
    from hetrain.runtime.layouts.pipeline.stage import Flight, MeteredStage, RowLoss

    policy = PrecisionPolicy.local(precision, device=device)
    policy.agree(rank=0, world_size=1, device=device)
    stage = MeteredStage(module, 0, 1, device, flight=Flight(param_storage_ptrs(module), count_bytes=False),
                         precision=policy)
    loss = RowLoss(token_loss, replicas=1, stage=stage, precision=policy)
    return stage, loss, Schedule1F1B(stage, micro_batches, loss_fn=loss, scale_grads=False)


def meter_pieces(stage, clock) -> list:
    """Events around each piece the stage meters, beside the figure it booked for that piece
    (its compute_s before and after), appended to the list returned. Internal: the pieces are
    MeteredStage.timed calls."""
    timed, pieces = stage.timed, []

    def around(run, share: float = 0.0):
        kind = "loss" if share == 0 else "forward" if share < 0.5 else "backward"
        before, a = stage.compute_s, clock.mark()
        try:
            return timed(run, share)
        finally:
            pieces.append((kind, a, clock.mark(), stage.compute_s - before))
    stage.timed = around
    return pieces


def timing_pipeline(args) -> dict:
    import torch
    import torch.distributed as dist

    c = Claims()
    s = sizes(args)
    device = device_of(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, device_id=device if device.type == "cuda" else None)
    m, mu = 4, 16
    torch.manual_seed(0)
    module = tower(s["d"], s["layers"] // 2, s["vocab"]).to(device)
    precision = "fp32" if args.rehearse else "bf16"
    stage, loss, schedule = build_one_stage(module, device, micro_batches=m, precision=precision)
    clock = Clock(device)
    data = token_data(m * mu, s["seq"], s["vocab"])
    x, y = (t.to(device) for t in data.tensors)
    rows = torch.arange(m * mu, device=device)
    per_step = []
    pieces = meter_pieces(stage, clock)
    for i in range(STEPS):
        pieces.clear()
        stage.begin_step(i, m)
        loss.begin(y, [mu] * m, [float(mu)] * m, m * mu)
        schedule.step(x, target=rows, losses=[], return_outputs=False)
        clock.settle()
        module.zero_grad(set_to_none=True)
        per_step.append([(k, clock.seconds(a, b), got) for k, a, b, got in pieces])
    dist.destroy_process_group()
    kept = [p for step in per_step[WARM:] for p in step]
    total_truth, total_got = sum(t for _, t, _ in kept), sum(g for _, _, g in kept)
    figure = [f"all x{ratio(total_got, total_truth):.2f}"]
    for kind in ("forward", "loss", "backward"):
        truth = sum(t for k, t, _ in kept if k == kind)
        got = sum(g for k, _, g in kept if k == kind)
        n = sum(k == kind for k, _, _ in kept)
        c.note(kind, {"pieces": n, "events ms": round(truth * 1e3, 2), "hetrain ms": round(got * 1e3, 2)})
        if n:
            c.expect(abs(got - truth) <= max(0.25 * truth, 5e-4 * n),
                     f"{kind} pieces: hetrain's figure is the events' ({got * 1e3:.1f} ms vs {truth * 1e3:.1f} ms "
                     f"over {n} pieces, x{ratio(got, truth):.2f})")
            figure.append(f"{kind} x{ratio(got, truth):.2f}")
    c.expect(0.85 <= ratio(total_got, total_truth) <= 1.25,
             f"a step's pieces together: {total_got * 1e3:.1f} ms vs the events' {total_truth * 1e3:.1f} ms")
    return c.outcome(", ".join(figure))


STEPS_TABLE = {
    "timing-dp": (timing_dp, "CUDA events against the loop's clocks"),
    "timing-pipeline": (timing_pipeline, "CUDA events against the pipeline stage's clocks"),
}

if __name__ == "__main__":
    main(STEPS_TABLE)
