"""A pipeline across device islands (runtime/ranks/islands.py pipeline_groups) on a 2×2 DP×PP mesh
of real gloo ranks: stage 0 of both replicas on island nv, stage 1 on island amd, so each
pipeline crosses the bridge and each stage's replicas sum their gradients inside one island; the
training equals one process (float64; tests/pipeline_runs.py's reference). Every activation and
gradient the stages exchange goes through the bridge's host staging (islands.staged_p2p, which
stages device tensors; here told to stage the CPU's too, so its copies and landings are what the
stages compute on)."""

from __future__ import annotations

import pytest

from harness import run_ranks

pytestmark = pytest.mark.dist

ISLANDS = ("nv", "amd", "nv", "amd")       # rank = replica × 2 + stage
EXACT = 1e-9                               # as tests/dist/test_hybrid.py (float64 through the pipeline)


def worker(rank, world):
    from dataclasses import replace

    import torch.distributed as dist

    from hetrain.runtime.ranks import island_facts, islands, nodes
    from pipeline_runs import join_group, pipeline_plan, train

    plain_join = nodes.join_nodes

    def on_islands(*args, **kw):   # the islands found at start, as a spec alternating nv and amd gives them
        ctx, config, found, cluster = plain_join(*args, **kw)
        records = [{"vendor": "nvidia", "device_type": "cuda", "backend": "nccl", "island": name} for name in ISLANDS]
        held = [island_facts.rank_device(ctx.device)["backend"]] * len(ISLANDS)     # CPU tensors: gloo
        return ctx, config, replace(found, islands=island_facts.job_islands(records, bridge="host", held=held)), cluster

    nodes.join_nodes = on_islands
    made = {}
    plain = islands.pipeline_groups

    def recorded(*args, **kw):
        pp, dp = plain(*args, **kw)
        made.update(pp=dist.get_process_group_ranks(pp), dp=dist.get_process_group_ranks(dp))
        return pp, dp

    islands.pipeline_groups = recorded
    staged = []
    islands._needs_staging = lambda tensor, group: staged.append(tensor.shape) or True
    join_group()
    out = train("stack2", n=24, global_batch=12, steps=2, emulate="4xa100-80g",
                parallel=pipeline_plan("dp-pp", blocks=(1, 1), schedule="1f1b", shares=(5, 7), micro=(3, 4),
                                       world=world))
    made["staged"] = len(staged)
    return out, made


def test_dp_x_pp_across_islands_matches_one_big_batch():
    results = run_ranks(worker, 4, timeout=240)
    for out, _ in results:
        assert out["steps"] == 2, out.get("error")
        assert out["grad_error"] < EXACT and out["loss_error"] < EXACT and out["param_error"] < EXACT, out
    assert [(o["replica"], o["stage"]) for o, _ in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    made = [m for _, m in results]
    assert [m["pp"] for m in made] == [[0, 1], [0, 1], [2, 3], [2, 3]]     # each pipeline: nv then amd
    assert [m["dp"] for m in made] == [[0, 2], [1, 3], [0, 2], [1, 3]]     # each stage's replicas: one island
    # per step and micro-batch, each stage sends once and receives once (activations forward,
    # gradients back): 2 steps, replica 0 in 2 micro-batches, replica 1 in 2
    assert [m["staged"] for m in made] == [8, 8, 8, 8]
