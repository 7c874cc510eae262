"""The gradient hook's pieces that need no process group: PowerSGD's state kept and put back
around an agreed redo, and the emulated link's arithmetic (runtime/sharding/comm_hooks.py,
emulation/link.py). The hooks themselves run in tests/dist/test_compression.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from hetrain.planning.collectives import Link, allreduce_seconds
from hetrain.planning.compression import POWERSGD_START_ITER
from hetrain.emulation.link import LinkThrottle, throttle_for
from hetrain.runtime.ranks.nodes import JobNodes
from hetrain.runtime.sharding.comm_hooks import GradientHook
from hetrain.runtime.config import Config, Emulation


def test_an_agreed_redo_puts_powersgds_state_back_as_the_failed_attempt_found_it():
    hook = GradientHook("powersgd", powersgd_rank=2)
    s = hook.state
    assert (s.matrix_approximation_rank, s.start_powerSGD_iter, s.use_error_feedback, s.warm_start) == \
        (2, POWERSGD_START_ITER, True, True)
    s.iter, s.error_dict, s.q_memory_dict = 7, {0: torch.arange(4.0)}, {0: torch.ones(3)}
    hook.begin()                                   # the step's last backward starts
    draw = s.rng.randint(1_000_000_000)
    s.error_dict[0].add_(5.0)                      # what the failed attempt's hooks did, in place...
    s.error_dict[1] = torch.zeros(2)               # ...and anew
    s.q_memory_dict[0] = torch.zeros(3)
    s.iter += 1
    hook.redo()
    assert s.iter == 7 and list(s.error_dict) == [0] and torch.equal(s.error_dict[0], torch.arange(4.0))
    assert torch.equal(s.q_memory_dict[0], torch.ones(3)) and s.rng.randint(1_000_000_000) == draw
    hook.redo()                                    # a second OOM in the same step: the same state again
    assert torch.equal(s.error_dict[0], torch.arange(4.0))


def test_hooks_that_add_nothing_are_not_registered():
    assert not GradientHook("none").needed
    assert GradientHook("fp16").needed and GradientHook("none", link=object()).needed
    with pytest.raises(ValueError):
        GradientHook("zip")


def test_the_emulated_link_charges_the_ring_all_reduce_and_carries_one_transfer_at_a_time():
    link = LinkThrottle(gbs=2.0, ring=4)
    assert link.seconds(8e6) == allreduce_seconds(4, 8e6, Link(bandwidth_gbs=2.0, latency_s=0.0))
    long_ago = time.perf_counter() - 100.0         # both transfers were due long ago: no sleep at all
    first = link.finish(long_ago, 8e6)
    second = link.finish(long_ago, 8e6)            # launched together: the second waits for the first
    assert first == pytest.approx(long_ago + link.seconds(8e6))
    assert second == pytest.approx(long_ago + 2 * link.seconds(8e6))
    assert link.slept_s == 0.0 and link.sent_bytes == 16e6


def job(*, gbs=1.0, emulated=True, node_of=(0, 1)):
    return SimpleNamespace(config=Config(global_batch=8, emulation=Emulation(link_gbs=gbs)),
                           hooks=SimpleNamespace(emulated=object() if emulated else None),
                           nodes=JobNodes(names=tuple(f"n{i}" for i in sorted(set(node_of))), node_of=node_of),
                           world_size=len(node_of))


def test_the_link_is_emulated_only_between_nodes_of_emulated_devices():
    assert throttle_for(job()).ring == 2 and throttle_for(job(), ring=3).ring == 3
    assert throttle_for(job(gbs=None)) is None
    assert throttle_for(job(emulated=False)) is None           # real GPUs: the link is real
    assert throttle_for(job(node_of=(0, 0))) is None           # one node


def test_the_link_request_is_refused_on_real_devices_and_said_to_do_nothing_on_one_node():
    """init() checks Emulation(link_gbs=...) once its nodes are known: real devices' link is real
    (one line naming both fixes), one node has no link between nodes (a warning), and devices on two
    nodes take it silently."""
    from hetrain.emulation.link import check_link_request
    from hetrain.errors import UsageError

    warned = []
    log = SimpleNamespace(warn_job=warned.append)
    with pytest.raises(UsageError, match="runs on real devices") as refused:
        check_link_request(SimpleNamespace(**vars(job(emulated=False)), log=log))
    assert "--emulate SPEC" in str(refused.value.fix) and "\n" not in str(refused.value)
    check_link_request(SimpleNamespace(**vars(job(node_of=(0, 0))), log=log))
    assert len(warned) == 1 and "does nothing here" in warned[0]
    check_link_request(SimpleNamespace(**vars(job()), log=log))
    check_link_request(SimpleNamespace(**vars(job(gbs=None, emulated=False)), log=log))
    assert len(warned) == 1
