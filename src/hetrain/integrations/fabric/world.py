"""Fabric's accelerator, devices and num_nodes against the job `hetrain run` / torchrun started,
for HetrainStrategy: checked before joining (check_world: a refused setting leaves no job
behind) and once joined (check_device: this rank's device is hetrain's)."""

from __future__ import annotations

import os

from lightning.fabric.accelerators import CPUAccelerator, CUDAAccelerator

from ...errors import UsageError
from ...runtime.config import Config
from ...runtime.ranks.dist import env_rank


def emulates(strategy) -> bool:
    """Whether this job emulates its devices (--emulate, or the strategy's Emulation(cluster=))."""
    return bool(Config(**strategy.job_config()).with_launch_file().emulation.cluster)


def check_world(strategy) -> None:
    """Fabric's accelerator, devices and num_nodes against what the launcher started, before
    joining: a refused setting leaves no job behind."""
    emulated = emulates(strategy)
    if emulated and not isinstance(strategy.accelerator, CPUAccelerator):
        raise UsageError(f"Fabric chose {type(strategy.accelerator).__name__}, but this job emulates its devices on "
                         "CPU processes (--emulate)", "pass Fabric(accelerator='cpu')")
    devices, nodes = len(strategy.parallel_devices or ()), strategy.num_nodes
    if isinstance(strategy.accelerator, CPUAccelerator) and devices == 1 and nodes == 1:
        return        # Fabric's CPU default ('auto' is one device): emulated ranks, one per process
    world = env_rank()[1]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    job_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if devices != local or nodes != job_nodes:
        raise UsageError(
            f"Fabric(devices={devices}, num_nodes={nodes}) but the job has {local} process(es) on this node and "
            f"{job_nodes} node(s) ({world} in all), as `hetrain run` / torchrun started them",
            f"pass Fabric(devices={local}, num_nodes={job_nodes}), or leave both at their defaults and launch one "
            "process per device with `hetrain run`")

def check_device(strategy, engine) -> None:
    """Fabric's accelerator and this rank's device against the one hetrain runs it on."""
    device = engine.device
    wanted = CUDAAccelerator if device.type == "cuda" else CPUAccelerator
    if not isinstance(strategy.accelerator, wanted):
        what = "an emulated device" if engine.emulated is not None else str(device)
        raise UsageError(
            f"Fabric's accelerator is {type(strategy.accelerator).__name__}, but hetrain runs rank {engine.rank} on "
            f"{what} ({device})",
            "pass Fabric(accelerator='cpu') for emulated devices" if device.type == "cpu"
            else "pass Fabric(accelerator='cuda'), or leave it at 'auto'")
    if device.type == "cuda":    # check_world saw one Fabric device per local process
        fabric_device = strategy.parallel_devices[engine.ctx.local_rank]
        if fabric_device != device:
            raise UsageError(f"Fabric's devices put local rank {engine.ctx.local_rank} on {fabric_device}, "
                             f"hetrain on {device} (one process per visible GPU, in order)",
                             "choose the GPUs with CUDA_VISIBLE_DEVICES and leave Fabric's devices at 'auto'")

