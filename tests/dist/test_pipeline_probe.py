"""How much longer a stage runs its blocks than they take alone (runtime/layouts/pipeline/probe.py), and the cached
pipeline measurement (runtime/layouts/pipeline/block_cache.py), on 2 gloo ranks with emulated devices: the
probe leaves the job's model as it was and gives every rank the same figure (the median of the
ranks'); the job that follows `hetrain plan` sizes from the same measurement, read from the cache;
a corrupt cache file is measured again."""

from __future__ import annotations

import pytest

from harness import run_ranks
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist


def worker(rank, world, cache: str):
    import os
    import statistics
    from pathlib import Path

    import torch
    from torch import nn

    os.environ["HETRAIN_CACHE"] = cache
    import hetrain
    from hetrain.runtime.layouts.pipeline.setup import measure_blocks
    from hetrain.runtime.layouts.pipeline.probe import time_stage_cost
    from hetrain.runtime.layouts.pipeline.blocks import find_parts
    from hetrain.runtime.setup import prepare_to_measure

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 32))
    ht = hetrain.init(global_batch=16, emulation=Emulation(cluster="a100-80g,rtx3090:0.5"),
                      reporting=Reporting(verbose=False), precision="fp32")
    prepare_to_measure(ht.job, model, opt, data, None)
    before = [p.detach().clone() for p in model.parameters()]
    parts = find_parts(model)

    first, devices = measure_blocks(ht.job, parts)
    again, _ = measure_blocks(ht.job, parts)
    probe = time_stage_cost(parts, first, data[0:4][0], device=ht.job.device, precision=ht.job.precision,
                                stage_hooks=ht.job.hooks.stage_hooks())
    for f in (Path(cache) / "pipelines").glob("*.json"):
        f.write_text("{ not json")
    after_corrupt, _ = measure_blocks(ht.job, parts)
    out = {"factor": first.stage_factor, "block_s": first.block_s, "source": first.source,
           "sharing": tuple(first.host[k] for k in ("contention", "contention_at", "message_s", "busy_message_s",
                                                     "piece_overhead_s")),
           "again_source": again.source,
           "again_same": (again.blocks, again.stage_factor, again.block_s) == (first.blocks, first.stage_factor,
                                                                                first.block_s),
           "corrupt_source": after_corrupt.source, "probe": probe,
           "probe_median": (statistics.median(f for f, _ in probe["ranks"]),
                            statistics.median(b for _, b in probe["ranks"])),
           "model_unchanged": all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
           "no_grads": all(p.grad is None for p in model.parameters())}
    ht.close()
    return out


def test_the_probe_measures_a_stage_s_factor_alike_on_every_rank_and_the_cache_serves_the_next_job(tmp_path):
    r0, r1 = run_ranks(worker, 2, str(tmp_path), timeout=240)
    for r in (r0, r1):
        # every rank: the same figures, the medians of the ranks' own; the machinery around a block's
        # ops costs time whatever the micro-batch (block_s > 0)
        assert (r["probe"]["factor"], r["probe"]["block_s"]) == r["probe_median"], r["probe"]
        assert r["probe"]["factor"] > 0 and r["probe"]["block_s"] > 0 and len(r["probe"]["ranks"]) == 2
        assert r["block_s"] > 0 and "a stage runs them x" in r["source"] and "on each rank in turn" in r["source"], \
            r["source"]
        # the second measurement is the first, read back
        assert r["again_source"].endswith("(cached)") and r["again_same"], r["again_source"]
        # an unreadable cache file is measured again, no error
        assert not r["corrupt_source"].endswith("(cached)"), r["corrupt_source"]
        # the probe ran on a copy: the job's model and its gradients are as they were
        assert r["model_unchanged"] and r["no_grads"]
    assert r0["probe"] == r1["probe"] and (r0["factor"], r0["block_s"]) == (r1["factor"], r1["block_s"])
    # how emulated stages share this host, measured alike for every rank: a contention in [1, 2] with
    # both computing at once (or one, on a 1-core host), a message's time (with two ranks no third
    # can keep the cores busy: the quiet figure stands for both), the schedule's own CPU a piece
    contention, at, message, busy, overhead = r0["sharing"]
    assert r1["sharing"] == r0["sharing"] and 1.0 <= contention <= 2.0 and at in (1, 2)
    assert 0 < message < 0.5 and busy == message and 0 <= overhead < 0.05, r0["sharing"]
    assert "emulated stages on this host's cores" in r0["source"] and "first part" not in r0["source"]
