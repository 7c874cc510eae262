"""`hetrain bench`'s pure parts: the equal-split plan made from hetrain's, the figures computed from
the runs, and the busy-host warning."""

from __future__ import annotations

import pytest

from hetrain.benching.runs import BenchResult, BenchSetup, Run, busy_host, equal_split_plan
from hetrain.errors import UsageError
from hetrain.planning.plan import DevicePlan, Plan


def hetrain_plan(shares, caps) -> Plan:
    return Plan(global_batch=sum(shares), version=3, note="rebalanced", predicted={"samples_per_s": 9.0},
                devices=tuple(DevicePlan(rank=r, device=f"d{r}", speed=1.0 / (r + 1), share=s, micro_batch=s if c is None else min(s, c),
                                         max_micro_batch=c, precision="bf16", checkpointing=r == 1,
                                         predicted_compute_s=0.1, reasons=("by speed",))
                              for r, (s, c) in enumerate(zip(shares, caps))))


def test_the_equal_split_keeps_each_devices_caps_and_precision_and_only_evens_the_shares():
    plan = equal_split_plan(hetrain_plan([41, 23], [64, 16]))
    assert plan.shares == (32, 32) and plan.version == 0 and plan.predicted == {}
    assert [d.micro_batch for d in plan.devices] == [32, 16]          # the 3090's memory cap still holds
    assert [d.n_micro for d in plan.devices] == [1, 2]
    assert [d.precision for d in plan.devices] == ["bf16", "bf16"] and plan.devices[1].checkpointing
    assert all(d.predicted_compute_s is None and "equal split" in d.reasons[0] for d in plan.devices)
    assert Plan.from_json(plan.to_json()) == plan                     # the worker reads it back as a file
    odd = equal_split_plan(hetrain_plan([10, 3, 2], [None, None, None]))
    assert odd.shares == (5, 5, 5)
    assert equal_split_plan(hetrain_plan([11, 5], [16, 16])).shares == (8, 8)
    assert equal_split_plan(hetrain_plan([12, 5], [16, 16])).shares == (9, 8)   # 17: they differ by one


def run(sps, shares, memory) -> Run:
    return Run(samples_per_s=sps, devices=tuple(f"d{i}" for i in range(len(shares))), shares=tuple(shares),
               micro_batches=tuple(shares), peak_memory_bytes=tuple(memory))


def test_the_figures_are_ratios_of_the_runs():
    setup = BenchSetup(factory="f.py:make", emulate="a100-80g,rtx3090", devices=("a100-80g", "rtx3090"),
                       global_batch=64, steps=5, warmup=1)
    result = BenchResult(setup=setup, alone=(run(100.0, [64], [10]), run(60.0, [64], [10])),
                         equal_split=run(110.0, [32, 32], [6, 6]), hetrain=run(144.0, [40, 24], [7, 5]),
                         host={"cores": 2})
    out = result.to_dict()
    assert out["speedup_vs_equal"] == pytest.approx(144 / 110) and out["efficiency"] == pytest.approx(144 / 160)
    assert out["speedup_vs_fastest_alone"] == pytest.approx(1.44) and out["sum_of_alone_samples_per_s"] == 160
    assert [a["device"] for a in out["alone"]] == ["d0", "d1"] and out["hetrain"]["shares"] == [40, 24]


@pytest.mark.parametrize("kw, words", [
    ({"steps": 0}, "--steps 0"), ({"warmup": -1}, "--warmup -1"), ({"devices": ("a100-80g",)}, "nothing to split"),
    ({"global_batch": 1}, "--global-batch 1 is smaller than the 2 devices"),
])
def test_a_setup_that_cannot_bench_is_refused(kw, words):
    base = dict(factory="f.py:make", emulate="a100-80g,rtx3090", devices=("a100-80g", "rtx3090"),
                global_batch=64, steps=5, warmup=1)
    with pytest.raises(UsageError, match=words):
        BenchSetup(**{**base, **kw})


def test_a_busy_host_is_named_and_an_idle_one_is_not():
    assert busy_host({"load_average_at_start": 0.3, "cores": 2}) is None
    assert busy_host({"load_average_at_start": None, "cores": 2}) is None
    warning = busy_host({"load_average_at_start": 3.4, "cores": 2})
    assert "load average 3.4 on 2 cores" in warning and "idle machine" in warning


