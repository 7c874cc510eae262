"""`hetrain report`: a metrics.jsonl drawn as PNGs; a missing file, a missing output directory
and a malformed line are each one error line, exit 2. In this process (hetrain_here)."""

from __future__ import annotations

import json

import pytest

from clirun import hetrain_here
from hetrain.reporting import plots, runlog
from hetrain import Checkpoints, Reporting

PNG = b"\x89PNG\r\n\x1a\n"
DEVICES = ("a100-80g#0 (emulated)", "rtx3090#1 (emulated)")


def step_line(i: int, shares=(14, 10), version=0) -> dict:
    """A step as runtime/loop/metrics.py writes it (the fields report reads, and more)."""
    return {"step": i, "time": 1000.0 + i, "loss": 4.0 - 0.1 * i, "samples_per_s": 500.0, "step_s": 0.05,
            "plan_version": version,
            "devices": [{"rank": r, "device": name, "share": share, "micro_batch": 8, "micro_batches": 2,
                         "compute_s": 0.03 + 0.01 * r, "sync_s": 0.005, "wait_s": 0.015 - 0.01 * r,
                         "peak_bytes": 700_000 - 100_000 * r, "memory_cap_bytes": 2**30 * (80, 24)[r],
                         "mfu": 0.3 - 0.05 * r} for r, (name, share) in enumerate(zip(DEVICES, shares))]}


def write_run(directory, lines) -> str:
    path = directory / "metrics.jsonl"
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return str(directory)


@pytest.fixture
def run_dir(tmp_path):
    start = {"event": "start", "attempt": 0, "step": 0, "global_batch": 24, "emulated": True,
             "flops_per_sample": 2.5e6, "mfu_meaning": "emulated: not a GPU figure",
             "devices": [{"rank": r, "name": n, "peak_flops": 1e11} for r, n in enumerate(DEVICES)]}
    lines = [start, *(step_line(i) for i in range(6)),
             {"event": "rebalance", "step": 5, "version_before": 0, "version_after": 1},
             *(step_line(i, shares=(9, 15), version=1) for i in range(6, 10))]
    return write_run(tmp_path, lines)


def test_report_draws_every_picture_beside_the_metrics(run_dir, tmp_path):
    r = hetrain_here("report", run_dir)
    assert r.returncode == 0, r.stderr
    written = r.stdout.split()
    assert [p.rsplit("/", 1)[1] for p in written] == list(plots.NAMES)
    for path in written:
        with open(path, "rb") as f:
            data = f.read()
        assert data.startswith(PNG) and len(data) > 10_000        # a picture, not an empty canvas


def test_report_writes_into_out_and_reads_a_checkpoint_dirs_metrics(tmp_path):
    (tmp_path / "ckpt" / "metrics").mkdir(parents=True)
    write_run(tmp_path / "ckpt" / "metrics", [step_line(0), step_line(1)])
    (tmp_path / "pictures").mkdir()
    r = hetrain_here("report", str(tmp_path / "ckpt"), "--out", str(tmp_path / "pictures"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == sorted(plots.NAMES)


def test_the_later_line_of_a_step_done_again_after_a_restart_counts(tmp_path):
    first, again = step_line(3), step_line(3)
    again["loss"] = 1.25
    log = runlog.read(write_run(tmp_path, [step_line(2), first, {"event": "restart", "attempt": 1, "step": 3},
                                           again]) + "/metrics.jsonl")
    assert [s["step"] for s in log.steps] == [2, 3] and log.steps[1]["loss"] == 1.25
    assert [e["event"] for e in log.events] == ["restart"]


def one_error(r, *words):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("hetrain: error:") and "Traceback" not in r.stderr
    assert len(lines) <= 2 and all(w in lines[0] for w in words), lines


def test_a_directory_without_metrics_says_where_it_looked_and_how_to_make_them(tmp_path):
    r = hetrain_here("report", str(tmp_path))
    one_error(r, "no metrics.jsonl", str(tmp_path))
    assert "--metrics-dir" in r.stderr


def test_an_output_directory_that_does_not_exist_is_refused(run_dir, tmp_path):
    one_error(hetrain_here("report", run_dir, "--out", str(tmp_path / "nowhere")), "--out", "not a directory")


@pytest.mark.parametrize("bad, words", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not an object"),
    ('{"loss": 1.0}', "'step'"),
    ('{"step": 3, "devices": [{"device": "a", "share": 4}]}', "'compute_s'"),
])
def test_a_malformed_line_is_named(tmp_path, bad, words):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(step_line(0)) + "\n" + bad + "\n")
    one_error(hetrain_here("report", str(tmp_path)), "line 2", words)


def test_run_passes_metrics_dir_and_status_every_to_the_workers_in_the_launch_file(tmp_path, monkeypatch):
    from hetrain.cli import train as train_cli
    from hetrain.runtime.config import LAUNCH_ENV, Config

    launched = []
    monkeypatch.setattr(train_cli, "run_launch", lambda launch: launched.append(launch) or 0)
    script = tmp_path / "train.py"
    script.write_text("")
    r = hetrain_here("run", "--run-dir", str(tmp_path / "run"), "--metrics-dir", str(tmp_path / "m"),
                     "--status-every", "5", str(script))
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv(LAUNCH_ENV, launched[0].env[LAUNCH_ENV])
    config = Config(global_batch=8, reporting=Reporting(metrics_dir="/the/scripts"),
                    checkpoints=Checkpoints(dir="/c")).with_launch_file()
    assert (config.metrics_path(), config.reporting.status_every) == (str(tmp_path / "m"), 5)  # the command line wins
    r = hetrain_here("run", "--run-dir", str(tmp_path / "run2"), "--verbose", str(script))
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv(LAUNCH_ENV, launched[1].env[LAUNCH_ENV])
    assert Config(global_batch=8).with_launch_file().reporting.status_every == train_cli.VERBOSE_STATUS_EVERY


def test_run_refuses_a_metrics_dir_it_could_not_make(tmp_path):
    (tmp_path / "file").write_text("")
    script = tmp_path / "train.py"
    script.write_text("")
    one_error(hetrain_here("run", "--metrics-dir", str(tmp_path / "file" / "m"), str(script)),
              "--metrics-dir", "not a writable directory")
