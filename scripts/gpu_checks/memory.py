"""Memory and optimizer truth on one GPU (a world of one, hetrain's public API):

  memory   the planned peak against the allocator's allocated and reserved peaks, and the
           capacity hetrain plans with against what mem_get_info says is free;
  scaler   fp16 with fused AdamW and the job's GradScaler: an inf injected into one gradient
           skips that step (parameters unchanged) and halves the loss scale;
  offload  optimizer state in host memory against on-device AdamW: the same parameters (float64),
           the state on the CPU, less device memory.
"""

from __future__ import annotations

from pathlib import Path

from common import Claims, device_of, gib, main, micro_batches, plan, read_metrics, token_data, tower


# -- internal figures (adapt these reads when hetrain's internals change) -------------------------
def read_capacity(ht, summary: dict):
    """The device capacity hetrain planned with: the plan's memory cap, else the summary's cap."""
    cap = ht.plan.devices[0].memory_cap_bytes
    return cap if cap else summary["memory"][0].get("cap")


def read_reserved_peak(summary: dict):
    """The reserved peak hetrain reports, where its memory row has one (a key naming 'reserved')."""
    row = summary["memory"][0]
    keys = [k for k in row if "reserved" in k and isinstance(row[k], (int, float))]
    return (keys[0], row[keys[0]]) if keys else (None, None)


def read_loss_scale(ht):
    """The job's loss scale now (fp16), None without one."""
    return ht.job.precision.loss_scale


class _CudaFigures:
    """The allocator's and the driver's figures (zeros on a CPU rehearsal)."""

    def __init__(self, device):
        import torch

        self.torch, self.device, self.on = torch, device, device.type == "cuda"
        if self.on:
            torch.cuda.init()

    def free(self):
        return self.torch.cuda.mem_get_info(self.device) if self.on else (0, 0)

    def card(self):
        return self.torch.cuda.get_device_properties(self.device).total_memory if self.on else 0

    def allocated(self):
        return self.torch.cuda.max_memory_allocated(self.device) if self.on else 0

    def reserved(self):
        return self.torch.cuda.max_memory_reserved(self.device) if self.on else 0