def test_a_device_that_cannot_run_alone_counts_zero_and_says_why(tmp_path, capsys):
    from hetrain.benching.show import draw_png, print_table

    setup = BenchSetup(factory="f.py:make", emulate="a100-80g,rtx3090@6MiB", devices=("a100-80g", "rtx3090@6MiB"),
                       global_batch=16, steps=2, warmup=1)
    result = BenchResult(setup=setup, alone=(run(100.0, [16], [10]), Run.failed("rtx3090@6MiB", "the model fits on no device")),
                         equal_split=run(80.0, [8, 8], [6, 6]), hetrain=run(90.0, [12, 4], [7, 5]), host={"cores": 2})
    out = result.to_dict()
    assert out["alone"][1] == {"device": "d1", "samples_per_s": 0.0, "peak_memory_bytes": 0, "micro_batch": 0, "rounds": [],
                               "error": "the model fits on no device"}
    assert out["efficiency"] == pytest.approx(0.9) and out["speedup_vs_fastest_alone"] == pytest.approx(0.9)
    print_table(result)
    printed = capsys.readouterr().out
    assert "d1 alone cannot run it: the model fits on no device (0 samples/s standalone)" in printed
    draw_png(result, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_rounds_interleave_and_each_figure_is_the_median_of_its_rounds(monkeypatch):
    """run_bench with the launches replaced by a host whose speed drifts down round after round:
    the order reverses every other round, both multi-device sides run with rebalancing off (hetrain
    on its round-1 plan from round 2 on), and each figure is its rounds' median."""
    import json as _json

    from hetrain.benching import runs as runs_mod

    launched, speed = [], {"alone0": 100.0, "alone1": 60.0, "hetrain": 150.0, "equal": 120.0}
    plan = hetrain_plan([40, 24], [None, None])

    def fake_launch(setup, tmp, name, phase, *, config, device=None):
        key, k = name.rsplit("-", 1)
        launched.append((key, int(k), dict(config)))
        drift = 1.0 - 0.1 * len(launched) / 12          # the host slows as the bench goes on
        shares = (64,) if device else (plan.shares if key == "hetrain" else (32, 32))
        return Run(samples_per_s=speed[key] * drift, devices=tuple(f"d{i}" for i in range(len(shares))),
                   shares=shares, micro_batches=shares, peak_memory_bytes=(5,) * len(shares),
                   plan=_json.loads(plan.to_json()))

    monkeypatch.setattr(runs_mod, "_launch", fake_launch)
    monkeypatch.setattr(runs_mod, "_load_average", lambda: 0.0)
    setup = BenchSetup(factory="f.py:make", emulate="a100-80g,rtx3090", devices=("a100-80g", "rtx3090"),
                       global_batch=64, steps=2, warmup=1, rounds=3)
    said = []
    result = runs_mod.run_bench(setup, say=said.append)
    order = [(key, k) for key, k, _ in launched]
    forward = ["alone0", "alone1", "hetrain", "equal"]
    assert order == [(n, 0) for n in forward] + [(n, 1) for n in reversed(forward)] + [(n, 2) for n in forward]
    assert [o for o in result.orders] == [tuple(forward), tuple(reversed(forward)), tuple(forward)]
    for key, k, config in launched:
        if key in ("hetrain", "equal"):
            assert config["rebalancing"] == {"enabled": False}       # the same setting on both sides
            assert ("plan" in config) == (key == "equal" or k > 0)   # hetrain re-runs its round-1 plan
    for r, key in ((result.hetrain, "hetrain"), (result.equal_split, "equal"), (result.alone[0], "alone0")):
        assert len(r.rounds) == 3 and r.samples_per_s == sorted(r.rounds)[1]
        assert r.rounds[0] > r.rounds[1] > r.rounds[2]               # the drift, kept per round
    assert said[0].startswith("[1/12] round 1/3: device 0 alone") and said[-1].startswith("[12/12] round 3/3")
    with pytest.raises(UsageError, match="--rounds 0 must be at least 1"):
        BenchSetup(factory="f.py:make", emulate="x", devices=("a", "b"), global_batch=4, steps=1, warmup=0, rounds=0)
