"""`hetrain plan`'s FSDP2 probe (runtime/measure/fsdp_probe.py) on two real gloo ranks: it times
an FSDP2 step beside a DDP step on copies of the model and optimizer, and leaves the job's own
model, its gradients and its optimizer as they were. The timing is a measurement: the test
checks it is one (positive, from the runs asked for), not how large it is on this host."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain.runtime.measure.fsdp_probe import paired_excess

pytestmark = pytest.mark.dist


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(3))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def probe(rank, clock=None):
    """The probe on this rank's model, in the ranks' process group; `clock`: the controlled clock's
    seconds a sample (the ranks at speeds 1 and 0.5), else the CPU's own clock."""
    from hetrain.emulation.device import Throttle
    from hetrain.emulation.profiling import EmulatedMeasuring
    from hetrain.hardware.cluster import parse_cluster
    from hetrain.runtime.measure.fsdp_probe import time_fsdp_excess

    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(12, 8, generator=g)
    batch = (x, x.sum(1, keepdim=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def forward(m, b):
        return F.mse_loss(m(b[0]), b[1])

    throttle = Throttle(1.0 / (1 + rank), sample_s=clock) if clock else None     # speeds 1 and 0.5
    spec = parse_cluster("a100-80g:1.0,rtx3090:0.5")[rank]
    measuring = EmulatedMeasuring(spec, throttle, torch.device("cpu")) if clock else None
    found = time_fsdp_excess(model, opt, ["blocks.0", "blocks.1", "blocks.2"], batch, forward=forward,
                             device=torch.device("cpu"), precision="fp32", runs=3 if clock is None else 2,
                             measuring=measuring)
    same = all(torch.equal(before[n], p) and not hasattr(p, "device_mesh") for n, p in model.named_parameters())
    grads = [p.grad for p in model.parameters()]
    return {**found, "unchanged": same, "no_grads": all(gr is None for gr in grads), "no_state": not opt.state,
            "throttled_s": throttle.cpu_seconds if throttle else 0.0}


def worker(rank, world):
    """The probe on the CPU's clock, then on the controlled clock, in one process group."""
    from pipeline_runs import join_group

    join_group()
    return {"cpu": probe(rank), "clock": probe(rank, 0.02)}


@pytest.fixture(scope="module")
def runs():
    results = run_ranks(worker, 2, timeout=180)
    return {clock: [r[clock] for r in results] for clock in results[0]}


def test_the_fsdp_probe_times_both_steps_on_copies_and_leaves_the_model_as_it_was(runs):
    r0, r1 = runs["cpu"]
    for r in (r0, r1):
        assert r["unchanged"] and r["no_grads"] and r["no_state"]
        assert r["fsdp_s"] > 0 and r["ddp_s"] > 0 and r["runs"] == 3 and r["micro_batch"] == 12
        assert len(r["pairs"]) == 3 and r["excess_s"] == paired_excess(r["pairs"])


def test_on_the_controlled_clock_both_steps_last_the_slowest_ranks_clocked_forward_and_backward(runs):
    # 12 rows at 20 ms a sample: 0.24 s at speed 1, 0.48 s at 0.5; from barrier to barrier each
    # step lasts at least the slower rank's clocked length (Throttle.before_backward's clock, as
    # the engine runs it), whatever the host's CPU does
    r0, r1 = runs["clock"]
    for r in (r0, r1):
        assert r["unchanged"] and r["no_grads"] and r["no_state"] and r["runs"] == 2
        assert r["ddp_s"] >= 12 * 0.02 / 0.5 and r["fsdp_s"] >= 12 * 0.02 / 0.5, r
        # paced by fresh books of the device: the job's own throttle has booked nothing
        assert r["throttled_s"] == 0.0
        assert len(r["pairs"]) == 2 and r["excess_s"] == paired_excess(r["pairs"])


def test_a_slow_phase_that_hits_both_steps_of_a_pair_cancels_from_the_excess():
    # FSDP2 costs 30 ms more than DDP in every pair; the host is 50% slower for the first two
    # pairs (both steps alike), and one FSDP2 step of the fast phase is disturbed. The pairs'
    # median difference still reads 30 ms; the difference of the medians reads 130 ms (FSDP2's
    # median lands in the slow phase, DDP's in the fast one).
    pairs = [(0.30, 0.33), (0.30, 0.33), (0.20, 0.23), (0.20, 0.23), (0.20, 0.40)]
    assert paired_excess(pairs) == pytest.approx(0.03)
    # never below zero: DDP timed slower than FSDP2 means no excess, not a discount
    assert paired_excess([(0.25, 0.20), (0.25, 0.21), (0.25, 0.22)]) == 0.0
