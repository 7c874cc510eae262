"""The job benchmarks/chaos.py throws its faults at: what each `hetrain run` worker runs.

    hetrain run --emulate CLUSTER benchmarks/_chaos_job.py --layout NAME --steps N --ckpt DIR --out FILE

Float64 models (rounding near 1e-15, far below chaos.py's tolerance): a residual stack (data
parallelism, pipelines) and a tiny Hugging Face GPT-2 built from a config (TP split by speed),
trained with SGD (momentum) through the one loop of every layout. At the end rank 0 saves every
parameter whole, by the user's model's names, whatever the layout cut it into.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import hf_gpt2, train_steps
from chaos import DATASET, GLOBAL_BATCH, LAYOUTS, MICRO, PIPE_MICRO_BATCHES
from torch import nn
from torch.distributed.tensor import DTensor

import hetrain
from hetrain import Checkpoints, Memory, Rebalancing, Reporting
from hetrain.emulation import Emulation
from hetrain.parallel import PipelineParts
from hetrain.runtime.layouts.tensor.state import ShardState
from hetrain.runtime.layouts.tensor.uneven import sharded_parameters

TOKENS, VOCAB = 12, 64       # GPT-2: tokens per sample, vocabulary


class Residual(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc = nn.Linear(h, h)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class ChaosNet(nn.Module):
    """Residual blocks in a ModuleList: FSDP2's and capacity-full's units, a pipeline's cut points."""

    def __init__(self, n_blocks: int, d: int = 16, h: int = 32):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.blocks = nn.ModuleList(Residual(h) for _ in range(n_blocks))
        self.out = nn.Linear(h, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)

    def pipeline_parts(self):
        return PipelineParts(first=self.inp, blocks=tuple(self.blocks), last=self.out)


def gpt2():
    """GPT-2 of 2 layers, 8 heads (5/3 at 1 : 0.67), no dropout (the shards compute one model)."""
    return hf_gpt2(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=8)


def data(kind: str):
    g = torch.Generator().manual_seed(0)
    if kind == "gpt2":        # next-token prediction on random token sequences
        seq = torch.randint(0, VOCAB, (DATASET, TOKENS + 1), generator=g)
        return torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:])
    x = torch.randn(DATASET, 16, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.sin(x[:, :4]).sum(1, keepdim=True))


def token_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def layout_object(case):
    if case.parallel == "tp":
        return hetrain.TensorParallel(split="speed")
    if case.parallel in ("pp", "dp-pp"):
        return hetrain.Pipeline(stages=case.group if case.parallel == "dp-pp" else None,
                                micro_batches=PIPE_MICRO_BATCHES)
    return hetrain.DataParallel(sharding=case.sharding)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_parameters(model, optimizer) -> dict:
    """{whole-model name: tensor} over all ranks (a collective): capacity-full's units gathered,
    a split by speed's shards whole as its checkpoints hold them (runtime/layouts/tensor/state.py),
    FSDP2's and an even split's DTensors in full, each pipeline stage's own parameters."""
    sharding = getattr(optimizer, "sharding", None)
    if sharding is not None and hasattr(sharding, "full_parameters"):      # capacity-full
        return {n: t.detach().cpu().clone() for n, t in sharding.full_parameters().items()}
    if sharded_parameters(model.module):
        whole = ShardState(model.module, optimizer).save_dicts()[0]
        return {n: whole[n].detach().cpu().clone() for n, _ in model.module.named_parameters()}
    held = {id(p) for p in model.parameters()}
    mine = {n: full(p.detach()).cpu().clone() for n, p in model.module.named_parameters() if id(p) in held}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: t for part in reversed(everyone) for n, t in part.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    for flag in ("--layout", "--ckpt", "--out"):
        p.add_argument(flag, required=True)
    for flag in ("--steps", "--every"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--blocks", type=int, default=4)
    args = p.parse_args(argv)
    case = LAYOUTS[args.layout]
    # fp32 asked for: the float64 model stays float64. The controlled clock (sample_s) splits by
    # speed whatever this host's CPU does. Rebalancing only where the layout is about it: a
    # re-split does not change the math, a rebalanced share changes the order of a gradient's sum.
    ht = hetrain.init(global_batch=GLOBAL_BATCH, max_steps=args.steps,
                      checkpoints=Checkpoints(dir=args.ckpt, every=args.every),
                      reporting=Reporting(sample_log=f"{args.ckpt}/samples", verbose=True),
                      rebalancing=Rebalancing(enabled=case.resplit), memory=Memory(max_micro_batch=MICRO),
                      emulation=Emulation(sample_s=0.002), timeout_s=args.timeout, precision="fp32")
    torch.manual_seed(0)
    model = (gpt2() if case.model == "gpt2" else ChaosNet(args.blocks)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = token_loss if case.model == "gpt2" else F.mse_loss
    model, opt, batches = ht.prepare(model, opt, data(case.model), parallel=layout_object(case), loss_fn=loss_fn)
    train_steps(ht, batches)
    params = whole_parameters(model, opt)                             # (collective)
    if ht.is_main:
        # torchrun's restart count of the attempt that finished: every restart the faults caused
        torch.save({"params": params, "restarts": ht.ctx.restart}, args.out)
    ht.close()


if __name__ == "__main__":
    main()
