"""The per-device precision rule, the TF32/cuDNN settings and their reasons, and the config and
launch plumbing of precision and --allow-fallback."""

from __future__ import annotations

import json

import pytest
import torch

from hetrain.errors import UsageError
from hetrain.hardware.cluster import parse_cluster
from hetrain.launch import build_launch
from hetrain.planning.plan import DevicePlan, Plan
from hetrain.planning.precision import DeviceFacts, choose_precision
from hetrain.runtime.config import LAUNCH_ENV, Config
from hetrain.emulation.device import EmulatedDevice
from hetrain.runtime.devices.precision_policy import PrecisionPolicy, device_facts, math_settings

CPU = torch.device("cpu")


def emulated(name):
    return EmulatedDevice(parse_cluster(name)[0])


@pytest.mark.parametrize("gpu,expected", [("a100-80g", "bf16"), ("h100", "bf16"), ("rtx3090", "bf16"),
                                          ("rtx4090", "bf16"), ("v100", "fp16"), ("t4", "fp16")])
def test_auto_takes_the_catalog_gpus_precision_on_emulated_devices(gpu, expected):
    policy = PrecisionPolicy.local("auto", device=CPU, given=emulated(gpu))
    assert policy.error is None
    assert policy.name == expected
    cc = parse_cluster(gpu)[0].gpu.compute_capability
    assert f"{cc[0]}.{cc[1]}" in policy.choice.reason


def test_auto_on_a_plain_cpu_stays_fp32_and_says_why():
    policy = PrecisionPolicy.local("auto", device=CPU)
    assert policy.name == "fp32" and policy.dtype is None
    assert "plain CPU" in policy.choice.reason and "precision='bf16'" in policy.choice.reason


def test_auto_on_real_cuda_follows_compute_capability():
    ampere = DeviceFacts(label="cuda:0 A100", kind="cuda", capability=(8, 0))
    volta = DeviceFacts(label="cuda:1 V100", kind="cuda", capability=(7, 0))
    assert choose_precision("auto", ampere).precision == "bf16"
    assert choose_precision("auto", volta).precision == "fp16"
    assert choose_precision("auto", volta).needs_loss_scaling


def test_bf16_forced_on_a_v100_is_a_clear_error_naming_the_fixes():
    v100 = device_facts(CPU, emulated("v100"))
    with pytest.raises(UsageError) as e:
        choose_precision("bf16", v100)
    assert "v100-32g" in e.value.what and "compute capability 7.0" in e.value.what
    assert "--allow-fallback" in e.value.fix and "precision='auto'" in e.value.fix
    # kept, not raised, until the ranks agree (a lone raising rank would leave peers waiting)
    policy = PrecisionPolicy.local("bf16", device=CPU, given=emulated("v100"))
    assert policy.error is not None and policy.choice is None
    with pytest.raises(UsageError, match="rank 0: v100-32g"):
        policy.agree(rank=0, world_size=1, device=CPU)


def test_bf16_with_fallback_runs_fp16_and_names_the_fallback():
    choice = choose_precision("bf16", device_facts(CPU, emulated("t4")), allow_fallback=True)
    assert choice.precision == "fp16" and choice.needs_loss_scaling
    assert "bf16 -> fp16" in choice.fallback and "t4" in choice.fallback


def test_explicit_precisions():
    a100 = device_facts(CPU, emulated("a100-80g"))
    assert choose_precision("fp32", a100).precision == "fp32"
    assert choose_precision("fp16", a100).precision == "fp16"
    assert "slow on a CPU" in choose_precision("fp16", device_facts(CPU)).reason
    assert choose_precision("bf16", device_facts(CPU)).precision == "bf16"   # CPU autocast is real
    with pytest.raises(UsageError):
        choose_precision("fp8", a100)


def test_tf32_and_cudnn_benchmark_per_device_with_reasons():
    auto = lambda facts: choose_precision("auto", facts)  # noqa: E731
    ampere = DeviceFacts(label="a100", kind="cuda", capability=(8, 0))
    s = math_settings(ampere, auto(ampere))
    assert s.tf32 is True and s.cudnn_benchmark is True and "TF32 on" in s.reason and "8.0" in s.reason
    volta = DeviceFacts(label="v100", kind="cuda", capability=(7, 0))
    s = math_settings(volta, auto(volta))
    assert s.tf32 is False and "no TF32" in s.reason
    hopper = DeviceFacts(label="h100", kind="cuda", capability=(9, 0))
    s = math_settings(hopper, choose_precision("fp32", hopper))
    assert s.tf32 is False and "full fp32" in s.reason
    s = math_settings(device_facts(CPU, emulated("a100-80g")), auto(ampere))
    assert s.tf32 is None and "not applicable" in s.reason and "emulated" in s.reason


def test_bf16_autocast_is_real_on_cpu_and_fp32_is_untouched():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    policy = PrecisionPolicy.local("auto", device=CPU, given=emulated("a100-80g"))
    policy.agree(rank=0, world_size=1, device=CPU)
    assert policy.scaler is None                         # bf16 alone: no loss scaling
    with policy.autocast("cpu"):
        assert (a @ b).dtype == torch.bfloat16
    fp32 = PrecisionPolicy.local("auto", device=CPU)
    fp32.agree(rank=0, world_size=1, device=CPU)
    with fp32.autocast("cpu"):
        assert (a @ b).dtype == torch.float32
    assert fp32.summary()["skipped_steps"] == 0 and fp32.summary()["loss_scale"] is None


def test_record_in_plan_writes_every_ranks_precision():
    plan = Plan(global_batch=4, devices=(DevicePlan(rank=0, device="a", speed=1, share=4, micro_batch=4),))
    policy = PrecisionPolicy.local("auto", device=CPU, given=emulated("v100"))
    policy.all_choices = [{"precision": "fp16"}]
    recorded = policy.record_in(plan)
    assert recorded.devices[0].precision == "fp16" and recorded.version == plan.version


def test_config_defaults_and_validation():
    c = Config(global_batch=8)
    assert c.precision == "fp32" and c.allow_fallback is False
    assert c.memory.activation_checkpointing == "plan"
    for bad in ({"precision": "fp8"}, {"memory": {"activation_checkpointing": "sometimes"}},
                {"memory": {"blocks": "not a name"}}):
        with pytest.raises(UsageError) as e:
            Config(global_batch=8, **bad)
        assert "use" in e.value.fix or "give" in e.value.fix


def test_allow_fallback_reaches_the_workers_through_the_launch_file(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    launch = build_launch(target=str(script), emulate="v100", config={"allow_fallback": True},
                          run_dir=str(tmp_path))
    path = launch.env[LAUNCH_ENV]
    assert json.loads(open(path).read())["config"]["allow_fallback"] is True
    monkeypatch.setenv(LAUNCH_ENV, path)
    cfg = Config(global_batch=8, precision="bf16").with_launch_file()
    assert cfg.allow_fallback is True and cfg.emulation.cluster == "v100"
