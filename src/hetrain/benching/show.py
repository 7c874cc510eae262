"""What `hetrain bench` prints and draws: the table of configurations and the bar chart."""

from __future__ import annotations

from ..console import console
from ..hardware.units import format_bytes
from .runs import EQUAL_SPLIT_HOW, HETRAIN_HOW, BenchResult, busy_host


def rows(result: BenchResult) -> list[tuple[str, float, str]]:
    """(config, samples/s, peak memory) for each configuration, in the table's and chart's order."""
    out = [(f"{label} alone", r.samples_per_s, "cannot run it" if r.error else
            format_bytes(r.peak_memory_bytes[0]) if r.peak_memory_bytes[0] else "-")
           for label, r in zip(result.labels, result.alone)]
    for name, r in (("equal split", result.equal_split), ("hetrain", result.hetrain)):
        shares = "/".join(map(str, r.shares))
        memory = ", ".join(format_bytes(b) if b else "-" for b in r.peak_memory_bytes)
        out.append((f"{name} (shares {shares})", r.samples_per_s, memory))
    return out


def print_table(result: BenchResult) -> None:
    from rich.table import Table

    s = result.setup
    con = console()
    fastest = result.alone[result.fastest_alone].samples_per_s
    equal = result.equal_split.samples_per_s
    t = Table(title=f"hetrain bench: {s.factory} on {len(s.devices)} devices ({s.where}), global batch "
              f"{s.global_batch}, {s.steps} timed steps after {s.warmup} warm-up, precision {s.precision}",
              title_justify="left", show_edge=False, pad_edge=False)
    for c in ("config", "samples/s", "× fastest alone", "× equal split", "peak memory per device"):
        t.add_column(c, justify="right" if c.startswith(("samples", "×")) else "left")
    for name, sps, memory in rows(result):
        t.add_row(name, f"{sps:.1f}", f"{sps / fastest:.2f}", f"{sps / equal:.2f}", memory)
    ceiling = result.sum_alone       # no split of these devices can beat the sum of their standalone figures
    t.add_row("ceiling: Σ alone", f"{ceiling:.1f}", f"{ceiling / fastest:.2f}", f"{ceiling / equal:.2f}", "-")
    con.print(t)
    for label, r in zip(result.labels, result.alone):
        if r.error:
            con.print(f"{label} alone cannot run it: {r.error} (0 samples/s standalone)", markup=False)
    con.print(f"efficiency: hetrain {result.hetrain.samples_per_s:.1f} / Σ alone {result.sum_alone:.1f} samples/s "
              f"= {result.efficiency:.0%} (the sum of every device's standalone figure is the ideal)", markup=False)
    con.print(f"hetrain: {result.speedup_vs_equal:.2f}× the equal split, {result.speedup_vs_fastest:.2f}× "
              f"{result.labels[result.fastest_alone]} alone", markup=False)
    con.print(f"equal split: {EQUAL_SPLIT_HOW}; hetrain: {HETRAIN_HOW}", markup=False)
    if s.rounds > 1:
        spread = lambda r: f"{min(r.rounds or [r.samples_per_s]):.1f}-{max(r.rounds or [r.samples_per_s]):.1f}"  # noqa: E731
        con.print(f"rounds: {s.rounds}, interleaved (every other round in reverse order); each figure is the median "
                  f"of its rounds (hetrain {spread(result.hetrain)}, equal split {spread(result.equal_split)} "
                  "samples/s)", markup=False)
    else:
        con.print("rounds: 1 (no median: a drift of the host's speed during the bench falls on one configuration; "
                  "--rounds 3 interleaves them)", markup=False)
    con.print(f"timing: {s.steps} steps after {s.warmup} untimed warm-up step(s), between barriers on every rank; "
              "loss = the model output's mean (what hetrain's measurements use)", markup=False)
    con.print(f"host: {result.host.get('describe', result.host.get('cpu', '?'))}, {result.host.get('cores')} cores, "
              f"torch {result.host.get('torch')}{s.host_note}", markup=False)
    if (busy := busy_host(result.host)) is not None:
        con.print(f"warning: {busy}", style="yellow", markup=False)


def draw_png(result: BenchResult, path: str) -> None:
    """A bar per configuration, the sum of the standalone figures as a dashed line (the ideal)."""
    from matplotlib.figure import Figure      # the object API: no pyplot, no global backend (as reporting/plots.py)

    s = result.setup
    table = rows(result)
    names = [name.replace(" (", "\n(") for name, _, _ in table]
    values = [sps for _, sps, _ in table]
    colors = ["#9aa5b1"] * len(result.alone) + ["#e0a458", "#2a9d8f"]
    fig = Figure(figsize=(max(6.4, 1.6 * len(table) + 1.5), 4.8), dpi=110)
    ax = fig.subplots()
    bars = ax.bar(range(len(table)), values, color=colors, width=0.65)
    failed = [r.error is not None for r in result.alone] + [False, False]
    ax.bar_label(bars, labels=["cannot run it" if f else f"{v:.1f}" for v, f in zip(values, failed)], padding=3,
                 fontsize=9)
    ax.axhline(result.sum_alone, color="#264653", linestyle="--", linewidth=1.2,
               label=f"ideal: Σ alone = {result.sum_alone:.1f} samples/s (hetrain at {result.efficiency:.0%})")
    ax.set_xticks(range(len(table)), names, fontsize=9)
    ax.set_ylabel("samples/s (higher is better)")
    ax.set_ylim(0, max(max(values), result.sum_alone) * 1.22)
    ax.legend(loc="upper left", fontsize=9, frameon=False)
    devices = ", ".join(result.labels)
    title = f"hetrain bench: {s.factory.rsplit('/', 1)[-1]}, global batch {s.global_batch}\n{devices}"
    title += s.picture_note
    ax.set_title(title, fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, format="png")
