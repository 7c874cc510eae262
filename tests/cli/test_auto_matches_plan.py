"""prepare(parallel='auto') runs the layout `hetrain plan --model-factory` recommends: both measure
with runtime/layouts/ranking.measure_for_ranking and rank with measurements.rank_job_measurements.
Two cases with a clear winner, so timing noise cannot flip them: a small device that plain data
parallelism (and every sharding) does not fit, where only the pipeline does; and roomy devices,
where plain DP is the fastest of the layouts auto may run and the simplest."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from clirun import hetrain

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(*(Residual(6) for _ in range(4))).double()
        g = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g).double(),
                                              torch.randn(96, 6, generator=g).double())
        return model, torch.optim.SGD(model.parameters(), lr=0.1), data
""")

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.nn.functional as F
    import hetrain
    sys.path.insert(0, os.path.dirname(__file__))
    from factory import make

    global_batch, out = int(sys.argv[1]), sys.argv[2]
    ht = hetrain.init(global_batch=global_batch, max_steps=1)
    said, original = [], ht.job.log.info
    ht.job.log.info = lambda m: (said.append(m), original(m))
    model, opt, data = make()
    model, opt, batches = ht.prepare(model, opt, data, parallel="auto", loss_fn=F.mse_loss)
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
    if ht.is_main:
        with open(out, "w") as f:
            json.dump({"layout": ht.plan.layout, "said": [m for m in said if "parallel=auto chose" in m]}, f)
    ht.close()
""")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path / "cache"))


def capped_spec() -> str:
    """The whole SGD state of the factory's model fits 1.6× on the big device, 0.48× on the small one."""
    from hetrain.planning.memory import state_factor

    params = 4 * (6 * 6 + 6) * 8                       # 4 Linear(6, 6), float64
    big = int(state_factor("sgd") * params * 1.6)
    return f"a100-80g@{big}B,rtx3090@{int(big * 24 / 80)}B"


@pytest.mark.parametrize("case", ["capped", "roomy"])
def test_auto_runs_the_layout_hetrain_plan_recommends(tmp_path, case):
    (tmp_path / "factory.py").write_text(FACTORY)
    (tmp_path / "script.py").write_text(SCRIPT)
    spec, batch, expected = {"capped": (capped_spec(), "12", ("PP 2 stages", "pp")),
                             "roomy": ("a100-80g,rtx3090", "48", ("DP", "dp"))}[case]
    plan = hetrain("plan", "--model-factory", f"{tmp_path / 'factory.py'}:make", "--emulate", spec,
                   "--global-batch", batch)
    said = plan.stdout + plan.stderr
    # plain DP fits: the plan, the ranking, "best layout: NAME: ..."; it does not: exit 2 naming the best
    found = re.search(r"best layout(?: that does)?: ([^:,]+)[:,]", said)
    assert found, said[-3000:]
    recommended = found.group(1).strip()
    run = hetrain("run", "--verbose", "--emulate", spec, str(tmp_path / "script.py"), batch,   # auto's choice said
                  str(tmp_path / "out.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    chose = re.search(r"parallel=auto chose (\w+\(.*?\)): ([^:]+):", got["said"][0])
    assert chose, got
    assert chose.group(2) == recommended == expected[0], (got["said"], said[-2000:])
    assert got["layout"] == expected[1]
    from hetrain import DataParallel, Pipeline
    assert chose.group(1) == repr({"pp": Pipeline(), "dp": DataParallel(sharding="none")}[expected[1]])
