"""scripts/gpu_check.sh keeps working without a GPU: --dry runs the same script on the CPU, every
CUDA step skipped with its reason, the CPU steps (versions, two gloo ranks with one throttled, a
two-rank job against one process, the GPU tests' collection) run, every log and summary.json are
written, and the verdict table ends the output. Without CUDA and without --dry it says so and
runs the dry mode. The steps' limits on the GPU machine fit its 9-minute budget."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
CPU_STEPS = {"versions", "gloo-shares", "cpu-gpu", "gpu-tests"}
CUDA_STEPS = {"nccl", "launch", "timing-dp", "timing-pipeline", "memory", "scaler", "offload", "oom", "hf-trainer"}
ROW = {"step", "status", "seconds", "limit_s", "figure", "reason", "log", "details"}


def run(*args: str, env: dict | None = None, timeout: float = 1500.0):
    """The script under bash with this interpreter; (process, CPU seconds of everything it ran)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_the_dry_run_writes_every_log_summary_and_verdict(tmp_path):
    out = tmp_path / "out"
    proc, cpu_s = run("--dry", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "summary.json" in files, files
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry" and summary["budget_s"] > 0 and summary["total_s"] > 0
    steps = {r["step"]: r for r in summary["steps"]}
    assert set(steps) == CPU_STEPS | CUDA_STEPS
    for row in steps.values():
        assert set(row) == ROW and row["log"] in files and 0 <= row["seconds"] <= row["limit_s"] + 10, row
    for name in CUDA_STEPS:
        assert steps[name]["status"] == "skip", steps[name]
        assert re.fullmatch(r"--dry: needs CUDA \(.+\)", steps[name]["reason"]), steps[name]["reason"]
    for name in CPU_STEPS:
        assert steps[name]["status"] == "pass", steps[name]
    assert summary["counts"] == {"pass": len(CPU_STEPS), "fail": 0, "skip": len(CUDA_STEPS)}
    assert sorted(summary["files"]) == files
    # the two-rank steps measured something real: shares moved to the unthrottled rank, and the
    # two ranks' float64 parameters equal one process's
    assert re.search(r"shares 16/16 -> (\d+)/(\d+)", steps["gloo-shares"]["figure"])
    assert "max |diff|" in steps["cpu-gpu"]["figure"]
    # the output: the budget first, one line per step, the verdict table last
    lines = proc.stdout.splitlines()
    assert any(re.match(r"budget: versions \d+ s \+ .* = \d+ s of \d+ s", ln) for ln in lines), lines[:5]
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("step ") and "key figure" in ln)):]
    assert [ln.split()[0] for ln in table[1:1 + len(steps)]] == [r["step"] for r in summary["steps"]]
    assert lines[-1].startswith("GPU CHECK PASSED (dry)")
    assert cpu_s < 120, f"the dry run took {cpu_s:.0f} s of CPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the machine without CUDA")
def test_without_cuda_it_says_so_and_runs_the_dry_mode(tmp_path):
    proc, _ = run(str(tmp_path / "out"), env={"GPU_CHECK_ONLY": "nccl,oom"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == ("gpu_check: no CUDA device here (torch.cuda.is_available() is False): "
                                           "running the dry mode instead")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mode"] == "dry" and "no CUDA device" in summary["note"]
    assert [(r["step"], r["status"]) for r in summary["steps"]] == [("nccl", "skip"), ("oom", "skip")]


def test_bad_usage_is_one_line_and_exit_2(tmp_path):
    for args, env, says in (((), {}, "no output folder given"),
                            (("--fast", str(tmp_path)), {}, "unknown option --fast"),
                            ((str(tmp_path),), {"GPU_CHECK_ONLY": "nope"}, "GPU_CHECK_ONLY=nope names no step")):
        proc, _ = run(*args, env=env)
        assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_gpu_limits_fit_the_nine_minute_budget():
    text = SCRIPT.read_text()
    rows = re.findall(r'^\s+"([a-z-]+) ([a-z]+) (\d+) (\d+) ([a-z]+\.log)"$', text, re.M)
    assert {r[0] for r in rows} == CPU_STEPS | CUDA_STEPS
    assert sum(int(r[2]) for r in rows) <= 540 and "BUDGET=540" in text
    assert len({r[4] for r in rows}) + 1 <= 8          # the logs and summary.json
    for _, module, *_ in rows:
        assert (REPO / "scripts" / "gpu_checks" / f"{module}.py").is_file()


def test_the_verdict_names_a_killed_step_a_crashed_one_and_one_the_budget_left_out(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_common", REPO / "scripts" / "gpu_checks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    rows = [("nccl", "facts.log", 25, 31.0, 124), ("memory", "memory.log", 40, 3.0, 1),
            ("scaler", "memory.log", 30, 2.0, 139), ("gpu-tests", "pytest.log", 95, 0, -1)]
    (tmp_path / "steps.tsv").write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    (tmp_path / "scaler.json").write_text(json.dumps({"status": "pass", "figure": "scale 2 -> 1", "reason": "",
                                                      "details": {}}))
    rc = common.verdict(["--scratch", str(tmp_path), "--out", str(tmp_path), "--mode", "gpu", "--budget", "540",
                         "--started", "0"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    got = {r["step"]: (r["status"], r["reason"]) for r in summary["steps"]}
    assert rc == 1 and summary["counts"] == {"pass": 0, "fail": 3, "skip": 1}
    assert got["nccl"] == ("fail", "over its 25 s limit (killed); see facts.log")
    assert got["memory"] == ("fail", "exit 1 without a result; see memory.log")
    assert got["scaler"] == ("fail", "exit 139 after its result; see memory.log")
    assert got["gpu-tests"] == ("skip", "not run: the 9-minute budget was spent; see pytest.log")
    assert "GPU CHECK FAILED (gpu): 0 passed, 3 failed, 1 skipped" in capsys.readouterr().out
