"""Crashes, hangs and resumes through `hetrain run`: the job finishes with the parameters of an
uninterrupted run (one process's training, computed here), its sample log holds one process's
samples step by step, every sample exactly once per epoch; bad input stops it at once."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from hetrain.runtime.resilience.resume import read_sample_log
from resilient_reference import assert_samples_of_one_process, one_process
from run_here import hetrain_run_here

SCRIPT = str(Path(__file__).parent / "scripts" / "resilient_train.py")
PAIR = "a100-80g,rtx3090"
N = 40   # samples in the script's dataset


def run(tmp: Path, name: str, steps: int, *, emulate=PAIR, faults: str | None = None, restarts=0,
        ckpt: Path | None = None, extra=(), timeout=300):
    """The script launched by `hetrain run` (its launcher in this process: run_here.py)."""
    out = tmp / f"{name}.pt"
    ckpt = ckpt or tmp / f"{name}-ckpt"
    result = hetrain_run_here("--emulate", emulate, "--max-restarts", str(restarts), SCRIPT, "--steps", str(steps),
                              "--out", str(out), "--ckpt", str(ckpt), *extra,
                              env={"HETRAIN_FAULTS": faults} if faults else None, timeout=timeout)
    return result, out, ckpt


def params(path: Path):
    return torch.load(path)["params"]


def assert_close(a, b, tol=1e-5):
    assert max((u - v).abs().max().item() for u, v in zip(a, b)) <= tol


def assert_each_sample_once_per_epoch(ckpt: Path, steps: int):
    log = read_sample_log(str(ckpt / "samples"))
    assert sorted(log) == list(range(steps))
    pairs = [pair for s in sorted(log) for pair in log[s]]
    assert len(pairs) == steps * 16 and max(Counter(pairs).values()) == 1
    per_epoch = Counter(e for e, _ in pairs)
    for epoch, count in per_epoch.items():
        if epoch < max(per_epoch):
            assert count == N


@pytest.fixture(scope="module")
def clean():
    """What the uninterrupted 10-step job ends with: one process's training, computed here
    (resilient_reference.py); every job below must end there, on one process's samples."""
    return one_process(10)


def finished_ckpt(faulty, tmp: Path) -> Path:
    """A copy of a finished job's checkpoint directory (the faulty job's), this test's to change."""
    import shutil

    return Path(shutil.copytree(faulty[2], tmp / "ckpt"))


# One job through every fault a restart gets past, one per attempt (each fault fires in its own
# restart attempt): a launch and its ranks' imports for each fault, not a clean first attempt too.
FAULTS = ("die:rank=1,step=3;"                              # at the start of a step
          "die:rank=0,step=5,phase=backward,attempt=1;"     # inside the gradient sync
          "die:rank=1,step=8,phase=checkpoint,attempt=2;"   # while a checkpoint is written
          "oom:rank=1,step=7,escape=1,attempt=3;"           # an OOM outside hetrain's recovery
          "stall:rank=0,step=9,attempt=4")                  # a hang: --timeout makes it an error


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faulty")
    result, out, ckpt = run(tmp, "faulty", 10, faults=FAULTS, restarts=5, extra=("--timeout", "8"))
    assert result.returncode == 0, result.stderr[-4000:]
    # the last step's checkpoint written, none left half-written by the kills
    names = sorted(p.name for p in ckpt.glob("step-*"))
    assert names[-1] == "step-00000010" and all(n[len("step-"):].isdigit() for n in names), names
    return result, out, ckpt


def test_kill_minus_9_at_three_points_resumes_to_the_same_parameters(faulty, clean):
    result, out, ckpt = faulty
    resumed = [line for line in result.stdout.splitlines() if "resumed from step-" in line]
    assert len(resumed) == 5, resumed                                 # one resume per fault
    # die at step 3 -> step 2; in step 5's sync -> step 4; writing step 8's -> step 6
    for step in ("step-00000002", "step-00000004", "step-00000006"):
        assert any(f"resumed from {step}" in line for line in resumed[:3]), resumed
    assert_close(params(out), clean)
    assert_samples_of_one_process(ckpt, 10)
    assert torch.load(out)["lr"] == pytest.approx([1e-2 * 0.5 ** 3])   # the LR schedule resumed too
    assert_each_sample_once_per_epoch(ckpt, 10)


