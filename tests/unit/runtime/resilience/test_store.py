"""Checkpointer in one process (a gloo group of 1): retention keeps the checkpoints known whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hetrain.runtime.resilience.store import Checkpointer

class Log:
    def __init__(self):
        self.warnings = []

    def warn_job(self, message):
        self.warnings.append(message)


@pytest.fixture(scope="module", autouse=True)
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def save(ck, step):
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = {"step": step, "sampler": {}, "plan": "{}", "rng": [], "model_signature": "m", "global_batch": 8}
    ck.save(step, model=model, optimizer=opt, meta=meta)
    return model.weight.detach().clone()


def test_retention_keeps_the_resumed_and_the_new_checkpoint_past_unusable_newer_ones(tmp_path):
    earlier = Checkpointer(str(tmp_path), keep=8, rank=0, log=Log())
    for step in (2, 4, 6, 8):
        save(earlier, step)
    earlier.close()
    (tmp_path / "step-00000006" / "meta.pt").unlink()             # two newer ones, both unusable
    (tmp_path / "step-00000008" / "manifest.json").write_text("[]")

    log = Log()
    resumed = Checkpointer(str(tmp_path), keep=2, rank=0, log=log)
    assert resumed.latest().name == "step-00000004"
    assert [w.split(" is unusable")[0] for w in log.warnings] == ["checkpoint step-00000008", "checkpoint step-00000006"]
    saved = save(resumed, 5)
    # the old rule (the last 2 directories of any kind) removed 4 and 5 here; 2 is older than both kept
    assert resumed.steps() == [4, 5, 6, 8]
    resumed.close()

    model = torch.nn.Linear(4, 3)
    restarted = Checkpointer(str(tmp_path), keep=2, rank=0, log=Log())
    path = restarted.latest()
    assert path.name == "step-00000005" and restarted.read_meta(path)["step"] == 5
    restarted.load_model(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.equal(model.weight, saved)
    restarted.close()


def test_a_checkpoint_this_job_cannot_load_is_one_line_saying_what_to_do(tmp_path):
    """Saved with SGD (no state entries), resumed into Adam (exp_avg, exp_avg_sq per parameter):
    DCP finds no such entries; the error names the checkpoint and the fix, without a traceback."""
    from hetrain.errors import UsageError

    ck = Checkpointer(str(tmp_path), keep=2, rank=0, log=Log())
    save(ck, 1)
    path = ck.latest()
    model = torch.nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(UsageError) as e:
        ck.load_model(path, model=model, optimizer=adam)
    ck.close()
    assert "cannot be loaded into this job's layout" in e.value.what and "step-00000001" in e.value.what
    assert "optimizer it was saved from" in e.value.fix
