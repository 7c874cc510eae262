"""A GPU asked for that this process cannot have, under `hetrain run`: one line naming what and the
fix, exit 2, no traceback (runtime/ranks/dist.py check_cuda_device)."""

from __future__ import annotations

import pytest
import torch

from clirun import hetrain

SCRIPT = """
import os, sys, torch
import hetrain
if len(sys.argv) > 1:        # this process sees one GPU; torchrun's LOCAL_RANK says the second
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    os.environ["LOCAL_RANK"] = "1"
hetrain.init(global_batch=4)
print("trained on the CPU")
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _one_line(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "trained" not in r.stdout, r.stderr
    assert r.stderr.count("error:") == 1 and r.stderr.count("fix:") == 1, r.stderr     # said once, with its fix
    return r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_a_gpu_named_in_cuda_visible_devices_where_torch_sees_none(script):
    err = _one_line(hetrain("run", script, env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=120))
    assert "a GPU (cuda:0) is asked for, but torch sees none" in err and "CUDA_VISIBLE_DEVICES='0'" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes a one-GPU process on a machine without GPUs")
def test_a_local_rank_beyond_the_visible_gpus(tmp_path):
    """The script in a forked rank (tests/harness.py), not a launch: what `hetrain run` makes of the
    UsageError it raises there, one line with its fix and exit 2, the test above checks."""
    from harness import run_ranks
    from init_errors import raise_case

    (got,) = run_ranks(raise_case, 1, SCRIPT, str(tmp_path), ("fake-one-gpu",), env={"CUDA_VISIBLE_DEVICES": "5"})
    assert got is not None and got[0] == "UsageError", got            # raised before "trained on the CPU"
    _, what, fix = got
    assert "LOCAL_RANK=1 but this process sees 1 GPU(s) (CUDA_VISIBLE_DEVICES='5')" in what, got
    assert "hetrain run --nproc 1" in fix and "\n" not in what + fix, got
