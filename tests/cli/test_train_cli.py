"""`hetrain run` and `hetrain demo` as a user meets them: bad input is one line with the fix
(exit 2, no traceback); the demo trains; before training both print a compact plan (one table, one
summary line), and --verbose every reason behind it."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from clirun import hetrain, hetrain_here


def one_line_error(result, *words):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("hetrain: error")]
    assert len(errors) == 1, result.stderr
    for w in words:
        assert w in result.stderr, result.stderr


def test_malformed_emulate_spec(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    one_line_error(hetrain_here("run", "--emulate", "a100-80g:fast,3090", str(script)),   # refused before a launch
                   "'a100-80g:fast'", "not a number", "NAME:SPEED@MEMORY")


def test_unknown_device_suggests_close_names(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    one_line_error(hetrain_here("run", "--emulate", "a100-80g,rtx-309", str(script)), "did you mean", "rtx3090")


def test_missing_script():
    one_line_error(hetrain_here("run", "no_such_train.py"), "does not exist", "fix:")


WORKER_SCRIPT = textwrap.dedent("""
    import sys, torch, hetrain
    batch, n = int(sys.argv[1]), int(sys.argv[2])
    ht = hetrain.init(global_batch=batch)
    data = torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randn(n, 1))
    model = torch.nn.Linear(3, 1)
    ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    ht.close()
    print("prepared")
""")


BAD_SETTINGS = [(1, 100, ("global batch 1 is smaller than the 2 devices", "at least 2")),
                (32, 20, ("20 samples, fewer than one global batch of 32", "at most 20"))]


def test_bad_job_settings_stop_every_rank_with_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WORKER_SCRIPT)
    batch, n, words = BAD_SETTINGS[0]
    one_line_error(hetrain("run", "--emulate", "a100-80g,rtx3090", str(script), str(batch), str(n)), *words)


def test_every_bad_job_setting_is_one_agreed_usage_error_on_every_rank(tmp_path):
    """Each setting in the two ranks of the emulated pair (tests/harness.py's forked ranks, not a
    launch each): every rank raises the same UsageError, one line and its fix, with the words.
    What `hetrain run` makes of it, one line and exit 2, the launched test above checks."""
    from harness import run_ranks
    from init_cases import raise_cases

    code = WORKER_SCRIPT.replace("hetrain.init(global_batch=batch)", "hetrain.init(global_batch=batch, "
                                 "emulation=Emulation(cluster='a100-80g,rtx3090'))")     # as --emulate gives it
    code = "from hetrain.emulation import Emulation\n" + code
    ranks = run_ranks(raise_cases, 2, [(code, str(tmp_path), {}, (str(batch), str(n))) for batch, n, _ in BAD_SETTINGS])
    for i, (batch, n, words) in enumerate(BAD_SETTINGS):       # the settings one after another in one group
        got = [answers[i] for answers in ranks]
        assert len(set(got)) == 1 and got[0] is not None and got[0][0] == "UsageError", got     # agreed
        _, what, fix = got[0]
        assert "\n" not in what + fix and all(w in f"{what} {fix}" for w in words), got


@pytest.fixture
def temp(tmp_path):
    """A TMPDIR of the test's own, to see what a run leaves in the temp folder."""
    path = tmp_path / "tmp"
    path.mkdir()
    return path


def test_a_crashing_script_names_the_rank(tmp_path, temp):
    script = tmp_path / "train.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\n")
    result = hetrain("run", "--emulate", "a100-80g,rtx3090", str(script), env={"TMPDIR": str(temp)})
    assert result.returncode == 1
    assert "rank 1 exited with code 3" in result.stderr
    assert not list(temp.glob("hetrain-*"))        # the launch's own run dir is gone, failed or not


MOST_LINES_BEFORE_TRAINING = 20
PLAN_HEADER = ("rank", "device", "share", "micro-batch", "precision", "peak memory")
# the step's parts as shares of it, compute first; a part under 0.5% is left out (a tiny model's
# compute on a busy host, whose gradient sync is slow)
SUMMARY = re.compile(r"^predicted [\d.]+ samples/s, bound by (compute on \S+ \(emulated\)|gradient sync|stragglers"
                     r"|agreement|optimizer): a [\d.]+ ms step is \d+% (compute|gradient sync|stragglers|agreement"
                     r"|optimizer)")
