"""`hetrain run` with a precision a device cannot run: one line naming the device and the fix,
or, with --allow-fallback, the fallback named and the job run."""

from __future__ import annotations

import textwrap

from clirun import hetrain

SCRIPT = textwrap.dedent("""
    import torch, hetrain
    ht = hetrain.init(global_batch=4, precision="bf16", max_steps=1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    model = torch.nn.Linear(3, 1)
    model, opt, batches = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    for step in batches:
        for mb in step:
            with ht.autocast():
                loss = torch.nn.functional.mse_loss(model(mb.batch[0]).float(), mb.batch[1])
            ht.backward(loss)
        ht.step()
    ht.summary()
    ht.close()
""")


def test_bf16_on_a_v100_is_one_line_then_runs_with_allow_fallback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    refused = hetrain("run", "--emulate", "a100-80g,v100", str(script))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("hetrain: error")]
    assert len(errors) == 1 and "rank 1" in errors[0] and "compute capability 7.0" in errors[0]
    assert "--allow-fallback" in refused.stderr

    ran = hetrain("run", "--allow-fallback", "--emulate", "a100-80g,v100", str(script))
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = ran.stdout + ran.stderr
    assert "bf16 -> fp16" in out and "job-wide" in out
    assert "memory per device" in out and "steps skipped" in out