def test_an_oom_that_escapes_the_loop_restarts_with_a_smaller_micro_batch(faulty, clean):
    result, out, ckpt = faulty
    assert_close(params(out), clean)
    assert_samples_of_one_process(ckpt, 10)
    assert "after an out-of-memory error ended the previous attempt: rank 1 micro-batch" in result.stdout
    resumed = [line for line in result.stdout.splitlines() if "resumed from step-" in line]
    assert "resumed from step-00000006" in resumed[3], resumed      # the OOM in step 7


@pytest.mark.slow
def test_a_hung_rank_becomes_an_error_and_a_restart(faulty, clean):
    result, out, ckpt = faulty
    assert_close(params(out), clean)
    assert_samples_of_one_process(ckpt, 10)
    assert_each_sample_once_per_epoch(ckpt, 10)
    resumed = [line for line in result.stdout.splitlines() if "resumed from step-" in line]
    assert "resumed from step-00000008" in resumed[4], resumed      # the hang in step 9
    assert result.stdout.count("resumed from step-") == 5           # no attempt beyond the five faults


def one_line(result, *words):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    assert sum(line.startswith("hetrain: error") for line in result.stderr.splitlines()) == 1
    for w in words:
        assert w in result.stderr, result.stderr


def refused_in_ranks(tmp: Path, name: str, steps: int, ckpt: Path, *extra: str, words=()) -> None:
    """The script on the pair, in tests/harness.py's forked ranks (no launch each): every rank
    raises the same UsageError (agreed: printed once), one line and its fix, with `words`. What
    `hetrain run` makes of a UsageError raised there, one line and exit 2, the launched refusal
    (test_unwritable_checkpoint_dir_...) checks."""
    from harness import run_ranks
    from init_errors import raise_case

    code = Path(SCRIPT).read_text().replace("Emulation(sample_s=", f"Emulation(cluster={PAIR!r}, sample_s=")
    got = run_ranks(raise_case, 2, code, str(tmp), ("--steps", str(steps), "--out", str(tmp / f"{name}.pt"),
                                                    "--ckpt", str(ckpt), *extra))
    assert len(set(got)) == 1 and got[0] is not None and got[0][0] == "UsageError", got      # agreed
    _, what, fix = got[0]
    assert "\n" not in what + fix and all(w in f"{what} {fix}" for w in words), got
    assert not (tmp / f"{name}.pt").exists()


def test_resume_from_another_model_is_refused_without_touching_it(tmp_path, faulty):
    ckpt = finished_ckpt(faulty, tmp_path)      # a job's checkpoints (the fixture asserts it finished)
    before = sorted(p.name for p in ckpt.iterdir())
    refused_in_ranks(tmp_path, "b", 12, ckpt, "--width", "64",                  # a job that goes on from it
                     words=("different model", "new Checkpoints(dir=...)"))
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_unwritable_checkpoint_dir_and_nothing_to_resume(tmp_path):
    """Bad input stops the job at once: --max-restarts is for failures a restart can get past."""
    blocker, attempts = tmp_path / "file", tmp_path / "attempts.txt"
    blocker.write_text("not a directory")
    result = run(tmp_path, "x", 2, ckpt=blocker / "ckpt", restarts=3, extra=("--attempts", str(attempts)))[0]
    one_line(result, "not writable")
    errors = [line for line in result.stderr.splitlines() if line.startswith("hetrain: error")]
    assert "is not writable" in errors[0], result.stderr[-2000:]
    assert attempts.read_text().split() == ["0", "0"]       # both ranks, first attempt only
    # nothing to resume under resume='must'
    refused_in_ranks(tmp_path, "y", 2, tmp_path / "empty", "--resume", "must",
                     words=("no whole checkpoint", "resume='auto'"))


