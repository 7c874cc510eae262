"""Every layout ranked (planning/ranking.py) as `hetrain simulate` and `hetrain plan` print it:
one table (samples/s, memory per device against what it has, communication per step), the
winner and why (planning/chooser.py: what parallel='auto' would run), how to run it, what the
rule left out, and when nothing fits, what would."""

from __future__ import annotations

from rich.table import Table

from ..console import console

from ..hardware.units import format_bytes
from ..planning.ranking import LayoutRanking, seconds

WIDE = 6        # devices beyond this: memory as the fullest device, not one column each


def _memory_cells(row, ranking: LayoutRanking) -> list[str]:
    cells = []
    savers = row.savers or ("",) * len(row.memory)
    for used, cap, saver in zip(row.memory, ranking.capacity, savers):
        cells.append("-" if used is None else format_bytes(used) + (f"/{format_bytes(cap)}" if cap else "")
                     + (f" ({saver})" if saver else ""))
    return cells


def _fullest(row, ranking: LayoutRanking) -> str:
    known = [(u / c if c else 0.0, u, d) for u, c, d in zip(row.memory, ranking.capacity, ranking.devices)
             if u is not None]
    if not known:
        return "-"
    frac, used, dev = max(known)
    return f"{format_bytes(used)} on {dev}" + (f" ({frac:.0%} of usable)" if frac else "")


def show_ranking(ranking: LayoutRanking, *, title: str) -> None:
    con = console()
    wide = len(ranking.devices) > WIDE
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for c in ("#", "layout", "samples/s", "vs DP", "comm/step"):
        t.add_column(c, overflow="fold")
    if wide:
        t.add_column("fullest device", overflow="fold")
    else:
        for d, cap in zip(ranking.devices, ranking.capacity):
            t.add_column(f"{d.split(' ')[0]} memory", overflow="fold")
    dp = next((r for r in ranking.rows if r.family == "DP" and r.fits), None)
    for i, r in enumerate(ranking.rows, 1):
        comm = f"{format_bytes(r.comm_bytes)}, {seconds(r.comm_s)}" if r.fits else "-"
        vs = f"×{r.samples_per_s / dp.samples_per_s:.2f}" if dp and r.fits else "-"
        mem = [_fullest(r, ranking)] if wide else _memory_cells(r, ranking)
        t.add_row(str(i) if r.fits else "-", r.name, f"{r.samples_per_s:.1f}" if r.fits else "does not fit", vs,
                  comm, *mem)
    con.print(t)
    con.print("memory: peak per device (model state + activations) / usable (its memory less the margin)"
              + ("; (ckpt k/N: activation checkpointing of k of the N blocks; optim on host: optimizer state "
                 "offloaded to host memory)" if any(any(r.savers) for r in ranking.rows) else "")
              + "; comm/step: bytes each device moves, and the seconds the step waits for them", markup=False)
    if ranking.best is not None:
        con.print(f"best layout: {ranking.why}", markup=False)
        con.print(f"  run it: {ranking.best.run}", markup=False)
    for line in (*ranking.left_out, *filter(None, [ranking.not_offered])):    # the chooser's rule left these out
        con.print(f"  {line}", markup=False)
    for r in ranking.rows:
        con.print(f"  {r.name}: {r.detail}", markup=False)
    if ranking.best is None and any(r.fits for r in ranking.rows):
        con.print(f"no layout parallel='auto' may run: {ranking.why}", markup=False)
    elif ranking.best is None:
        con.print("no layout fits memory. What would make one fit:", markup=False)
        for line in ranking.to_fit:
            con.print(f"  • {line}", markup=False)