# -- memory ---------------------------------------------------------------------------------------
def memory(args) -> dict:
    import torch

    import hetrain
    from hetrain import Reporting

    c = Claims()
    device = device_of(args)
    cuda = _CudaFigures(device)
    free0, total = cuda.free()        # the context exists; nothing allocated yet
    c.note("mem_get_info at start", f"{gib(free0)} free of {gib(total)}; the card: {gib(cuda.card())}")
    d, layers, vocab, seq = (32, 2, 64, 8) if args.rehearse else (2048, 8, 1024, 256)
    ht = hetrain.init(global_batch=64, max_steps=6, precision="fp32" if args.rehearse else "bf16",
                      reporting=Reporting(verbose=False))
    torch.manual_seed(0)
    model = tower(d, layers, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, batches = ht.prepare(model, opt, token_data(64 * 6, seq, vocab))
    allocated = reserved = 0
    for step in batches:
        micro_batches(ht, model, step)
        ht.step()
        # hetrain resets the allocator's peaks as each step starts: read them as each ends
        allocated = max(allocated, cuda.allocated())
        reserved = max(reserved, cuda.reserved())
    free1, _ = cuda.free()
    summary = ht.summary()
    capacity = read_capacity(ht, summary)
    micro = ht.plan.devices[0].micro_batch
    ht.close()
    row = summary["memory"][0]
    planned, measured = row.get("planned"), row.get("measured")
    key, reported_reserved = read_reserved_peak(summary)
    c.note("hetrain", {"planned": gib(planned), "planned state": gib(row.get("planned_state")),
                       "planned activations": gib(row.get("planned_activations")), "measured": gib(measured),
                       "capacity": gib(capacity), "micro-batch": micro,
                       "reserved": gib(reported_reserved) if key else "not reported"})
    c.note("torch.cuda", {"max_memory_allocated": gib(allocated), "max_memory_reserved": gib(reserved),
                          "free at the end": gib(free1)})
    if not cuda.on:
        return c.outcome("rehearsal: no allocator figures on a CPU")

    def close(a, b, tolerance=0.02):
        return a is not None and b > 0 and abs(a - b) <= tolerance * b
    c.expect(close(measured, allocated) or close(measured, reserved),
             f"hetrain's measured peak is the allocator's ({gib(measured)}; allocated {gib(allocated)}, "
             f"reserved {gib(reserved)})")
    c.expect(planned is not None and 0.7 <= allocated / planned <= 1.15,
             f"the planned peak holds the allocated one within -30%/+15% (planned {gib(planned)}, "
             f"allocated {gib(allocated)}, x{allocated / planned if planned else 0:.2f})")
    c.expect(close(measured, reserved) or (key is not None and close(reported_reserved, reserved, 0.05)),
             f"hetrain reports the reserved peak, where fragmentation shows (torch: {gib(reserved)}, "
             f"{reserved / max(allocated, 1):.2f}x allocated; hetrain: measured {gib(measured)}"
             f"{', ' + key + ' ' + gib(reported_reserved) if key else ', no reserved figure'})")
    c.expect(capacity is not None and capacity <= free0 * 1.01,
             f"the capacity hetrain plans with ({gib(capacity)}) is at most what mem_get_info found free "
             f"({gib(free0)}; the card is {gib(total)}: the CUDA context and other processes are not usable)")
    return c.outcome(f"planned {gib(planned)}, allocated {gib(allocated)}, reserved {gib(reserved)}, "
                     f"capacity {gib(capacity)} of {gib(free0)} free")


# -- scaler ---------------------------------------------------------------------------------------
def scaler(args) -> dict:
    import torch

    import hetrain
    from hetrain import Rebalancing, Reporting

    c = Claims()
    device = device_of(args)
    inject, steps = 3, 6
    metrics_dir = str(Path(args.scratch) / "scaler-metrics")
    ht = hetrain.init(global_batch=32, max_steps=steps, precision="fp16", shuffle=False,
                      plan=plan([(str(device), 32, 16)], 32), rebalancing=Rebalancing(enabled=False),
                      reporting=Reporting(verbose=False, metrics_dir=metrics_dir))
    torch.manual_seed(0)
    model = tower(256, 2, 256)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    model, opt, batches = ht.prepare(model, opt, token_data(32 * steps, 64, 256))
    fused = any(g.get("fused") for g in opt.param_groups)
    moved, scales = [], []
    for step in batches:
        micro_batches(ht, model, step)
        if step.index == inject:        # one gradient overflows, as an fp16 overflow would
            params[0].grad.view(-1)[0] = float("inf")
        before, scale = [p.detach().clone() for p in params], read_loss_scale(ht)
        ht.step()
        moved.append(any(not torch.equal(a, p.detach()) for a, p in zip(before, params)))
        scales.append((scale, read_loss_scale(ht)))
    summary = ht.summary()
    finite = all(torch.isfinite(p).all().item() for p in params)
    ht.close()
    prec = summary["precision"]
    events = [m for m in read_metrics(metrics_dir) if m.get("event") == "skipped_step"]
    c.note("loss scale per step (before, after)", scales)
    c.note("parameters moved per step", moved)
    c.note("summary precision", {k: prec.get(k) for k in ("precision", "loss_scale", "skipped_steps", "skipped_at")})
    c.expect(fused, "the optimizer prepare() returned is still fused AdamW")
    c.expect(not moved[inject], f"step {inject} (inf injected) left every parameter as it was")
    c.expect(scales[inject][1] == scales[inject][0] / 2,
             f"the loss scale halved at step {inject} ({scales[inject][0]:g} -> {scales[inject][1]:g})")
    c.expect(inject in prec.get("skipped_at", []) and any(e["step"] == inject for e in events),
             f"the summary and metrics.jsonl record step {inject} as skipped")
    c.expect(moved[-1] and finite, "later steps train again, every parameter finite")
    return c.outcome(f"fused={fused}, step {inject} skipped={not moved[inject]}, "
                     f"scale {scales[inject][0]:g} -> {scales[inject][1]:g}, {prec.get('skipped_steps')} skipped")


# -- offload --------------------------------------------------------------------------------------
def offload_run(args, mode: str) -> dict:
    import torch

    import hetrain
    from hetrain import Memory, Rebalancing, Reporting

    device = device_of(args)
    ht = hetrain.init(global_batch=32, max_steps=4, precision="fp32", shuffle=False,
                      plan=plan([(str(device), 32, 16)], 32), memory=Memory(offload_optimizer=mode),
                      rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False))
    torch.manual_seed(0)
    model = tower(512, 4, 256).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, batches = ht.prepare(model, opt, token_data(32 * 4, 32, 256))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in batches:
        micro_batches(ht, model, step)
        ht.step()
    state_devices = sorted({v.device.type for s in opt.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0})
    out = {"params": [p.detach().cpu() for p in model.parameters()],
           "state": state_devices, "offload": ht.plan.devices[0].offload_optimizer,
           "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0}
    ht.close()
    return out


def offload(args) -> dict:
    c = Claims()
    on_device = offload_run(args, "never")
    host = offload_run(args, "always")
    diff = max((a - b).abs().max().item() for a, b in zip(on_device["params"], host["params"]))
    c.note("optimizer state lives on", {"never": on_device["state"], "always": host["state"]})
    c.note("device peak", {"never": gib(on_device["peak"]), "always": gib(host["peak"])})
    c.expect(host["offload"] and host["state"] == ["cpu"], "Memory(offload_optimizer='always'): the plan offloads, "
             f"the optimizer state is on the CPU (on {host['state']})")
    c.expect(on_device["state"] == [device_of(args).type], f"on-device AdamW keeps its state on the device "
                                                           f"(on {on_device['state']})")
    c.expect(diff <= 1e-9, f"4 AdamW steps in float64: offloaded parameters equal on-device ones (max |diff| {diff:.2e})")
    if not args.rehearse:
        c.expect(host["peak"] < on_device["peak"], "the offloaded job's device peak is lower")
    return c.outcome(f"max |diff| {diff:.1e}, state on {host['state']}, peak {gib(host['peak'])} vs "
                     f"{gib(on_device['peak'])}")


STEPS = {
    "memory": (memory, "the CUDA allocator's peaks and mem_get_info"),
    "scaler": (scaler, "fused AdamW with the fp16 GradScaler on CUDA"),
    "offload": (offload, "pinned host copies against on-device AdamW"),
}

if __name__ == "__main__":
    main(STEPS)