def preempt(tmp: Path, name: str, ckpt: Path, *, signum, target: str, after_steps: int, emulate=PAIR):
    """Start the job, let it log `after_steps` more steps, send `signum` to the launcher or to rank
    1's worker; returns (result, seconds from the signal to the launcher's exit, steps logged)."""
    import subprocess
    import sys
    import time

    pids, log = tmp / f"{name}-pids", ckpt / "samples" / "rank0.jsonl"
    logged = lambda: len(log.read_text().splitlines()) if log.exists() else 0   # noqa: E731
    before = logged()
    env = {**os.environ, "PYTHONPATH": f"{Path(__file__).resolve().parents[2] / 'src'}"}
    proc = subprocess.Popen([sys.executable, "-m", "hetrain", "run", "--emulate", emulate, SCRIPT, "--steps", "10",
                             "--out", str(tmp / f"{name}.pt"), "--ckpt", str(ckpt), "--every", "100",
                             "--pause", "0.3", "--pids", str(pids)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while logged() < before + after_steps:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    os.kill(proc.pid if target == "launcher" else int((pids / "pid-rank1").read_text()), signum)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0, logged()


def test_preempted_resumed_on_fewer_devices_past_a_truncated_checkpoint_equals_an_uninterrupted_job(
        tmp_path, clean):
    """SIGTERM to the launcher of a job on three devices, SIGINT to one worker of its resumption on
    two, the newest checkpoint cut, then the job finished on two: each stop saves the step it
    reached, the resume on fewer devices keeps the sample cursor, the cut checkpoint is passed over,
    and the job ends where the uninterrupted one did (big-batch math: the world size does not
    change it)."""
    import signal as _signal

    ckpt = tmp_path / "ckpt"
    # SIGTERM to the launcher (what Slurm and Kubernetes send): torchrun forwards it to the workers.
    first, seconds, logged = preempt(tmp_path, "first", ckpt, signum=_signal.SIGTERM, target="launcher",
                                     after_steps=2, emulate="a100-80g,rtx3090,t4")
    assert first.returncode == 75, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    lines = [line for line in first.stderr.splitlines() if line.startswith("hetrain:")]
    assert len(lines) == 1 and "preempted (SIGTERM on rank 0, SIGTERM on rank 1, SIGTERM on rank 2)" in lines[0], \
        first.stderr[-2000:]
    saved = sorted(p.name for p in ckpt.glob("step-*"))
    assert saved == [f"step-{logged:08d}"] and f"step-{logged:08d} saved after step {logged}" in lines[0]
    assert 2 <= logged < 10                                 # every step that finished is in it: none lost
    print(f"SIGTERM to the launcher: exit 75 after {seconds:.2f} s, saved step {logged}")

    # SIGINT to one worker (rank 1) of the job resumed on two of the devices: the agreement stops
    # rank 0 too.
    second, seconds, logged2 = preempt(tmp_path, "second", ckpt, signum=_signal.SIGINT, target="worker",
                                       after_steps=2)
    assert second.returncode == 75, second.stderr[-3000:]
    assert f"resumed from step-{logged:08d}" in second.stdout and "re-planned for 2 devices" in second.stdout
    assert "preempted (SIGINT on rank 1)" in second.stderr and "Traceback" not in second.stderr
    assert (ckpt / f"step-{logged2:08d}").is_dir() and logged < logged2 < 10
    print(f"SIGINT to rank 1: exit 75 after {seconds:.2f} s, saved step {logged2}")

    # The newest checkpoint cut: the finishing job reports it and resumes from the one before.
    newest = ckpt / f"step-{logged2:08d}"
    victim = max((f for f in newest.iterdir() if f.suffix == ".distcp"), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    third, out, _ = run(tmp_path, "third", 10, ckpt=ckpt)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"step-{logged2:08d} is unusable" in third.stdout and "truncated" in third.stdout
    assert f"resumed from step-{logged:08d}" in third.stdout and "re-planned for 2 devices" in third.stdout
    assert_close(params(out), clean)
    assert_samples_of_one_process(ckpt, 10)
    assert torch.load(out)["lr"] == pytest.approx([1e-2 * 0.5 ** 3])
    assert_each_sample_once_per_epoch(ckpt, 10)
    # Retention (Checkpoints' default keep=3) counts checkpoints known whole: the one resumed from
    # and the ones this job wrote (every 2nd step); the cut one stays only while newer than all kept.
    written = [s for s in range(logged + 1, 11) if s % 2 == 0]
    kept = sorted({logged, *written})[-3:]
    cut_kept = [logged2] if logged2 not in written and logged2 > kept[0] else []
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{s:08d}" for s in sorted(kept + cut_kept)]


def test_a_checkpoint_dir_in_use_by_another_job_is_refused_and_left_as_it_is(tmp_path):
    from lock_holder import hold

    from hetrain.runtime.resilience.lock import CHECKPOINT_LOCK

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-00000002.tmp").mkdir()                      # the other job's checkpoint in progress
    (ckpt / "oom-rank1.json").write_text('{"rank": 1, "micro": 4, "step": 1, "run_id": "other"}')
    holder = hold(ckpt, CHECKPOINT_LOCK)
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    try:
        refused_in_ranks(tmp_path, "second", 2, ckpt,
                         words=("is in use by another hetrain job", f"pid {holder.pid} on host",
                                "another Checkpoints(dir=...)"))
    finally:
        holder.kill()
        holder.wait()
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before
