"""`hetrain bench` as a user meets it: one command measures each device alone, an equal split and
hetrain on the user's model (real jobs through hetrain's launcher), prints the table and writes
the JSON and the chart; bad input is one line with the fix before anything runs. No assertion on
which configuration is faster: the timings are this shared host's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import clirun
from clirun import hetrain, hetrain_here

FACTORY = Path(__file__).parent / "scripts" / "bench_factory.py"
SPEC = "a100-80g,rtx3090"


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    r = hetrain("bench", "--model-factory", f"{FACTORY}:make", "--emulate", SPEC, "--steps", "2", "--warmup", "1",
                "--global-batch", "15", "--rounds", "2", "--json", str(tmp / "bench.json"), "--png", str(tmp / "bench.png"),
                env={"HETRAIN_CACHE": str(tmp / "cache")})
    return r, tmp


def test_bench_runs_every_configuration_and_its_figures_agree(bench):
    r, tmp = bench
    assert r.returncode == 0, r.stderr[-3000:]
    for phase in ("[1/8] round 1/2: device 0 alone", "[2/8] round 1/2: device 1 alone",
                  "[3/8] round 1/2: hetrain: the planner's split", "[4/8] round 1/2: equal split",
                  "[5/8] round 2/2: equal split", "[6/8] round 2/2: hetrain: its plan from round 1",
                  "[7/8] round 2/2: device 1 alone", "[8/8] round 2/2: device 0 alone"):
        assert phase in r.stderr, r.stderr                      # progress: which phase, interleaved
    assert "step 3/3" in r.stderr                               # ...and which step (1 warm-up + 2 timed)
    data = json.loads((tmp / "bench.json").read_text())
    assert data["rounds"] == 2 and data["orders"] == [["alone0", "alone1", "hetrain", "equal"],
                                                      ["equal", "hetrain", "alone1", "alone0"]]
    for run in (*data["alone"], data["equal_split"], data["hetrain"]):    # the median of 2 rounds: their mean
        assert len(run["rounds"]) == 2 and run["samples_per_s"] == pytest.approx(sum(run["rounds"]) / 2)
    # the same rebalancing setting on both sides (off), and hetrain ran its round-1 plan again
    assert data["hetrain"]["rebalance"] is False and data["equal_split"]["rebalance"] is False
    assert data["hetrain"]["rebalances"] == 0
    for key in ("alone", "equal_split", "hetrain", "speedup_vs_equal", "efficiency", "host"):
        assert key in data, data
    assert data["devices"] == ["a100-80g#0 (emulated)", "rtx3090#1 (emulated)"] and data["emulated"] is True
    assert [a["device"] for a in data["alone"]] == data["devices"]
    for a in data["alone"]:
        assert a["samples_per_s"] > 0 and a["peak_memory_bytes"] > 0 and a["micro_batch"] >= 1
    equal, het = data["equal_split"], data["hetrain"]
    assert equal["shares"] == [8, 7] and "equal-split plan" in equal["how"]     # 15 split evenly
    assert sum(het["shares"]) == 15 and min(het["shares"]) >= 1
    for run in (equal, het):
        assert run["samples_per_s"] > 0 and len(run["peak_memory_bytes"]) == 2
        assert all(b > 0 for b in run["peak_memory_bytes"])
    assert data["speedup_vs_equal"] == pytest.approx(het["samples_per_s"] / equal["samples_per_s"])
    total = sum(a["samples_per_s"] for a in data["alone"])
    assert data["efficiency"] == pytest.approx(het["samples_per_s"] / total)
    assert data["sum_of_alone_samples_per_s"] == pytest.approx(total)
    fastest = max(a["samples_per_s"] for a in data["alone"])
    assert data["speedup_vs_fastest_alone"] == pytest.approx(het["samples_per_s"] / fastest)
    host = data["host"]
    assert host["cpu"] and host["cores"] >= 1 and host["torch"] and host["emulated"] is True
    assert (data["steps"], data["warmup"], data["global_batch"]) == (2, 1, 15)


def test_bench_prints_the_table_and_draws_the_chart(bench):
    r, tmp = bench
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    het = json.loads((tmp / "bench.json").read_text())["hetrain"]
    rows = {line.split("│")[0].strip(): [c.strip() for c in line.split("│")[1:]] for line in lines if "│" in line}
    assert list(rows) == ["a100-80g#0 (emulated) alone", "rtx3090#1 (emulated) alone", "equal split (shares 8/7)",
                          f"hetrain (shares {'/'.join(map(str, het['shares']))})", "ceiling: Σ alone"]
    assert float(rows[list(rows)[-2]][0]) == pytest.approx(het["samples_per_s"], abs=0.06)
    total = sum(a["samples_per_s"] for a in json.loads((tmp / "bench.json").read_text())["alone"])
    assert float(rows["ceiling: Σ alone"][0]) == pytest.approx(total, abs=0.06)   # the ceiling, printed
    assert any(line.startswith("rounds: 2, interleaved") for line in lines)
    assert all(len(cells) == 4 and "iB" in cells[3] for name, cells in rows.items()   # samples/s, ×2, memory
               if not name.startswith("ceiling"))
    assert any(line.startswith("efficiency: hetrain") for line in lines)
    assert any("1 untimed warm-up" in line for line in lines) and any("not torch DDP" in line for line in lines)
    png = (tmp / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def one_line_error(r, *words):
    clirun.one_line_error(r, *words)
    assert "[1/" not in r.stderr and "launching" not in r.stderr          # checked before any run


@pytest.mark.parametrize("args, words", [
    (("--model-factory", f"{FACTORY}:nomake"), ("has no function 'nomake'", "it defines make, not_a_factory",
                                                 f"{FACTORY}:make")),
    (("--model-factory", f"{FACTORY}:make", "--steps", "0"), ("--steps 0 must be at least 1",)),
    (("--model-factory", f"{FACTORY}:make", "--steps", "-3"), ("--steps -3 must be at least 1",)),
    (("--model-factory", f"{FACTORY}:make", "--rounds", "0"), ("--rounds 0 must be at least 1", "--rounds 3")),
    (("--model-factory", f"{FACTORY}:make", "--png", "{tmp}/missing/chart.png"), ("--png", "does not exist")),
    (("--model-factory", f"{FACTORY}:make", "--json", "{tmp}/missing/out.json"), ("--json", "does not exist")),
    (("--model-factory", f"{FACTORY}:make", "--global-batch", "1"), ("--global-batch 1 is smaller than the 2",)),
    (("--model-factory", f"{FACTORY}:make", "--emulate", "a100-80g"), ("nothing to split",)),
    (("--model-factory", f"{FACTORY}:make", "--emulate", "a100-80g,rtx-309"), ("rtx3090",)),
])
def test_bad_input_is_one_line_before_anything_runs(tmp_path, args, words):
    emulate = () if "--emulate" in args else ("--emulate", SPEC)
    one_line_error(hetrain_here("bench", *emulate, *(a.format(tmp=tmp_path) for a in args)), *words)


def test_no_gpu_and_no_emulate_says_how_to_emulate(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # as on a machine without a GPU
    one_line_error(hetrain_here("bench", "--model-factory", f"{FACTORY}:make"), "no GPU here and no --emulate",
                   "--emulate a100-80g,rtx3090")
