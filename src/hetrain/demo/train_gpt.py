"""The demo job: a small GPT learns the Python docs' text, its global batch split by device speed.

Run it through the launcher, which starts one process per (emulated) device:
    hetrain run --emulate a100-80g:1.0,rtx3090:0.67 -m hetrain.demo.train_gpt --steps 300
`hetrain demo` does exactly that. The loop below is the whole of what a user writes.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from ..runtime.engine import init
from .gpt import GPT, GPTConfig
from .text import ByteWindows, pydoc_bytes, split
from ..report import StepProgress, write_json
from ..vocabulary import PRECISION_REQUESTS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step, all devices together")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--precision", default="auto", choices=list(PRECISION_REQUESTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the run's figures here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    ht = init(global_batch=args.global_batch, max_steps=args.steps, seed=args.seed,
                      precision=args.precision)

    # Data: the standard library's pydoc topics, as bytes; 5% held out.
    train_bytes, val_bytes = split(pydoc_bytes())
    train = ByteWindows(train_bytes, args.seq_len)
    val = ByteWindows(val_bytes, args.seq_len)

    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 32))
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ht.print(f"model: GPT, {model.num_params() / 1e6:.2f}M parameters ({cfg.n_layers} layers, "
             f"d={cfg.d_model}, {cfg.n_heads} heads); data: pydoc topics, {len(train_bytes):,} bytes "
             f"-> {len(train):,} windows of {cfg.seq_len} (an epoch is "
             f"{len(train) / args.global_batch:.0f} steps)")

    model, opt, batches = ht.prepare(model, opt, train)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(      # linear warm-up, cosine to 10%
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1)))))

    with StepProgress(ht, len(batches)) as bar:
        for step in batches:
            for mb in step:
                with mb:
                    x, y = mb.batch
                    with ht.autocast():
                        logits = model(x)
                        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                    ht.backward(loss)
            ht.step()
            schedule.step()
            bar.update(step)

    summary = ht.summary()
    if ht.is_main:
        summary["val_loss"] = evaluate(model.module, val, ht, batches=8)
        ht.print(f"validation loss {summary['val_loss']:.3f} (uniform guess: ln 256 = {math.log(256):.3f})")
        ht.print("sample: " + repr(generate(model.module, b"def ", 80, ht.device)))
        if args.json:
            # the summary's figures, and the demo's own headline ones by name (`hetrain demo` adds wall_s)
            predicted = summary["predicted"].get("samples_per_s")
            measured = summary["samples_per_s"]
            write_json(args.json, {**summary, "predicted_samples_per_s": predicted,
                                   "prediction_error": predicted / measured - 1 if predicted and measured else None,
                                   "final_loss": summary["last_loss"]})
    ht.close()
    return summary


@torch.no_grad()
def evaluate(model, data, ht, batches: int) -> float:
    model.eval()
    n = min(len(data), batches * 32)
    xs, ys = zip(*(data[i] for i in range(0, n)))
    x, y = torch.stack(xs).to(ht.device), torch.stack(ys).to(ht.device)
    with ht.autocast():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.train()
    return loss.item()


@torch.no_grad()
def generate(model, prompt: bytes, n: int, device, temperature: float = 0.7) -> str:
    model.eval()
    g = torch.Generator(device=device).manual_seed(0)
    idx = torch.tensor([list(prompt)], device=device)
    for _ in range(n):
        logits = model(idx[:, -model.cfg.seq_len:])[:, -1] / temperature
        nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


if __name__ == "__main__":
    main()
