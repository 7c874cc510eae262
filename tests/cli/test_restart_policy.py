"""--max-restarts is for failures a restart can get past: bad input stops the job at once."""

from __future__ import annotations

from pathlib import Path

from clirun import hetrain

SCRIPT = """
import os, sys
with open(sys.argv[1], "a") as f:
    f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "?") + "\\n")
import torch
import hetrain
ht = hetrain.init(global_batch=8, checkpoints=hetrain.Checkpoints(dir="/proc/hetrain-cannot-write"))
model = torch.nn.Linear(4, 1)
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)   # bad input: the same on every attempt
"""


def test_a_usage_error_does_not_use_up_the_restarts(tmp_path: Path):
    script, attempts = tmp_path / "bad.py", tmp_path / "attempts.txt"
    script.write_text(SCRIPT)
    result = hetrain("run", "--emulate", "a100-80g,rtx3090", "--max-restarts", "3", str(script), str(attempts),
                     cwd=str(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("hetrain: error")]
    assert len(errors) == 1 and "is not writable" in errors[0], result.stderr[-2000:]
    assert attempts.read_text().split() == ["0", "0"]       # both ranks, first attempt only
