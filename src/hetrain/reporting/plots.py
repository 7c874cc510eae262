"""`hetrain report`'s pictures of a run (reporting/runlog.py's RunLog), as PNG files.

matplotlib is imported here only, when a report is drawn, and used through its object API on
the Agg canvas (no pyplot, no display, no global backend switch).

  timeline.png   per device: compute / gradient sync / wait seconds of every step, stacked
  shares.png     each device's share over the steps; a marker where the plan version changed
  loss.png       the global-batch loss over the steps
  memory.png     each device's peak memory per step against its cap (dashed)
  mfu.png        each device's MFU per step (what MFU means here is in the title)
"""

from __future__ import annotations

import math
import os

from .runlog import RunLog

NAMES = ("timeline.png", "shares.png", "loss.png", "memory.png", "mfu.png")
PARTS = (("compute_s", "compute", "#4C72B0"), ("sync_s", "gradient sync", "#DD8452"),
         ("wait_s", "wait (rest of the step)", "#B0B0B0"))
DPI = 100


def draw_all(log: RunLog, out_dir: str) -> list[str]:
    """Every picture, into out_dir; returns their paths."""
    drawers = (timeline, shares, loss, memory, mfu)
    paths = []
    for name, draw in zip(NAMES, drawers):
        fig = draw(log)
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=DPI)
        paths.append(path)
    return paths


def _figure(height: float = 4.8, rows: int = 1):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))    # steps are whole numbers
    return fig, axes


def _subtitle(log: RunLog) -> str:
    header = log.header()
    devices = log.devices()
    where = header.get("devices_note", "")      # what the devices' kind adds to titles (DeviceHooks.run_facts)
    return f"{len(log.steps)} steps, {len(devices)} device{'s' if len(devices) != 1 else ''}{where}"


def _colors(log: RunLog) -> dict[str, str]:
    palette = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
    return {name: palette[i % len(palette)] for i, name in enumerate(log.devices())}


def timeline(log: RunLog):
    devices = log.devices()
    fig, axes = _figure(height=max(3.2, 2.2 * len(devices) + 1), rows=len(devices))
    fig.suptitle(f"Time per step, by device: compute, gradient sync, wait — {_subtitle(log)}")
    for ax, device in zip(axes, devices):
        bottom, steps = None, None
        for key, label, color in PARTS:
            steps, values = log.series(device, key)
            ax.bar(steps, values, width=1.0, bottom=bottom, color=color, label=label, linewidth=0)
            bottom = values if bottom is None else [a + b for a, b in zip(bottom, values)]
        ax.set_title(device, loc="left", fontsize=10)
        ax.set_ylabel("seconds")
        top = _robust_top(bottom or [0])
        ax.set_ylim(0, top)
        for x, total in zip(steps or [], bottom or []):
            if total > top:        # cut off (a checkpoint save, the first step): say how tall
                ax.annotate(f"{total:.2f} s", xy=(x, top), xytext=(0, -10), textcoords="offset points",
                            ha="center", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=9, ncols=3)   # clear of the bars
    axes[-1].set_xlabel("optimizer step")
    return fig


def _robust_top(totals: list[float]) -> float:
    """The y axis's top: a slow first step or a checkpoint save must not flatten the rest."""
    ordered = sorted(totals)
    high = ordered[int(0.95 * (len(ordered) - 1))] if ordered else 1.0
    return max(high * 1.3, 1e-6) if ordered[-1] > 3 * high else max(ordered[-1] * 1.1, 1e-6)


def _version_changes(log: RunLog) -> list[tuple[int, str]]:
    """(first step on the new plan, 'v2 (rebalance)') wherever the plan version changed."""
    causes = {}
    for e in log.events:
        if e.get("event") == "rebalance":
            causes[e.get("step", -2) + 1] = "rebalance"      # it takes effect from the next step
        elif e.get("event") == "oom":
            causes.setdefault(e.get("step", -2), "OOM")
    out, previous = [], None
    for s in log.steps:
        v = s.get("plan_version")
        if previous is not None and v != previous:
            out.append((s["step"], f"v{v}" + (f" ({causes[s['step']]})" if s["step"] in causes else "")))
        previous = v
    return out


def _restarts(log: RunLog) -> list[tuple[int, str]]:
    return [(e.get("step", 0), f"restart {e.get('attempt', '?')}") for e in log.events if e.get("event") == "restart"]


