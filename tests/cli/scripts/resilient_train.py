"""A small job for the restart tests: trains, checkpoints, logs samples, writes its parameters."""

import argparse

import torch
import torch.nn.functional as F

import hetrain
from hetrain import Checkpoints, Rebalancing, Reporting
from hetrain.emulation import Emulation

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--every", type=int, default=2)
p.add_argument("--resume", default="auto")
p.add_argument("--width", type=int, default=32)
p.add_argument("--timeout", type=float, default=60)
p.add_argument("--pause", type=float, default=0.0, help="seconds of the user's own work after each step")
p.add_argument("--hold", help="after each step, wait while this file exists (a test holds the job at a step)")
p.add_argument("--pids", help="each rank writes its pid here (pid-rank{r}), for tests that signal one")
p.add_argument("--attempts", help="each rank appends its restart attempt here before anything else")
args = p.parse_args()
if args.attempts:
    import os

    with open(args.attempts, "a") as f:
        f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "?") + "\n")

# The controlled clock (2 ms a sample at speed 1): this model's real compute is ~0.2 ms a step, all
# fixed costs, so a measured split is decided by timing noise (it can give the slow device one
# sample, which an escaped OOM then cannot halve); on the clock the split is the speeds' 10/6.
ht = hetrain.init(global_batch=16, max_steps=args.steps,
                  checkpoints=Checkpoints(dir=args.ckpt, every=args.every, resume=args.resume),
                  reporting=Reporting(sample_log=f"{args.ckpt}/samples", verbose=True),
                  rebalancing=Rebalancing(enabled=False), emulation=Emulation(sample_s=0.002), timeout_s=args.timeout)
g = torch.Generator().manual_seed(0)
x = torch.randn(40, 8, generator=g)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
ht.register_state("schedule", schedule)
model, opt, batches = ht.prepare(model, opt, data)
if args.pids:
    import os

    os.makedirs(args.pids, exist_ok=True)
    with open(f"{args.pids}/pid-rank{ht.rank}", "w") as f:
        f.write(str(os.getpid()))
for step in batches:
    for mb in step:
        with mb:
            xb, yb = mb.batch
            ht.backward(F.mse_loss(model(xb), yb))
    ht.step()
    schedule.step()
    if args.pause:
        import time

        time.sleep(args.pause)
    if args.hold:
        import os
        import time

        while os.path.exists(args.hold):
            time.sleep(0.05)
if ht.is_main:
    torch.save({"params": [p.detach() for p in model.parameters()], "lr": schedule.get_last_lr()}, args.out)
ht.close()
