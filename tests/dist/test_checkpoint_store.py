"""The Checkpointer on 2 real gloo ranks: each rank hashes the files it wrote and checks its share
on load; a damaged file of either rank makes both pick the previous checkpoint; a refusal (another
format, a directory in use) reaches every rank together."""

from __future__ import annotations

import json

import pytest

from harness import run_ranks

pytestmark = pytest.mark.dist


class Log:
    def __init__(self):
        self.warnings = []

    def warn_job(self, message):
        self.warnings.append(message)


def worker(rank, world, directory, held_dir):
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from hetrain.errors import UsageError
    from hetrain.runtime.ranks.dist import init_distributed
    from hetrain.runtime.resilience.lock import CHECKPOINT_LOCK
    from hetrain.runtime.resilience.store import Checkpointer, hash_share
    from lock_holder import hold

    init_distributed(timeout_s=60, use_cuda=False)
    out = {}
    log = Log()
    ck = Checkpointer(directory, keep=3, rank=rank, log=log)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    meta = {"step": 0, "sampler": {}, "plan": "{}", "rng": [], "model_signature": "m", "global_batch": 8}
    for step in (2, 4):
        ck.save(step, model=model, optimizer=opt, meta={**meta, "step": step})
    final = ck.path(4)
    out["manifest"] = json.loads((final / "manifest.json").read_text())
    out["share"] = sorted(hash_share(final, rank, world))
    # damage a file rank 1 wrote: both ranks' answer is gathered, so both take step 2
    if rank == 1:
        victim = final / next(n for n in out["share"] if n.startswith("__1_"))
        victim.write_bytes(b"\0" + victim.read_bytes()[1:])
    dist.barrier()
    out["latest"] = ck.latest().name
    out["meta_step"] = ck.read_meta(ck.path(2))["step"]
    if rank == 0:
        m = json.loads((final / "manifest.json").read_text())
        (final / "manifest.json").write_text(json.dumps({**m, "format": 99}))
    dist.barrier()
    try:
        ck.latest()
    except UsageError as e:
        out["refused"] = e.what
    ck.close()
    # another process holds a second directory: rank 0 finds it, every rank raises
    holder = None
    if rank == 0:
        Path(held_dir).mkdir()
        holder = hold(held_dir, CHECKPOINT_LOCK)
    dist.barrier()
    try:
        Checkpointer(held_dir, keep=3, rank=rank, log=log)
    except UsageError as e:
        out["in_use"] = e.what
    if holder is not None:
        holder.kill()
        holder.wait()
    out["warnings"] = log.warnings
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_hashing_and_checking_are_split_and_the_choice_is_the_same_everywhere(tmp_path):
    r0, r1 = run_ranks(worker, 2, str(tmp_path / "ck"), str(tmp_path / "held"), timeout=120)
    files = r0["manifest"]["files"]
    assert r0["manifest"]["format"] == 2 and r0["manifest"]["step"] == 4
    # each rank hashed its own DCP files, rank 0 also the DCP index and meta.pt; together all of them
    assert {".metadata", "meta.pt"} <= set(r0["share"]) and all(n.startswith("__1_") for n in r1["share"])
    assert r1["share"] and not set(r0["share"]) & set(r1["share"])
    assert sorted(r0["share"] + r1["share"]) == sorted(files)
    assert r0["latest"] == r1["latest"] == "step-00000002"
    assert "does not match its checksum" in r0["warnings"][0] and "step-00000004" in r0["warnings"][0]
    assert r0["meta_step"] == r1["meta_step"] == 2
    assert "format 99" in r0["refused"] and r0["refused"] == r1["refused"]
    assert "in use by another hetrain job: pid" in r0["in_use"] and r0["in_use"] == r1["in_use"]
