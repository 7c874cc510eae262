"""Output that goes to a file or pipe (a log, CI) stays readable: rich has no window there and
would wrap tables at 80 columns, splitting a device label and every row over several lines. The
commands run in this process with stdout captured (not a terminal) and $COLUMNS unset, as a shell
leaves it for `hetrain plan ... > plan.log`; each table is parsed and every row must be one line
holding all its cells."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest

from clirun import hetrain_here


def table_rows(out: str, header: tuple[str, ...]) -> list[list[str]]:
    """The rows of the table whose header line holds `header` (rich's '┃'-separated header), as
    cells: every line after the header rule that has the column separator '│', until one without."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if all(h in line for h in header) and "┃" in line)
    rows = []
    for line in lines[start + 2:]:           # the header, its rule, then the rows
        if set(line.strip()) <= set("├┼┤─"):       # a grid's line between rows (show_lines)
            continue
        if "│" not in line:
            break
        rows.append([c.strip() for c in line.strip().strip("│").split("│")])
    return rows


def assert_one_line_per_row(rows: list[list[str]], columns: int, first_cells: list[str]) -> None:
    assert [r[0] for r in rows] == first_cells, rows        # a wrapped row adds a line with a blank first cell
    for r in rows:
        assert len(r) == columns and all(r), r               # every cell on the row's one line


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path / "cache"))


def test_plan_rows_and_device_labels_stay_on_one_line_in_a_log():
    r = hetrain_here("plan", "--model", "gpt2-124m", "--emulate", "a100-80g,rtx3090,t4", "--global-batch", "64",
                     columns=None)
    assert r.returncode == 0, r.stderr
    rows = table_rows(r.stdout, ("rank", "device", "share", "micro-batch", "memory"))
    assert_one_line_per_row(rows, 8, ["0", "1", "2"])
    assert [row[1] for row in rows] == ["a100-80g#0", "rtx3090#1", "t4#2"]
    # the reasons are text lines: never wrapped, so each names its rank on its own line
    reasons = [line for line in r.stdout.splitlines() if line.startswith("  rank ")]
    assert reasons and all(": " in line for line in reasons)
    assert all(line.startswith("  ") or "┃" in line or "│" in line or "━" in line or line[:1].isalpha()
               for line in r.stdout.splitlines() if line)     # no continuation fragments of a wrapped line


def test_simulate_rows_stay_on_one_line_in_a_log():
    r = hetrain_here("simulate", "--cluster", "a100-80g,rtx3090,t4", "--model", "gpt2-124m", columns=None)
    assert r.returncode == 0, r.stderr
    strategies = table_rows(r.stdout, ("strategy", "samples/s", "memory per device"))
    assert_one_line_per_row(strategies, 5, ["fastest single device", "plain DDP equal split", "hetrain"])
    assert strategies[1][4].count("GiB/") == 3                # each device's memory on the one line
    devices = table_rows(r.stdout, ("device", "alone samples/s", "hetrain share"))
    assert [row[0] for row in devices] == ["a100-80g#0", "rtx3090#1", "t4#2"]


def test_doctor_device_rows_stay_on_one_line_in_a_log():
    r = hetrain_here("doctor", "--cluster", "a100-80g,rtx3090", columns=None)
    assert r.returncode in (0, 1), r.stderr
    devices = table_rows(r.stdout, ("device", "name", "memory", "catalog", "source"))
    assert_one_line_per_row(devices, 8, ["a100-80g#0", "rtx3090#1"])     # vendor and island columns too
    assert devices[1][1] == "NVIDIA GeForce RTX 3090"
    findings = table_rows(r.stdout, ("level", "check", "fix"))
    assert findings and all(row[0] and row[1] for row in findings if row[0])   # level and check side by side
    assert any(row[1] == "mixed-class" and row[0] == "warn" for row in findings)


def test_the_ranks_log_keeps_an_emulated_label_and_a_long_reason_on_one_line():
    from hetrain.runtime.ranks.log import RankLog

    # a reason as long as the precision table's (~230 characters): wider than the 200 columns
    why = "catalog GPU compute capability 8.0 >= 8.0: bf16 in hardware; " + "this CPU runs bf16 slowly, " * 7
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        RankLog(rank=0, world_size=2).table("plan", ("rank", "device", "share", "precision", "why"),
                                            [(0, "a100-80g#0 (emulated)", 38, "bf16 (computes fp32)", why),
                                             (1, "rtx3090#1 (emulated)", 26, "bf16 (computes fp32)", "fp32 asked for")])
    rows = table_rows(out.getvalue(), ("rank", "device", "share"))
    assert_one_line_per_row(rows, 5, ["0", "1"])
    assert rows[0][1] == "a100-80g#0 (emulated)" and rows[1][3] == "bf16 (computes fp32)"
    assert rows[0][4] == why.strip()


def test_the_ranks_log_prints_a_detail_only_with_the_details_on():
    from hetrain.runtime.ranks.log import RankLog

    said = {}
    for details in (False, True):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            log = RankLog(rank=0, world_size=2, details=details)
            log.info("plan v0: the table's line")
            log.detail("  rank 0: a reason")
            log.table("precision per device", ("rank", "why"), [(0, "asked for")], detail=True)
            log.table("plan v0", ("rank", "share"), [(0, 5)])
        said[details] = out.getvalue()
    assert "the table's line" in said[False] and "share" in said[False]
    assert "a reason" not in said[False] and "precision per device" not in said[False]
    assert "a reason" in said[True] and "precision per device" in said[True] and "share" in said[True]
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):          # not verbose (bench's workers): nothing, details or not
        RankLog(rank=0, world_size=2, verbose=False, details=True).detail("a reason")
    assert quiet.getvalue() == ""


def test_progress_off_a_terminal_is_plain_lines_not_bar_redraws():
    from hetrain.report import StepProgress

    ht = SimpleNamespace(is_main=True, config=SimpleNamespace(reporting=SimpleNamespace(verbose=True)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        with StepProgress(ht, 5, every_s=0.0) as bar:          # a line at every step
            for i in range(5):
                bar.update(SimpleNamespace(index=i, loss=2.0 - i / 10, samples_per_s=100.0 + i))
        with StepProgress(ht, 50, every_s=3600.0) as bar:       # only the last step's line
            for i in range(50):
                bar.update(SimpleNamespace(index=i, loss=1.0, samples_per_s=100.0))
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()   # no cursor control in a log
    assert lines[:5] == [f"training step {i + 1}/5  loss {2.0 - i / 10:.3f}  {100 + i} samples/s" for i in range(5)]
    assert lines[5:] == ["training step 50/50  loss 1.000  100 samples/s"]
