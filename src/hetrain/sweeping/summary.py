"""What `hetrain sweep` prints and writes: trials per device, busy time and utilisation, the best trial."""

from __future__ import annotations

from ..console import console
from ..hardware.units import format_bytes
from .runner import SweepResult
from .study import pruner_text


def utilisation(result: SweepResult, index: int) -> float:
    """A device's busy time (its trials' wall time in its worker) ÷ this run's wall time."""
    return result.tally[index].busy_s / result.wall_s if result.wall_s > 0 else 0.0


def print_table(result: SweepResult) -> None:
    from rich.table import Table

    s = result.setup
    con = console()
    trials = f"{s.trials} trials" if s.trials is not None else f"trials for {s.timeout:g} s"
    t = Table(title=f"hetrain sweep: {s.objective}, study {s.study!r} in {s.storage}, {trials}, "
              f"{s.direction}, pruner {pruner_text(s)}", title_justify="left", show_edge=False, pad_edge=False)
    died = bool(result.deaths)
    columns = ["device", "memory", "complete", "pruned", "failed", "busy s", "utilisation", "largest trial"]
    for c in columns + (["worker died"] if died else []):
        t.add_column(c, justify="left" if c == "device" else "right")
    for slot in s.slots:
        tally = result.tally[slot.index]
        row = [slot.label, format_bytes(slot.memory_bytes), str(tally.complete), str(tally.pruned),
               str(tally.failed), f"{tally.busy_s:.1f}", f"{utilisation(result, slot.index):.0%}",
               format_bytes(tally.largest_bytes) if tally.largest_bytes else "-"]
        if died:
            row.append(f"{tally.deaths}" + (" (left out)" if tally.retired else ""))
        t.add_row(*row)
    for label, tally in result.groups.items():       # group trials: one row per group that ran one
        members = [slot for slot in s.slots if slot.label in label.split(" + ")]
        row = [f"group {label}", format_bytes(sum(m.memory_bytes for m in members)), str(tally.complete),
               str(tally.pruned), str(tally.failed), f"{tally.busy_s:.1f}",
               f"{tally.busy_s / result.wall_s:.0%}" if result.wall_s > 0 else "0%",
               format_bytes(tally.largest_bytes) if tally.largest_bytes else "-"]
        t.add_row(*row, *([""] if died else []))
    con.print(t)
    for d in result.deaths:
        con.print(f"the worker of {d['device']} died (exit code {d['exit_code']})"
                  + (f" during trial {d['trial']}, which failed" if d["trial"] is not None else " between trials")
                  + ("; a new one took over" if d["restarted"] else "; the device was left out"), markup=False)
    ran = len(result.ran)
    states = {k: sum(t["state"] == k for t in result.ran) for k in ("complete", "pruned", "failed")}
    con.print(f"this run: {ran} trial(s) in {result.wall_s:.1f} s ({states['complete']} complete, "
              f"{states['pruned']} pruned, {states['failed']} failed: all count toward --trials)" + (
        f", after {result.finished_before} finished earlier in the study" if result.finished_before else "")
        + (f"; {len(result.resumed)} interrupted trial(s) resumed" if result.resumed else "")
        + "; utilisation = a device's busy time ÷ this run's wall time (a group's trials count on its row, "
        "their time on each member's too)", markup=False)
    if result.best is not None:
        b = result.best
        con.print(f"best: trial {b['number']}, value {b['value']:.6g}, on {b['device']}, params {b['params']}",
                  markup=False)
    else:
        con.print("best: none yet (no trial has completed)", markup=False)


def to_dict(result: SweepResult) -> dict:
    s = result.setup
    return {
        "objective": s.objective, "storage": s.storage, "study": s.study, "trials": s.trials,
        "direction": s.direction, "pruner": pruner_text(s), "wall_s": result.wall_s,
        "finished_before": result.finished_before, "resumed": result.resumed, "worker_deaths": result.deaths,
        "devices": [{"device": slot.label, "memory_bytes": slot.memory_bytes, "speed": slot.speed,
                     "complete": result.tally[slot.index].complete, "pruned": result.tally[slot.index].pruned,
                     "failed": result.tally[slot.index].failed, "busy_s": result.tally[slot.index].busy_s,
                     "utilisation": utilisation(result, slot.index), "worker_deaths": result.tally[slot.index].deaths,
                     "left_out": result.tally[slot.index].retired} for slot in s.slots],
        "groups": [{"group": label, "complete": g.complete, "pruned": g.pruned, "failed": g.failed,
                    "busy_s": g.busy_s, "largest_bytes": g.largest_bytes} for label, g in result.groups.items()],
        "trials_run": result.ran, "best": result.best,
    }
