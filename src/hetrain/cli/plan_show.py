"""What `hetrain plan` prints besides the plan's JSON: the plan as a table with its reasons, and
the topology lines of `hetrain simulate` (every layout ranked: layouts_show.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from rich.table import Table

from ..console import console

from ..hardware.units import by_kind, format_bytes
from ..planning.plan import Plan


def show_plan(result: Plan, out: Optional[str], launch: Optional[str], cluster,
              launch_on: Optional[Callable[[str], str]] = None) -> None:
    """`launch`: the `hetrain run` options that give the plan's devices (None: none needed, this
    machine's GPUs); `launch_on(spec)`: those options for the devices a cluster spec names, for the
    devices a plan kept when it left some out of `cluster`."""
    con = console()
    t = Table(title=f"plan: global batch {result.global_batch} over {result.world_size} device(s)",
              title_justify="left", show_edge=False, pad_edge=False)
    for c in ("rank", "device", "share", "micro-batch", "precision", "checkpointing", "compute/step", "memory"):
        t.add_column(c, overflow="fold")
    groups = [(g[0], [d.rank for d in g]) for g in by_kind(          # same plan: one row
        result.devices, label=lambda d: d.device,
        same=lambda d: (d.share, d.micro_batch, d.n_micro, d.precision, d.checkpointing))]
    for d, ranks in groups:
        t.add_row(str(d.rank) if len(ranks) == 1 else f"{len(ranks)} ranks", d.device
                  + (f" and {len(ranks) - 1} like it" if len(ranks) > 1 else ""), str(d.share),
                  f"{d.micro_batch} x{d.n_micro}", d.precision, "on" if d.checkpointing else "off",
                  f"{(d.predicted_compute_s or 0) * 1e3:.1f} ms",
                  format_bytes(d.predicted_memory_bytes) if d.predicted_memory_bytes else "-")
    con.print(t)
    if len(groups) < len(result.devices):
        con.print(f"  {result.world_size} devices: one row per kind of device with the same plan "
                  "(every rank's: the plan file or --json)", markup=False)
    for d, ranks in groups:
        for r in d.reasons:
            con.print(f"  rank {d.rank}" + (f" (and {len(ranks) - 1} like it)" if len(ranks) > 1 else "") + f": {r}",
                      markup=False)
    for line in filter(None, result.note.split("; ")):
        con.print(f"  {line}", markup=False)
    for e in result.excluded:
        con.print(f"  left out {e.device}: {e.reason}; {e.fix}", markup=False)
    if result.excluded and cluster is not None and launch_on is not None:
        kept = [d for d in cluster if any(p.device.split(" ")[0] == d.label for p in result.devices)]
        spec = ",".join(f"{d.gpu.key}:{d.speed:g}@{d.memory_bytes}B" for d in kept)
        con.print(f"  launch it on the devices kept: hetrain run {launch_on(spec)} …", markup=False)
    if out:
        con.print(f"wrote {out}: run it with hetrain.init(global_batch={result.global_batch}, plan={out!r})"
                  + (f" under `hetrain run {launch} …`" if launch and not result.excluded else ""),
                  markup=False)


def topology_lines(topology, sim, grad_bytes: float) -> tuple[list[str], dict]:
    """What the link between nodes costs, and what fp16 gradient compression would gain (under
    hetrain's plan: planning/compression.py), as lines and as JSON."""
    from ..planning import compression

    ms = lambda s: f"{s * 1e3:.3g} ms"     # noqa: E731
    lines = [f"nodes: {topology.describe_nodes()}"]
    out = topology.to_dict()
    if topology.net is None:
        lines.append(f"gradient sync (one node, ring all-reduce of {format_bytes(grad_bytes)}): {ms(topology.sync_s)}")
        return lines, out
    lines.append(f"between nodes: {topology.net.bandwidth_gbs:.3g} GB/s ({topology.net.source})")
    lines.append(f"gradient sync (all-reduce of {format_bytes(grad_bytes)}: a ring in each node, then across nodes, "
                 f"then in each node): {ms(topology.sync_s)} per step; {ms(topology.joined_s)} with the nodes joined "
                 f"as fast as the slowest node's own link ({min(link.bandwidth_gbs for link in topology.node_links):.3g} "
                 f"GB/s): the link between nodes costs {ms(topology.net_cost_s)} of every step's sync")
    pred = sim.plan.predicted
    members = len(sim.plan.devices)
    if members > 1 and pred.get("step_s"):
        options = {o.name: o for o in compression.predict(
            grad_bytes=grad_bytes, ring=members, link=sim.link, step_s=pred["step_s"],
            exposed_s=pred.get("comm_exposed_s", 0.0))}
        none, fp16 = options["none"], options["fp16"]
        lines.append(f"fp16 gradient compression (torch's fp16_compress_hook: half the bytes) under hetrain: exposed "
                     f"sync {ms(none.sync_s)} -> {ms(fp16.sync_s)}, predicted {fp16.gain(none):+.0%} samples/s "
                     f"({sim.plan.global_batch / none.step_s:.1f} -> {sim.plan.global_batch / fp16.step_s:.1f})")
        out["fp16"] = {"exposed_sync_s": fp16.sync_s, "step_s": fp16.step_s, "gain": fp16.gain(none),
                       "uncompressed_exposed_sync_s": none.sync_s, "uncompressed_step_s": none.step_s}
    return lines, out
