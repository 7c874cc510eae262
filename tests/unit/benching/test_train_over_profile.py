"""benchmarks/train_over_profile.py: each block of passes is read against the training steps just
before it (never the warm-up's), the rank that sets the step is the busiest, and bad input is a
usage error before anything is launched."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def top(benchmark_module):
    return benchmark_module("train_over_profile")


def record(train, blocks, busy, faults=None, rank=0):
    return {"rank": rank, "label": f"dev#{rank}", "speed": 0.5, "share": 4, "micro_batch": 4, "precision": "fp32",
            "train_s": train, "busy_s": busy, "faults": faults or [0] * len(train), "blocks": blocks}


def test_a_block_is_read_against_the_two_steps_before_it(top):
    # steps 1-2 are the warm-up (their block is skipped); steps 3-4 cost 1.1 and 1.3 a sample,
    # steps 5-6 cost 2.0 and 2.0; the blocks after steps 4 and 6 ran flat at 1.0 and paced at 1.05
    train = [9.0, 9.0, 1.1, 1.3, 2.0, 2.0]
    blocks = [{"after_step": 2, "flat": 1.0, "paced": 5.0},
              {"after_step": 4, "flat": 1.0, "paced": 1.05},
              {"after_step": 6, "flat": 1.6, "paced": 1.6 * 1.05}]
    row = top.summarise(record(train, blocks, busy=[1.0] * 6, faults=[500, 400, 10, 20, 30, 40]))
    assert row["blocks"] == 2
    assert row["train_over_flat"] == pytest.approx((1.2 / 1.0 + 2.0 / 1.6) / 2)
    assert row["paced_over_flat"] == pytest.approx(1.05)
    assert row["faults_per_step"] == 25          # the warm-up's faults left out


def test_the_forward_and_the_rest_are_read_apart(top):
    # after step 4: training took 1.2 a sample, 0.3 of it the model's forward; the flat pass 1.0,
    # 0.25 of it forward; paced 1.05 (0.25 forward), through DDP 1.1 (0.26 forward)
    train, forwards = [9.0, 9.0, 1.2, 1.2], [3.0, 3.0, 0.3, 0.3]
    blocks = [{"after_step": 4, "flat": 1.0, "paced": 1.05, "ddp": 1.1,
               "flat_forward": 0.25, "paced_forward": 0.25, "ddp_forward": 0.26}]
    rec = record(train, blocks, busy=[1.0] * 4)
    rec["train_forward_s"] = forwards
    row = top.summarise(rec)
    assert row["forward_over_flat"] == pytest.approx(0.3 / 0.25)
    assert row["rest_over_flat"] == pytest.approx(0.9 / 0.75)
    assert row["paced_rest_over_flat"] == pytest.approx(0.8 / 0.75)
    assert row["ddp_rest_over_flat"] == pytest.approx(0.84 / 0.75)
    assert row["ddp_over_flat"] == pytest.approx(1.1)


def test_no_block_past_the_warm_up_reads_as_unknown(top):
    row = top.summarise(record([1.0, 1.0], [{"after_step": 2, "flat": 1.0, "paced": 1.0}], busy=[1.0, 1.0]))
    assert row["blocks"] == 0 and row["train_over_flat"] is None and row["paced_over_flat"] is None


def test_the_busiest_rank_sets_the_step(top):
    rows = [top.summarise(record([1.0] * 4, [], busy=[0.2] * 4, rank=0)),
            top.summarise(record([1.0] * 4, [], busy=[0.3] * 4, rank=1))]
    assert top.setting_rank(rows) == 1
    assert "<- sets the step" in top.table(rows, 1).splitlines()[2]


def test_train_over_plan_is_what_the_plan_still_misses(top):
    # training at 1.2x its flat-out pass, where the plan expected 1.05x (its measured pacing and
    # DDP costs on the step's one micro-batch)
    rec = record([9.0, 9.0, 1.2, 1.2], [{"after_step": 4, "flat": 1.0, "paced": 1.05}], busy=[1.0] * 4)
    rec.update(plan_over_flat=1.05, paced_cost=1.02, ddp_cost=1.03)
    row = top.summarise(rec)
    assert row["train_over_plan"] == pytest.approx(1.2 / 1.05)
    assert (row["paced_cost"], row["ddp_cost"]) == (1.02, 1.03)
    assert top.summarise(record([9.0, 9.0, 1.2, 1.2], [], busy=[1.0] * 4))["train_over_plan"] is None


def test_the_step_is_read_against_its_prediction_with_the_hosts_drift_apart(top):
    # steps 3-6 (0-based 2-5) past the warm-up; those right after a block (2, 4) left out: 3 and 5
    # took 0.26 s of wall, 0.24 of it busy, 0.013 queued; the plan said 0.2 s. The flat pass ran
    # 1.1 ms a sample in the run, the profile 1.0: the host 10% slower, so the prediction at the
    # run's speed is 0.05 s of sync and the like + 0.15 s of CPU × 1.1 = 0.215 s: 20.9% off
    train = [9.0, 9.0, 0.012, 0.012, 0.012, 0.012]
    blocks = [{"after_step": 4, "flat": 0.0011, "paced": 0.0011}, {"after_step": 6, "flat": 0.0011, "paced": 0.0011}]
    rec = record(train, blocks, busy=[1.0, 1.0, 0.5, 0.24, 0.5, 0.24])
    rec.update(wall_s=[1.0, 1.0, 0.9, 0.26, 0.9, 0.26], queued_s=[0.0, 0.0, 0.5, 0.013, 0.5, 0.013],
               predicted_step_s=0.2, predicted_cpu_s=0.15, profile_s=0.001)
    row = top.summarise(rec)
    assert row["step_wall_ms"] == pytest.approx(260) and row["predicted_step_ms"] == pytest.approx(200)
    assert row["wall_over_busy"] == pytest.approx(0.26 / 0.24) and row["queued_share"] == pytest.approx(0.05)
    assert row["flat_over_profile"] == pytest.approx(1.1) and row["step_over_predicted"] == pytest.approx(1.3)
    assert row["predicted_at_run_speed_ms"] == pytest.approx(215)
    assert row["step_over_predicted_at_run_speed"] == pytest.approx(260 / 215)
    assert "1.209" in top.step_table([row], 0)


def test_the_plans_expectation_adds_the_last_micro_batchs_costs_to_the_profiles_compute(top):
    from types import SimpleNamespace

    from hetrain.planning.profile import DeviceProfile

    p = DeviceProfile(device="d", source="t", overhead_s=0.0, per_sample_s=0.01, fixed_bytes=0,
                      activation_bytes_per_sample=0, cpu_share=0.5, paced_cost=1.04)
    one = top.plan_over_flat(p, SimpleNamespace(share=20, micro_batch=20), 1.05)
    assert one["plan_over_flat"] == pytest.approx(1.04 * 1.05)     # one micro-batch: all of it paced
    two = top.plan_over_flat(p, SimpleNamespace(share=20, micro_batch=10), 1.05)
    assert two["plan_over_flat"] == pytest.approx(1 + (1.04 * 1.05 - 1) / 2)   # the last of two


@pytest.mark.parametrize("argv, words", [(["--steps", "3"], "--steps 3"),
                                         (["--max-train-over-flat", "0"], "not a ratio"),
                                         (["--max-train-over-plan", "-1"], "--max-train-over-plan -1"),
                                         (["--cluster", "nosuchgpu"], "nosuchgpu")])
def test_bad_input_is_a_usage_error(top, argv, words, tmp_path, capsys):
    assert top.main(["--json", os.fspath(tmp_path / "x.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_over_profile:") and words in err
    assert not (tmp_path / "x.json").exists()
