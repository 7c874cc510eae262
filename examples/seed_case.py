"""The seed's case, scaled to fit a laptop: a GPT whose training state fits an A100-80G but not an
RTX 3090 beside it, trained with parallel='auto' through a crash and an out-of-memory error.

    hetrain run --emulate "a100-80g@40MiB,rtx3090@12MiB" --max-restarts 3 \\
        --faults "oom:rank=1,step=3,micro=0;die:rank=1,step=7" examples/seed_case.py

The emulated caps are the real cards' 80 GB : 24 GB scaled down to 40 MiB : 12 MiB (the same
10 : 3), and the model is sized against them, not the other way round:

  * its training state (fp32 parameters + gradients + AdamW's two moments: 4x the parameter
    bytes) fits the "80 GB" card, so one big device alone could train it;
  * it does not fit the "24 GB" card, and neither does any data-parallel sharding of it: even
    FSDP's even split leaves each of two devices half the state, which is 2x the parameter bytes
    here, more than the small card holds (24/80 < 1/2). Capacity-proportional sharding keeps
    whole parameters and gradients on every device (2x the parameter bytes too), so it does
    not fit either;
  * so parallel='auto' chooses a pipeline, the A100 holding most of the blocks (it prints why).

The faults (hetrain's fault injection, emulated devices only) are the seed's bad day: at step 3
the RTX 3090 runs out of memory in its first micro-batch (both ranks agree, halve the pipeline's
micro-batch and redo the step, in the loop), and at step 7 its process is killed with SIGKILL
(`hetrain run --max-restarts` restarts the job, which resumes from the checkpoint of step 5 with
no sample lost or repeated). The final loss equals that of a run without faults
(tests/cli/test_seed_case.py checks it, and the parameters).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hetrain
from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.hardware.cluster import parse_cluster
from hetrain import Checkpoints, Reporting

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30, help="optimizer steps (the test runs fewer)")
p.add_argument("--ckpt", default="seed_case_ckpt", help="checkpoint directory (resumed from when it has one)")
p.add_argument("--every", type=int, default=5, help="steps between checkpoints")
p.add_argument("--out", help="rank 0 writes the final loss and the whole model's parameters here (torch.save)")
args = p.parse_args()

# -- the job ------------------------------------------------------------------------------------
GLOBAL_BATCH = 16
ht = hetrain.init(global_batch=GLOBAL_BATCH, max_steps=args.steps, seed=0,
                  checkpoints=Checkpoints(dir=args.ckpt, every=args.every),
                  reporting=Reporting(sample_log=f"{args.ckpt}/samples"))

# -- data: Python's own documentation, byte by byte (vocabulary 256) ---------------------------
SEQ_LEN = 64
train = ByteWindows(split(pydoc_bytes())[0], seq_len=SEQ_LEN)
ht.print(f"data: {len(train)} windows of {SEQ_LEN} bytes of pydoc text; {GLOBAL_BATCH} windows a step")

# -- the model: sized so its training state fits the big card and not the small one ------------
torch.manual_seed(0)                     # the same initial weights on every rank and every attempt
CONFIG = GPTConfig(seq_len=SEQ_LEN, d_model=128, n_layers=8, n_heads=4)
LR, WEIGHT_DECAY = 3e-3, 0.01
model = GPT(CONFIG)
param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
state = 4 * param_bytes                  # fp32 parameters + gradients + AdamW's exp_avg and exp_avg_sq
MiB = 2 ** 20
ht.print(f"model: {model.num_params() / 1e6:.2f}M parameters ({CONFIG.n_layers} blocks of width {CONFIG.d_model}), "
         f"{param_bytes / MiB:.1f} MiB; training state {state / MiB:.1f} MiB (4x: parameters, gradients, "
         "AdamW's two moments)")
for d in parse_cluster(ht.config.emulation.cluster) if ht.config.emulation.cluster else ():
    cap = d.memory_bytes
    ht.print(f"  {d.label} holds {cap / MiB:.0f} MiB: the whole state {'fits' if state < cap else 'does not fit'}; "
             f"FSDP's half of it ({state / 2 / MiB:.1f} MiB) {'fits' if state / 2 < cap else 'does not fit'}")


def loss_fn(logits, targets):            # a mean over the samples it is given: what ht.loss(mb) computes
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
model, opt, batches = ht.prepare(model, opt, train, parallel="auto", loss_fn=loss_fn)   # prints its choice

# -- the loop: the same for every layout ---------------------------------------------------------
loss = None                              # stays None when a finished job is run again (nothing left to do)
for step in batches:
    for mb in step:                      # this rank's micro-batches (under a pipeline: its replica's)
        with mb:                         # an OOM in here: agreed by every rank, micro-batch halved, redone
            ht.backward(ht.loss(mb))     # under a pipeline: recorded, run by the schedule after the last one
    ht.step()                            # optimizer step; step.loss is the mean over the whole global batch
    loss = step.loss
    if step.index % 5 == 0 or step.index == ht.total_steps - 1:
        ht.print(f"step {step.index:3d}  loss {step.loss:.4f}  micro-batch {ht.current_micro_batch}  "
                 f"{step.samples_per_s:.0f} samples/s")

# -- the result: the whole model, gathered from the stages ---------------------------------------
# Under a pipeline each rank holds (and trained) only its stage's parameters; model.module is the
# user's whole model with the others untouched. Each rank sends what it holds, by whole-model name.
mine = {id(q) for q in model.parameters()}
held = {n: q.detach().clone() for n, q in model.module.named_parameters(remove_duplicate=False) if id(q) in mine}
every = [None] * ht.world_size
dist.all_gather_object(every, held)
if ht.is_main:
    whole = {}
    for part in every:
        whole.update(part)
    ht.print(f"final loss {loss:.6f} after {ht.steps_done} steps" if loss is not None else
             f"nothing to do: {args.ckpt} holds a finished job of {ht.steps_done} steps (delete it to start over)")
    if args.out:
        torch.save({"loss": loss, "params": whole, "steps": ht.steps_done, "layout": ht.plan.layout,
                    "config": vars(CONFIG), "lr": LR, "weight_decay": WEIGHT_DECAY}, args.out)
ht.summary()
ht.close()
