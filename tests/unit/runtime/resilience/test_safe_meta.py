"""meta.pt is loaded without running code: what hetrain saves loads back; a crafted pickle is
refused and does not run; another format or another step is refused with the reason."""

from __future__ import annotations

import os
import random

import torch

from hetrain.runtime.loop.sampler import GlobalCursorSampler
from hetrain.runtime.resilience.manifest import Refused
from hetrain.runtime.resilience.rebalance import Rebalancer
from hetrain.runtime.resilience.safe_meta import load_meta
from hetrain.runtime.resilience.store import rng_state


def schedulers(opt):
    lr = torch.optim.lr_scheduler
    return {"step": lr.StepLR(opt, 3), "lambda": lr.LambdaLR(opt, lambda s: 0.9 ** s),
            "onecycle": lr.OneCycleLR(opt, max_lr=0.1, total_steps=10), "cosine": lr.CosineAnnealingLR(opt, 10),
            "plateau": lr.ReduceLROnPlateau(opt), "cyclic": lr.CyclicLR(opt, 0.01, 0.1),
            "sequential": lr.SequentialLR(opt, [lr.LinearLR(opt), lr.ExponentialLR(opt, 0.9)], milestones=[2])}


def a_meta(step=4):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return {"step": step, "sampler": GlobalCursorSampler(40, 16, seed=0, shuffle=True, drop_last=False).state_dict(),
            "plan": '{"a plan": "as JSON text"}', "rebalancer": Rebalancer(world_size=2, threshold=0.1).state_dict(),
            "scaler": scaler.state_dict(), "rng": [rng_state(), rng_state()],
            "extra": {name: s.state_dict() for name, s in schedulers(opt).items()},
            "model_signature": "abc", "global_batch": 16, "world_size": 2, "format": 2}


def test_what_hetrain_saves_loads_back_unchanged(tmp_path):
    random.seed(5)
    meta = a_meta()
    torch.save(meta, tmp_path / "meta.pt")
    got = load_meta(tmp_path / "meta.pt", step=4)
    assert isinstance(got, dict), got
    assert got["rng"][0]["python"] == meta["rng"][0]["python"]
    assert torch.equal(got["rng"][1]["torch"], meta["rng"][1]["torch"])
    assert got["extra"]["sequential"]["_milestones"] == [2] and got["sampler"] == meta["sampler"]
    assert got["extra"]["plateau"]["mode"] == "min" and got["scaler"] == meta["scaler"]


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):   # unpickling calls os.system(...): it would create the marker file
        return os.system, (f"touch {self.marker}",)


def test_a_meta_pt_that_would_run_code_is_refused_and_the_code_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({**a_meta(), "extra": {"x": Exploit(marker)}}, tmp_path / "meta.pt")
    refused = load_meta(tmp_path / "meta.pt", step=4)
    assert isinstance(refused, Refused) and "would run code" in refused.what, refused
    assert "system" in refused.what and "add_safe_globals" in refused.fix
    assert not marker.exists()


def test_another_format_step_or_record_is_refused(tmp_path):
    path = tmp_path / "meta.pt"
    for meta, words in [({**a_meta(), "format": 7}, "format 7"), (a_meta(step=6), "step 6"),
                        ([1, 2], "holds a list"), ({"step": 4}, "lacks sampler")]:
        torch.save(meta, path)
        refused = load_meta(path, step=4)
        assert isinstance(refused, Refused) and words in refused.what, (words, refused)
    path.write_bytes(b"not a pickle")
    assert isinstance(load_meta(path, step=4), Refused)
    old = a_meta()
    del old["format"]   # written before the field: format 1
    torch.save(old, path)
    assert load_meta(path, step=4)["step"] == 4
