"""Emulated devices across nodes (emulation/islands.py): each node's --emulate item, the job's spec
joined from every rank's item the same on every rank, and the nodes refused together."""

from __future__ import annotations

import pytest

from hetrain.emulation.islands import job_spec, node_device, paced_link
from hetrain.errors import UsageError
from hetrain.runtime.ranks.nodes import JobNodes


def test_a_node_s_spec_gives_each_local_rank_its_item_or_says_how_many_processes():
    assert node_device(None, local_rank=0, local_world=2) is None
    assert node_device("2xrtx3090@1GiB", local_rank=1, local_world=2) == "rtx3090@1GiB"
    with pytest.raises(UsageError) as e:
        node_device("a100-80g,rtx3090,t4", local_rank=0, local_world=2)
    assert "names 3 device(s), but this node runs 2 process(es)" in e.value.what and "hetrain run --emulate" in e.value.fix


def test_the_job_spec_joins_the_nodes_items_and_refuses_a_mixed_job():
    two = JobNodes(names=("a", "b"), node_of=(0, 1))
    assert job_spec([{"device": None}, {"device": None}], two, None) is None        # real GPUs everywhere
    assert job_spec([{"device": "a100-80g"}, {"device": "rtx3090"}], two, "a100-80g") == "a100-80g,rtx3090"
    with pytest.raises(UsageError, match="some nodes emulate their devices and some do not"):
        job_spec([{"device": "a100-80g"}, {"device": None}], two, "a100-80g")
    islands = "nv=a100-80g; amd=mi300x; bridge=host:25GbE"
    with pytest.raises(UsageError, match="names device islands, which are on one machine"):
        job_spec([{"device": "a100-80g"}, {"device": "mi300x"}], two, islands)
    one = JobNodes(names=("a",), node_of=(0, 0))
    assert job_spec([{"device": "a100-80g"}, {"device": "mi300x"}], one, islands) == islands


def test_an_island_link_is_paced_to_its_figures():
    link = paced_link(2.0, 4)
    assert link.ring == 4 and link.link.bandwidth_gbs == 2.0
