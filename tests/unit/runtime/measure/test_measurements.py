"""From gathered measurements to the Plan (runtime/measure/measurements.py): the runtime and `hetrain plan`
both call plan_from_measurements, so what it reads off the Config and the probes is tested here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetrain.errors import UsageError
from hetrain.planning.profile import DeviceProfile
from hetrain.runtime.config import Config
from hetrain.runtime.measure.joint import SYNC_RUNS
from hetrain.runtime.measure.measurements import (Measurements, options_from_measurements, plan_from_measurements,
                                                  plan_options, planning_profiles, straggle)
from hetrain import Compression, Memory
from hetrain.emulation import Emulation

MIB = 1024**2
SPEC = "a100-80g:1.0,rtx3090:0.5@2MiB"


def test_straggle_is_the_median_run_of_how_far_the_last_rank_trails_the_mean():
    # Three ranks; rank 2 is last in every run, by a different amount each time: with the others
    # at 1 and rank 2 at v, it trails the mean (2 + v)/3 by 3v/(2 + v) − 1. v = 7/4 is 40%.
    last = (1.0, 1.25, 1.75, 2.5, 4.0)                       # the middle run, by how far it trails: 7/4
    assert straggle(((1.0,) * SYNC_RUNS, (1.0,) * SYNC_RUNS, last[:SYNC_RUNS])) == pytest.approx(0.4)
    assert straggle(((0.0,) * SYNC_RUNS,) * 3) == 0.0           # not timed (a GPU)


def _profile(label: str, speed: float, memory: int | None) -> DeviceProfile:
    """A CPU measurement at the emulated speed, as emulation/profiling.emulated() leaves it: 2 MiB of model
    state, 1 MiB of activations a sample, so the slow device's 2 MiB fit one sample only when
    activations are checkpointed."""
    sizes = (1, 2, 4, 8)
    return DeviceProfile(device=f"{label} (emulated)", source="test", overhead_s=0.001 / speed,
                         per_sample_s=0.002 / speed, fixed_bytes=MIB, activation_bytes_per_sample=MIB,
                         memory_bytes=memory, cpu_share=speed, sizes=sizes,
                         seconds=tuple((0.001 + 0.002 * m) / speed for m in sizes))


def measured(**changes) -> Measurements:
    labels = ("a100-80g#0 (emulated)", "rtx3090#1 (emulated)")
    return replace(Measurements(
        labels=labels, precisions=("fp32", "fp32"),
        profiles=(_profile("a100-80g#0", 1.0, 80 * 1024 * MIB), _profile("rtx3090#1", 0.5, 2 * MIB)),
        cached=(False, True), grad_bytes=4 * MIB, cpu_cores=2, allreduce_s=(0.004, 0.005),
        sync_s=((0.002,) * SYNC_RUNS, (0.003,) * SYNC_RUNS), compute_s=((0.01,) * SYNC_RUNS, (0.012,) * SYNC_RUNS),
        agree_s=(0.0004, 0.0003)), **changes)


def test_measurements_round_trip_through_json_exactly():
    m = measured()
    assert Measurements.from_json(m.to_json()) == m
    single = Measurements(labels=("cpu (rank 0)",), precisions=("fp32",), profiles=None)
    assert Measurements.from_json(single.to_json()) == single


def test_the_config_decides_batch_margin_cap_and_checkpointing():
    o = plan_options(Config(global_batch=24, memory=Memory(max_micro_batch=4, margin=0.2)), grad_bytes=8, link=None)
    assert (o.global_batch, o.micro_batch_cap, o.memory_margin, o.allow_checkpointing, o.allow_exclusion) == \
        (24, 4, 0.2, True, False)
    no_checkpointing = Config(global_batch=24, memory=Memory(activation_checkpointing="none"))
    assert not plan_options(no_checkpointing, grad_bytes=8, link=None).allow_checkpointing


def test_the_probes_become_the_options_the_planner_is_given_and_the_host_its_profiles_carry():
    emulated = Config(global_batch=24, emulation=Emulation(cluster=SPEC))
    o = options_from_measurements(measured(), emulated)
    assert o.sync_s == 0.002 and o.agree_s == 0.0003          # the least rank's, median run
    assert o.link.bandwidth_gbs == pytest.approx(4 * MIB / 0.005 / 1e9)
    host = planning_profiles(measured(), emulated)[0].host     # what the emulated devices share
    assert host.straggle == pytest.approx(0.012 / 0.011 - 1) and host.straggle_stretch == 1.0   # 2 ranks, 2 cores
    assert host.cores == 2 and not host.clocked
    real = planning_profiles(measured(), Config(global_batch=24))[0].host    # real devices: stragglers only
    assert real.cores is None and real.straggle == host.straggle


def test_a_device_that_needs_checkpointing_gets_it_unless_the_config_says_none():
    plan, profiles = plan_from_measurements(measured(), Config(global_batch=24, emulation=Emulation(cluster=SPEC)))
    assert [d.checkpointing for d in plan.devices] == [False, True]
    assert sum(plan.shares) == 24 and "pooled" in profiles[0].source
    for d, p in zip(plan.devices, profiles):                  # the rebalancer's time model, per rank
        assert (d.per_sample_s, d.fixed_s) == (p.per_sample_s, p.overhead_s)
    with pytest.raises(UsageError):
        plan_from_measurements(measured(), Config(global_batch=24, emulation=Emulation(cluster=SPEC),
                                                  memory=Memory(activation_checkpointing="none")))


def test_one_device_with_unlimited_memory_takes_the_whole_batch():
    m = Measurements(labels=("cpu (rank 0)",), precisions=("bf16",), profiles=None)
    plan, profiles = plan_from_measurements(m, Config(global_batch=24, memory=Memory(max_micro_batch=5)))
    assert profiles == () and plan.shares == (24,) and plan.devices[0].micro_batch == 5
    assert plan.devices[0].precision == "bf16" and plan.devices[0].device == "cpu (rank 0)"


def test_contention_is_the_probe_against_the_profiles_less_core_sharing():
    from hetrain.emulation.measuring import contention

    def prof(name, speed):   # 2 ms per micro-batch + 1 ms per sample of CPU, at this emulated speed
        return DeviceProfile(device=name, source="test", overhead_s=0.002 / speed, per_sample_s=0.001 / speed,
                             fixed_bytes=0, activation_bytes_per_sample=0.0, cpu_share=speed)

    profiles = (prof("a", 1.0), prof("b", 0.5))
    # the probe's 8-sample micro-batch is 10 ms of CPU alone; both ranks took ~11.5 ms at once
    m = Measurements(labels=("a", "b"), precisions=("fp32", "fp32"), profiles=profiles, cpu_cores=2,
                     compute_s=((0.0115, 0.0114, 0.0116), (0.0115, 0.0117, 0.0113)), probe_size=8)
    config = Config(global_batch=16, emulation=Emulation(cluster="a100-80g:1.0,rtx3090:0.5"))
    assert contention(m, profiles, config) == pytest.approx(1.15)
    # three devices on two cores: the 1.5x of sharing is the cost model's own, not contention
    m3 = Measurements(labels=("a", "b", "c"), precisions=("fp32",) * 3, profiles=profiles + (prof("c", 0.5),),
                      cpu_cores=2, compute_s=((0.018,),) * 3, probe_size=8)
    config3 = Config(global_batch=16, emulation=Emulation(cluster="a100-80g:1.0,rtx3090:0.5,rtx3090:0.5"))
    assert contention(m3, m3.profiles, config3) == pytest.approx(1.2)
    assert contention(m, profiles, Config(global_batch=16,
                                          emulation=Emulation(cluster=config.emulation.cluster, sample_s=0.01))) == 1.0


def test_a_probe_too_short_to_time_reads_as_no_contention():
    from hetrain.emulation.measuring import contention

    tiny = DeviceProfile(device="a", source="test", overhead_s=1e-4, per_sample_s=1e-5, fixed_bytes=0,
                         activation_bytes_per_sample=0.0, cpu_share=1.0)
    m = Measurements(labels=("a", "b"), precisions=("fp32", "fp32"), profiles=(tiny, tiny), cpu_cores=2,
                     compute_s=((0.001,), (0.001,)), probe_size=4)       # 10x the profile: DDP's fixed costs
    assert contention(m, m.profiles, Config(global_batch=8, emulation=Emulation(cluster="a100-80g,a100-80g"))) == 1.0


def test_two_nodes_the_plan_states_the_inter_node_link_and_plans_compression_for_it():
    # the leaders' all-reduce of the 4 MiB gradient took 40 ms: 4 MiB / 40 ms = 0.105 GB/s, slower
    # than the world ring's 4 MiB / 5 ms; the world link is then the inter-node one (its slowest)
    two = measured(nodes=2, inter_node_s=0.040, backend="gloo", grad_shapes=((1024, 1024),),
                   sync_s=((0.040,) * SYNC_RUNS, (0.041,) * SYNC_RUNS))
    assert Measurements.from_json(two.to_json()) == two
    config = Config(global_batch=24, emulation=Emulation(cluster=SPEC, link_gbs=0.1))
    o = options_from_measurements(two, config)
    assert o.link.bandwidth_gbs == pytest.approx(4 * MIB / 0.040 / 1e9) and "nodes' leaders" in o.link.source
    plan, _ = plan_from_measurements(two, config)
    notes = plan.note.split("; ")
    assert "inter-node link 0.105 GB/s (emulated: 0.1 GB/s), measured: one 4.0 MiB all-reduce between the 2 " \
           "nodes' leaders took 40.0 ms: the ring's slowest link" in notes
    assert plan.compression == "fp16" and any(n.startswith("gradient compression fp16: inter-node link") for n in notes)
    assert plan.predicted["step_s"] < plan.predicted["uncompressed_step_s"]
    # the same under tensor parallelism: no compression, said; and nothing asked, nothing compressed
    assert plan_from_measurements(two, config, blocked_by="parallel=TensorParallel(split='even')")[0].compression == "none"
    assert plan_from_measurements(two, replace(config, compression=Compression(method="none")))[0].compression == "none"


def test_one_node_is_planned_as_before_whatever_compression_would_gain():
    slow = measured(sync_s=((0.040,) * SYNC_RUNS, (0.041,) * SYNC_RUNS), backend="gloo")
    plan, _ = plan_from_measurements(slow, Config(global_batch=24, emulation=Emulation(cluster=SPEC)))
    assert plan.compression == "none" and "compression" not in plan.note and "inter-node" not in plan.note
    assert "uncompressed_step_s" not in plan.predicted


def test_a_model_with_a_frozen_part_is_planned_as_fine_tuning_and_says_so():
    # counts as joint.py gathers them off rank 0's model: 16,384 of 738,432 train (a LoRA at r=8)
    lora = measured(n_params=738_432, n_trainable=16_384)
    assert Measurements.from_json(lora.to_json()) == lora
    plan, _ = plan_from_measurements(lora, Config(global_batch=24, emulation=Emulation(cluster=SPEC)))
    assert ("fine-tuning (LoRA or a frozen base): 16,384 of 738,432 parameters trainable (2.2%), the frozen "
            "722,048 costed as weights only (no gradients, no optimizer state) and left out of the gradient "
            "sync") in plan.note.split("; ")
    for counts in ({"n_params": 738_432, "n_trainable": 738_432}, {}):      # all train, or not counted
        config = Config(global_batch=24, emulation=Emulation(cluster=SPEC))
        assert "fine-tuning" not in plan_from_measurements(measured(**counts), config)[0].note


def test_ddp_cost_is_each_ranks_cpu_through_ddp_over_the_bare_runs_and_contention_reads_the_bare_ones():
    from hetrain.emulation.measuring import contention, ddp_cost, shared_host

    def prof(name, speed):   # 2 ms per micro-batch + 1 ms per sample of CPU, at this emulated speed
        return DeviceProfile(device=name, source="test", overhead_s=0.002 / speed, per_sample_s=0.001 / speed,
                             fixed_bytes=0, activation_bytes_per_sample=0.0, cpu_share=speed)

    profiles = (prof("a", 1.0), prof("b", 0.5))
    # the probe's 8 samples are 10 ms of CPU alone; through the bare module both ranks took 11-12 ms
    # at once (contention 1.15); through DDP the backward's thread took 4% (rank 0) and 6% (rank 1)
    # more CPU than the bare runs beside them, run by run (one run untimed: 0)
    bare = ((0.0115, 0.0110, 0.0120), (0.0115, 0.0114, 0.0116))
    m = Measurements(labels=("a", "b"), precisions=("fp32", "fp32"), profiles=profiles, cpu_cores=2,
                     compute_s=((0.02,) * 3, (0.02,) * 3), plain_compute_s=bare,
                     ddp_over_bare=((1.03, 1.04, 1.05), (1.06, 0.0, 1.06)), probe_size=8,
                     sync_s=((0.001,) * 3,) * 2, agree_s=(0.0003, 0.0003), allreduce_s=(0.002, 0.002))
    config = Config(global_batch=16, emulation=Emulation(cluster="a100-80g:1.0,rtx3090:0.5"))
    assert ddp_cost(m, profiles, config) == pytest.approx(1.05)        # the median of 1.04 and 1.06
    assert contention(m, profiles, config) == pytest.approx(1.15)      # the bare runs: DDP's cost not in it
    host = shared_host(m, config, profiles, straggle(m.compute_s))
    assert host.ddp_cost == pytest.approx(1.05) and host.contention == pytest.approx(1.15)
    assert Measurements.from_json(m.to_json()) == m
    # not measured (older measurements, a GPU), on the controlled clock, or DDP timed cheaper: 1.0
    assert ddp_cost(replace(m, ddp_over_bare=()), profiles, config) == 1.0
    clocked = Config(global_batch=16, emulation=Emulation(cluster=config.emulation.cluster, sample_s=0.01))
    assert ddp_cost(m, profiles, clocked) == 1.0
    assert ddp_cost(replace(m, ddp_over_bare=((0.97,) * 3, (0.99,) * 3)), profiles, config) == 1.0