# lines only --verbose prints: the launcher's command and host, the precision table and its reasons,
# what was measured, the layout's choice, each rank's reasons and the plan's notes
REASONS = ("torch.distributed.run", "OMP_NUM_THREADS=1", "host CPU:", "precision per device", "TF32/cudnn",
           "profiles: ", "parallel=auto chose", "rank 0: share ", "rank 1: micro-batch ",
           "plan v0: planned: ", "plain DDP equal split")


def before_training(result, first_step: str) -> list[str]:
    """Every line a person reads before the first step's line: all the launcher's (stderr, written
    before any worker starts) and rank 0's up to `first_step`."""
    out = result.stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith(first_step))
    return result.stderr.splitlines() + out[:at]


def assert_compact_plan(lines: list[str], ranks: int) -> None:
    assert len(lines) <= MOST_LINES_BEFORE_TRAINING, "\n".join(lines)
    header = [i for i, line in enumerate(lines) if all(h in line for h in PLAN_HEADER) and "┃" in line]
    assert len(header) == 1, "\n".join(lines)                          # one table
    rows = lines[header[0] + 2:header[0] + 2 + ranks]
    assert [r.split("│")[0].strip() for r in rows] == [str(k) for k in range(ranks)], rows
    assert all("(emulated)" in r and " of " in r.split("│")[-1] for r in rows), rows   # memory of the card's
    assert len([line for line in lines if SUMMARY.match(line)]) == 1, "\n".join(lines)  # one summary line
    for reason in REASONS:
        assert not any(reason in line for line in lines), (reason, lines)


def test_demo_trains_and_reports(tmp_path):
    out = tmp_path / "demo.json"
    result = hetrain("demo", "--steps", "8", "--global-batch", "16", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan v0" in result.stdout and "summary" in result.stdout and "emulated" in result.stdout
    assert_compact_plan(before_training(result, "training step "), ranks=2)
    figures = json.loads(out.read_text())
    assert figures["steps"] == 8
    assert figures["last_loss"] < figures["first_loss"] - 0.5      # from ~5.5 (uniform over bytes)
    assert figures["val_loss"] < 5.0
    assert [r["peak_bytes"] > 0 for r in figures["ranks"]] == [True, True]
    # the demo's headline figures, by name
    assert 0 < figures["wall_s"] < 600 and figures["samples_per_s"] > 0 and figures["predicted_samples_per_s"] > 0
    assert figures["final_loss"] == figures["last_loss"] and figures["rebalances"] >= 0
    assert figures["host"]["cpu"] and "block_ms" in figures["host"]


TINY_SCRIPT = textwrap.dedent("""
    import os, torch, hetrain
    ht = hetrain.init(global_batch=8, max_steps=2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    model = torch.nn.Linear(3, 1)
    model, opt, batches = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(torch.nn.functional.mse_loss(model(mb.batch[0]), mb.batch[1]))
        ht.step()
        ht.print(f"first step done" if step.index == 0 else f"step {step.index + 1} done")
    ht.close()
    # One write per rank (a pipe keeps a write this small whole): print() writes its pieces
    # separately, and two ranks' pieces interleaved ("rankrank  10 launchlaunch ...").
    os.write(1, f"rank {os.environ['RANK']} launch {os.environ['HETRAIN_LAUNCH']}\\n".encode())
""")


def test_run_prints_a_compact_plan_and_verbose_every_reason_and_leaves_no_run_dir_unless_asked(tmp_path, temp):
    script = tmp_path / "train.py"
    script.write_text(TINY_SCRIPT)
    plain = hetrain("run", "--emulate", "a100-80g,rtx3090", str(script), env={"TMPDIR": str(temp)})
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert_compact_plan(before_training(plain, "first step done"), ranks=2)
    assert f"launch {temp}" in plain.stdout                 # the workers saw a run dir in TMPDIR ...
    assert not list(temp.glob("hetrain-*"))                 # ... and it went with the run
    # --verbose reaches the ranks through the launch file: every line of the compact plan, and the reasons
    kept = tmp_path / "run"
    verbose = hetrain("run", "--verbose", "--run-dir", str(kept), "--emulate", "a100-80g,rtx3090", str(script))
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert (kept / "launch.json").is_file()                 # a dir the user named stays
    lines = before_training(verbose, "first step done")
    for reason in REASONS:
        assert any(reason in line for line in lines), (reason, lines)
    assert len([line for line in lines if SUMMARY.match(line)]) == 1 and "layout: data parallel" in verbose.stdout
    assert len(lines) > MOST_LINES_BEFORE_TRAINING
