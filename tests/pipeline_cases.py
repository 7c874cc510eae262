"""Shared builders for the pipeline-split and DP×PP planner tests: uniform block profiles,
devices by speed, and every way to cut n blocks into k stages (the brute-force reference)."""

from __future__ import annotations

import itertools

from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile, StageDevice


def profile(n=12, seconds=1e-3, act=1e6, params=4e6, first=None, last=None, tied=0.0):
    return PipelineProfile(blocks=tuple(BlockCost(seconds=seconds, activation_bytes=act, param_bytes=params)
                                        for _ in range(n)), first=first, last=last, tied_param_bytes=tied)


def devices(*speeds, memory=None):
    return [StageDevice(name=f"d{i}", speed=s, memory_bytes=memory) for i, s in enumerate(speeds)]


def compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        yield tuple(edges[i + 1] - edges[i] for i in range(k))
