"""Offload's refusal as `hetrain run` users meet it: one line with the fix, exit 2, no traceback,
raised by every rank before training (here a plan that needs offload under offload_optimizer='never')."""

from __future__ import annotations

import textwrap

import pytest

from cli.clirun import hetrain, one_line_error

pytestmark = pytest.mark.dist

SCRIPT = textwrap.dedent("""
    import torch, hetrain
    from hetrain import Memory
    from hetrain.planning.plan import DevicePlan, Plan

    plan = Plan(global_batch=16, devices=(
        DevicePlan(rank=0, device="a100-80g#0", speed=1.0, share=8, micro_batch=8),
        DevicePlan(rank=1, device="rtx3090#1", speed=1.0, share=8, micro_batch=8, offload_optimizer=True)))
    ht = hetrain.init(global_batch=16, plan=plan, max_steps=1, memory=Memory(offload_optimizer="never"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    model, opt, steps = ht.prepare(model, torch.optim.AdamW(model.parameters()), data)
    for step in steps:
        for mb in step:
            with mb:
                x, y = mb.batch
                ht.backward(torch.nn.functional.mse_loss(model(x), y))
        ht.step()
    ht.close()
""")


def test_a_plan_needing_offload_under_never_is_one_line_exit_2(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    one_line_error(hetrain("run", "--emulate", "a100-80g,rtx3090", str(script)),
                   "rank 1 (rtx3090#1)", "offload_optimizer='never'", "offload_optimizer='auto'")