def _mark(ax, marks: list[tuple[int, str]], *, style: str = "--", color: str = "#555555") -> None:
    for x, text in marks:
        ax.axvline(x - 0.5, linestyle=style, color=color, linewidth=1)
        ax.annotate(text, xy=(x - 0.5, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=9, color=color)


def shares(log: RunLog):
    fig, (ax,) = _figure()
    colors = _colors(log)
    for device in log.devices():
        ax.step(*log.series(device, "share"), where="mid", label=device, color=colors[device], linewidth=2)
    changes = _version_changes(log)
    _mark(ax, changes)
    _mark(ax, _restarts(log), style=":", color="#C44E52")
    if not changes and log.steps:      # say so, rather than leave the reader looking for markers
        ax.annotate(f"plan v{log.steps[0].get('plan_version', 0)} throughout (no rebalance, no OOM)",
                    xy=(0.01, 0.97), xycoords="axes fraction", va="top", fontsize=9, color="#555555")
    gb = log.header().get("global_batch")
    ax.set_title(f"Share of the global batch{f' ({gb} samples)' if gb else ''} per device, and plan versions — "
                 f"{_subtitle(log)}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("samples per step")
    ax.set_ylim(0, 1.2 * max(d["share"] for s in log.steps for d in s["devices"]))
    ax.legend(loc="lower right", fontsize=9)
    return fig


def loss(log: RunLog):
    fig, (ax,) = _figure()
    xs = [s["step"] for s in log.steps if s.get("loss") is not None]
    ys = [s["loss"] for s in log.steps if s.get("loss") is not None]
    ax.plot(xs, ys, color="#4C72B0", linewidth=1.5, label="global-batch loss (all devices)")
    for e in log.events:
        if e.get("event") == "skipped_step":
            ax.axvline(e.get("step", 0), color="#C44E52", alpha=0.4, linewidth=1)
    _mark(ax, _restarts(log), style=":", color="#C44E52")
    ax.set_title(f"Loss over the steps — {_subtitle(log)}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.legend(loc="upper right", fontsize=9)
    return fig


UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def _unit(top: float) -> tuple[float, str]:
    return next((scale, name) for scale, name in UNITS if top >= scale or scale == 1)


def _bytes(x: float) -> str:
    scale, name = _unit(x)
    return f"{x / scale:.3g} {name}"


def memory(log: RunLog):
    fig, (ax,) = _figure()
    colors = _colors(log)
    peaks = {d: log.series(d, "peak_bytes") for d in log.devices()}
    caps = {d: log.series(d, "memory_cap_bytes") for d in log.devices()}
    known = [v for _, ys in peaks.values() for v in ys]
    if not known:
        _note(ax, "memory not measured (a plain CPU): run on GPUs, or on the cards a cluster spec names (hetrain run --help)")
        ax.set_title(f"Peak memory per step, by device — {_subtitle(log)}")
        return fig
    from matplotlib.ticker import FixedLocator, FuncFormatter

    top = max(known + [v for _, ys in caps.values() for v in ys])
    log_scale = top > 20 * max(known)           # a cap far above the use: both visible on a log axis
    for device in log.devices():
        ax.plot(*peaks[device], color=colors[device], linewidth=2, label=f"{device}: peak {_bytes(max(peaks[device][1] or [0]))}")
        cx, cy = caps[device]
        if cy:
            ax.plot(cx, cy, color=colors[device], linestyle="--", linewidth=1.2, label=f"{device}: cap {_bytes(cy[-1])}")
    if log_scale:
        ax.set_yscale("log")
        low, high = min(known) / 2, top * 2
        octaves = range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)
        every = max(1, math.ceil(len(octaves) / 8))          # at most ~8 ticks, at powers of two
        ax.yaxis.set_major_locator(FixedLocator([2.0**e for e in octaves if e % every == 0]))
        ax.yaxis.set_minor_locator(FixedLocator([]))
        ax.set_ylim(low, high)
    else:
        ax.set_ylim(0, top * 1.1)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: _bytes(x) if x > 0 else "0"))
    ax.set_title(f"Peak memory per step against each device's cap (dashed) — {_subtitle(log)}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bytes (binary units" + (", log scale)" if log_scale else ")"))
    ax.legend(loc="center right", fontsize=9)
    return fig


def mfu(log: RunLog):
    fig, (ax,) = _figure()
    colors = _colors(log)
    header = log.header()
    drawn = False
    for device in log.devices():
        xs, ys = log.series(device, "mfu")
        if ys:
            ax.plot(xs, [100 * y for y in ys], color=colors[device], linewidth=1.5, label=device)
            drawn = True
    meaning = header.get("mfu_meaning") or "against each device's peak FLOP/s"
    flops = header.get("flops_per_sample")
    at = f", {flops:.3g} training FLOPs/sample" if flops else ""
    ax.set_title(f"MFU per device: model FLOP/s achieved / peak FLOP/s — {_subtitle(log)}{at}\n{meaning}",
                 fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MFU (% of peak)")
    if drawn:
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right", fontsize=9)
    else:
        _note(ax, "MFU not known: " + (header.get("flops_how") or "no FLOPs per sample or no peak FLOP/s")
              + " (a plain CPU or a GPU not in the catalog has no peak)")
    return fig


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10, wrap=True)
