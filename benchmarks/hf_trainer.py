"""A run_clm-style Trainer script, stock transformers.Trainer in one process against hetrain's
Trainer (the one changed import) on the emulated a100-80g,rtx3090 pair, at the same global batch.

The script (written to a temporary directory, as a user's would be) trains a small GPT-2 built
from its config on byte-level windows of Python's documentation with run_clm's shape of
TrainingArguments: per-device batch and gradient accumulation, a cosine schedule with warm-up,
evaluation every --eval-steps, logging, checkpoints, then trainer.evaluate() and the perplexity.
Stock runs it as `python train.py` with per_device_train_batch_size x 2, so its global batch is
the pair's (per_device x accumulation x 2 devices); hetrain as `hetrain run --emulate
a100-80g,rtx3090 train.py`. One stock process gets one CPU thread, as each emulated device does
(one device against two). The rounds alternate; the table shows each run's whole wall time
(process start to exit: imports, planning and profiling included) and the Trainer's own
train_runtime.

    python benchmarks/hf_trainer.py [--steps 60] [--rounds 2] [--json out.json] [--smoke]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _common import Parser, add_smoke, apply_smoke, launched  # noqa: E402

CLUSTER = "a100-80g,rtx3090"
SCRIPT = textwrap.dedent('''
    import json, math, sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, default_data_collator
    from hetrain.demo.text import ByteWindows, pydoc_bytes, split
    if sys.argv[1] == "hetrain":
        from hetrain.integrations.transformers import Trainer
    else:
        from transformers import Trainer
        torch.set_num_threads(1)             # one device's worth, as each emulated device

    out, per_device, accum, steps, eval_steps, width, seq = sys.argv[2], *map(int, sys.argv[3:9])

    class Blocks(torch.utils.data.Dataset):  # run_clm's group_texts: fixed blocks, labels = input_ids
        def __init__(self, data, n=None):
            self.w = ByteWindows(data, seq_len=seq)
            self.n = min(n or len(self.w), len(self.w))
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            x, _ = self.w[i]
            return {"input_ids": x.long(), "labels": x.long()}

    train, valid = split(pydoc_bytes())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=seq, n_embd=width, n_layer=2,
                                       n_head=max(1, width // 32), bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accum, max_steps=steps, learning_rate=3e-3,
                             lr_scheduler_type="cosine", warmup_steps=max(1, steps // 10), logging_steps=10,
                             eval_strategy="steps", eval_steps=eval_steps, save_steps=eval_steps,
                             per_device_eval_batch_size=per_device, dataloader_num_workers=0,
                             report_to="none", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(train), eval_dataset=Blocks(valid, 256),
                      data_collator=default_data_collator)
    result = trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print("RESULT " + json.dumps({"train_runtime": result.metrics["train_runtime"],
                                      "train_loss": result.training_loss, "eval_loss": metrics["eval_loss"],
                                      "perplexity": math.exp(metrics["eval_loss"]),
                                      "global_step": result.global_step}))
''')


def run(kind: str, script: Path, work: Path, a) -> dict:
    out = work / f"out-{kind}"
    per_device = a.per_device * 2 if kind == "stock" else a.per_device     # the same global batch
    argv = [str(script), kind, str(out), str(per_device), str(a.accum), str(a.steps), str(a.eval_steps),
            str(a.width), str(a.seq)]
    cmd = [sys.executable, *argv] if kind == "stock" else \
        [sys.executable, "-m", "hetrain", "run", "--emulate", CLUSTER, *argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    started = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=a.timeout)
    wall = time.perf_counter() - started
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 or len(lines) != 1:
        sys.exit(f"{kind} run failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return {"kind": kind, "wall_s": wall, **json.loads(lines[0][len("RESULT "):])}


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default %(default)s)")
    ap.add_argument("--per-device", type=int, default=16, help="per_device_train_batch_size on the pair")
    ap.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps (default %(default)s)")
    ap.add_argument("--eval-steps", type=int, default=30, help="eval_steps and save_steps (default %(default)s)")
    ap.add_argument("--width", type=int, default=128, help="GPT-2's n_embd (default %(default)s)")
    ap.add_argument("--seq", type=int, default=64, help="block size (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--json", help="also write the figures here")
    add_smoke(ap)
    a = ap.parse_args()
    apply_smoke(ap, a, steps=2, per_device=2, accum=1, eval_steps=2, width=32, seq=16, rounds=1)
    with tempfile.TemporaryDirectory(prefix="hetrain-hf-bench-") as tmp:
        work = Path(tmp)
        script = work / "train.py"
        script.write_text(SCRIPT)
        runs = []
        for i, kind, got in launched(("stock", "hetrain"), a.rounds, lambda _, kind: run(kind, script, work, a),
                                     smoke=a.smoke):
            runs.append(got)
            print(f"round {i + 1} {kind:8s} wall {runs[-1]['wall_s']:6.1f} s, train_runtime "
                  f"{runs[-1]['train_runtime']:6.1f} s, eval loss {runs[-1]['eval_loss']:.3f}", flush=True)
    med = {k: {f: statistics.median(r[f] for r in runs if r["kind"] == k) for f in ("wall_s", "train_runtime")}
           for k in ("stock", "hetrain")}
    batch = a.per_device * a.accum * 2
    print(f"global batch {batch} ({a.per_device} x {a.accum} x 2 devices; stock: {a.per_device * 2} x {a.accum} in "
          f"one process), {a.steps} steps, medians of {a.rounds}:")
    for k in ("stock", "hetrain"):
        print(f"  {k:8s} wall {med[k]['wall_s']:6.1f} s   train_runtime {med[k]['train_runtime']:6.1f} s")
    ratio = {f: med["stock"][f] / med["hetrain"][f] for f in ("wall_s", "train_runtime")}
    print(f"  stock / hetrain: wall x{ratio['wall_s']:.2f}, train_runtime x{ratio['train_runtime']:.2f} "
          "(above 1: hetrain faster)")
    if a.json:
        Path(a.json).write_text(json.dumps({"cluster": CLUSTER, "global_batch": batch, "steps": a.steps,
                                            "width": a.width, "seq": a.seq, "rounds": a.rounds, "runs": runs,
                                            "medians": med, "stock_over_hetrain": ratio,
                                            "cpus": len(os.sched_getaffinity(0))}, indent=2))


if __name__ == "__main__":
    main()
