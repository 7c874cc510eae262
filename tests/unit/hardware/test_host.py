"""The host's CPU as a compute device (hardware/host.py) and the emulated precision rule that
reads it (planning/precision.py): recorded hosts of both kinds, the cache, and one real measurement."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hetrain.errors import UsageError
from hetrain.hardware import host as hostmod
from hetrain.hardware.cluster import parse_cluster
from hetrain.hardware.host import HOST_FACTS_ENV, HostFacts, host_facts, recorded
from hetrain.planning.precision import DeviceFacts, choose_precision
from hetrain.emulation.device import EmulatedDevice
from hetrain.runtime.devices.precision_policy import PrecisionPolicy, device_facts

HOSTS = Path(__file__).parents[2] / "fixtures" / "hosts"
CPU = torch.device("cpu")
AVX2, BF16, NOBF16 = (recorded(str(HOSTS / f)) for f in
                      ("epyc-zen3-avx2.json", "xeon-avx512-bf16.json", "xeon-avx512-no-bf16.json"))


def emulated(name):
    return EmulatedDevice(parse_cluster(name)[0])


def test_recorded_hosts_say_what_they_have_in_hardware_and_how_slow_the_rest_is():
    assert not AVX2.native("bf16") and not AVX2.native("fp16") and AVX2.native("fp32")
    assert AVX2.slowdown("bf16") == pytest.approx(372 / 9.5) and not AVX2.keeps_speed("bf16")
    assert BF16.native("bf16") and BF16.keeps_speed("bf16") and BF16.slowdown("bf16") < 1
    assert BF16.native("fp16") and not BF16.keeps_speed("fp16")      # AVX512-FP16, yet torch's fp16 is slow
    assert not NOBF16.native("bf16") and not NOBF16.keeps_speed("bf16")
    text = AVX2.describe()
    assert "AMD EPYC" in text and "no avx512_bf16/amx_bf16" in text and "39x slower than fp32" in text
    assert "compute in fp32" in AVX2.precision_meaning()
    assert "about as fast" not in BF16.describe() and "faster than fp32" in BF16.describe()
    assert "compute in their card's precision" in replace(BF16, block_ms={"fp32": 1, "bf16": 1, "fp16": 1}).precision_meaning()


@pytest.mark.parametrize("gpu,card", [("a100-80g", "bf16"), ("rtx3090", "bf16"), ("v100", "fp16"), ("t4", "fp16")])
def test_auto_keeps_the_cards_precision_in_the_plan_and_computes_fp32_where_the_host_is_slow(gpu, card):
    policy = PrecisionPolicy.local("auto", device=CPU, given=emulated(gpu), host=AVX2)
    assert policy.name == card                         # what the plan records: the real card's rule
    assert policy.compute == "fp32" and policy.dtype is None
    reason = policy.choice.reason
    assert f"{card} on the real card" in reason and "AMD EPYC" in reason and "slower than fp32" in reason
    assert f"computes in fp32 (--precision {card} forces {card})" in reason
    assert policy.choice.warning is None


def test_auto_computes_the_cards_precision_where_the_host_runs_it_fast():
    a100 = PrecisionPolicy.local("auto", device=CPU, given=emulated("a100-80g"), host=BF16)
    assert a100.name == a100.compute == "bf16" and a100.dtype == torch.bfloat16
    # AVX512-FP16 in the flags, but torch's CPU fp16 ran 33x slower there: a V100 still computes fp32
    v100 = PrecisionPolicy.local("auto", device=CPU, given=emulated("v100"), host=BF16)
    assert v100.name == "fp16" and v100.compute == "fp32"


def test_an_explicit_precision_is_honoured_with_the_slowdown_in_a_warning():
    choice = choose_precision("bf16", device_facts(CPU, emulated("a100-80g"), AVX2))
    assert choice.precision == choice.compute == "bf16"
    assert "39x slower than fp32" in choice.warning and "--precision auto" in choice.warning
    assert choose_precision("bf16", device_facts(CPU, emulated("a100-80g"), BF16)).warning is None
    fp16 = choose_precision("fp16", device_facts(CPU, emulated("rtx3090"), NOBF16))
    assert fp16.compute == "fp16" and "22x slower" in fp16.warning


def test_real_gpus_and_plain_cpus_ignore_host_facts():
    cuda = DeviceFacts(label="cuda:0 A100", kind="cuda", capability=(8, 0),
                       host_slowdown=(("bf16", 40.0), ("fp16", 40.0)))
    assert choose_precision("auto", cuda).compute == "bf16"
    assert PrecisionPolicy.local("auto", device=CPU, host=AVX2).compute == "fp32"   # plain CPU: fp32 anyway


def test_a_bad_recorded_file_is_a_usage_error(tmp_path, monkeypatch):
    bad = tmp_path / "host.json"
    bad.write_text('{"schema": 1, "cpu": "x"}')
    monkeypatch.setenv(HOST_FACTS_ENV, str(bad))
    with pytest.raises(UsageError, match=HOST_FACTS_ENV):
        host_facts()


@pytest.fixture
def fresh_host(tmp_path, monkeypatch):
    """No recorded host; a throwaway cache; a measurement that counts its calls (the real one is
    tested once, below)."""
    monkeypatch.delenv(HOST_FACTS_ENV, raising=False)
    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path))
    calls = []

    def fake_measure():
        cpu, flags = hostmod.cpu_identity()
        calls.append(1)
        return HostFacts(cpu=cpu, flags=flags, torch=torch.__version__, block_ms={"fp32": 1.0, "bf16": 5.0})

    monkeypatch.setattr(hostmod, "measure", fake_measure)
    return tmp_path, calls


def test_measured_once_then_cached(fresh_host):
    root, calls = fresh_host
    first = host_facts()
    second = host_facts()
    assert len(calls) == 1 and first.source == "measured" and second.source.startswith("cache ")
    assert second.block_ms == first.block_ms and second.note == ""
    assert len(list((root / "host").glob("*.json"))) == 1


def test_a_corrupt_cache_or_one_from_another_cpu_is_measured_again_with_a_note(fresh_host):
    root, calls = fresh_host
    host_facts()
    (path,) = (root / "host").glob("*.json")
    path.write_text("{not json")
    again = host_facts()
    assert len(calls) == 2 and "unreadable" in again.note and "measured again" in again.note
    foreign = json.loads(path.read_text())
    foreign["cpu"] = "Some Other CPU"
    path.write_text(json.dumps(foreign))
    third = host_facts()
    assert len(calls) == 3 and "another CPU" in third.note and "Some Other CPU" in third.note
    assert host_facts().note == ""                 # the new measurement replaced it


def test_a_real_measurement_times_all_three_precisions(monkeypatch):
    monkeypatch.delenv(HOST_FACTS_ENV, raising=False)
    threads = torch.get_num_threads()
    facts = hostmod.measure()
    assert torch.get_num_threads() == threads      # one thread while measuring, then as it was
    assert set(facts.block_ms) == set(facts.matmul_ms) == {"fp32", "bf16", "fp16"}
    assert all(v > 0 for v in (*facts.block_ms.values(), *facts.matmul_ms.values()))
    assert set(facts.flags) <= set(hostmod.FLAGS) and facts.cpu
    assert HostFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


class _BurstClock:
    """A clock that each timed call advances: by `base` seconds, three times that while a burst
    of other work holds the host (from the `burst_from`-th call of any function on)."""

    def __init__(self, base: float, burst_from: int):
        self.now, self.calls, self.base, self.burst_from = 0.0, 0, base, burst_from

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.now += self.base * (3 if self.calls >= self.burst_from else 1)
        self.calls += 1


def test_precisions_are_timed_in_turn_so_a_burst_slows_them_alike():
    clock = _BurstClock(0.01, burst_from=6)     # from the 7th call on: the host is busy
    fns = {"fp32": clock.work, "bf16": clock.work}
    got = hostmod.least_ms_interleaved(fns, clock=clock, budget_s=1.0, runs=5)
    assert got == pytest.approx({"fp32": 10.0, "bf16": 10.0})
    # one precision after the other (warm-up, then its runs), the same burst covers all of bf16's
    # runs: it reads 3x slower than fp32, past the 1.5x that makes the rule compute fp32
    clock = _BurstClock(0.01, burst_from=6)
    one_after_another = {k: hostmod.least_ms_interleaved({k: clock.work}, clock=clock, budget_s=1.0, runs=5)[k]
                         for k in ("fp32", "bf16")}
    assert one_after_another["bf16"] / one_after_another["fp32"] == pytest.approx(3.0)


def test_each_precision_gets_at_least_two_runs_and_stops_at_its_own_budget():
    calls = {"fast": 0, "slow": 0}
    clock = _BurstClock(0.0, burst_from=10**9)

    def timed(name, seconds):
        def fn():
            calls[name] += 1
            clock.now += seconds
        return fn

    got = hostmod.least_ms_interleaved({"fast": timed("fast", 0.01), "slow": timed("slow", 0.2)},
                                       clock=clock, budget_s=0.15, runs=5)
    assert calls == {"fast": 1 + 5, "slow": 1 + 2}       # a warm-up each; 5 runs of 10 ms, 2 of 200 ms
    assert got == pytest.approx({"fast": 10.0, "slow": 200.0})


def test_a_measurement_times_every_precision_in_one_interleaved_set(monkeypatch):
    # the wiring of the test above: measure() hands all three precisions to least_ms_interleaved
    # at once (the matmuls, then the blocks), never one precision's runs after another's
    sets = []

    def record(fns, **kw):
        sets.append(sorted(fns))
        return dict.fromkeys(fns, 1.0)

    monkeypatch.setattr(hostmod, "least_ms_interleaved", record)
    facts = hostmod.measure()
    assert sets == [["bf16", "fp16", "fp32"]] * 2
    assert facts.block_ms == facts.matmul_ms == {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}
