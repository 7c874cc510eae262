"""`hetrain simulate` on a cluster of device islands: the three ways to train them side by side
(planning/islands.py), the one-line verdict, the CPU's line, the bridge warning, and the ratio to
the same count of the fastest island's cards (the published comparison: a mixed cluster against
an all-NVIDIA one)."""

from __future__ import annotations

from ..errors import UsageError
from ..planning.bridge_cost import islands_of, to_link
from ..planning.collectives import Link


def has_islands(cluster) -> bool:
    return len({d.island for d in cluster.devices}) > 1


def _island_links(cluster) -> dict[str, Link]:
    """An island's link as the spec named it: the node (if any) holding exactly its devices."""
    members: dict[str, set[int]] = {}
    for i, d in enumerate(cluster.devices):
        members.setdefault(d.island, set()).add(i)
    out = {}
    for node in cluster.topology.nodes:
        for name, devs in members.items():
            if node.link is not None and set(node.devices) == devs:
                out[name] = to_link(node.link)
    return out


def _bridge(cluster) -> Link:
    if cluster.topology.bridge is None:
        raise UsageError("a cluster of several device islands names no bridge between them",
                         "add bridge=LINK, e.g. 'nv=2xa100-80g/nvlink; amd=2xmi300x/xgmi; bridge=host:25GbE'")
    return to_link(cluster.topology.bridge)


def bridged_link(cluster, grad_bytes: float) -> Link:
    """The one ring link over every device as slow as the hierarchical all-reduce across the
    islands (staging and bridge included): what the DP table and the layout ranking plan with."""
    from ..planning.bridge_cost import hierarchical_allreduce
    from ..planning.collectives import link_from_measurement

    bridge = _bridge(cluster)
    islands = islands_of(cluster.devices, _island_links(cluster))
    seconds = hierarchical_allreduce(islands, grad_bytes, bridge).total_s
    return link_from_measurement(len(cluster.devices), grad_bytes, seconds,
                                 f"hierarchical across {len(islands)} device islands over the bridge ({bridge.source})")


def island_report(cluster, profiles, spec, options, *, precision: str = "bf16") -> tuple[list[str], dict]:
    """Lines to print and the JSON of the comparison, for a cluster spec with islands."""
    from ..planning.cost import ELEMENT_BYTES
    from ..planning.islands import compare, homogeneous
    from ..planning.memory import state_bytes

    bridge = _bridge(cluster)
    islands = islands_of(cluster.devices, _island_links(cluster))
    per_param = state_bytes(1, optimizer="adamw").optimizer
    kw = dict(bridge=bridge, blocks=spec.blocks, trainable=spec.trainable, element_bytes=ELEMENT_BYTES[precision],
              state_bytes_per_param=per_param)
    c = compare(islands, profiles, options, **kw)
    lines = [f"device islands: {', '.join(f'{i.name} ({i.size} {i.vendor})' for i in islands)}; bridge "
             f"{bridge.bandwidth_gbs:.3g} GB/s ({bridge.source})"]
    lines += [f"{o.name}: " + (f"{o.samples_per_s:.1f} samples/s; {o.detail}" if o.fits else o.detail)
              for o in c.options]
    lines.append(c.verdict)
    out = c.to_dict()
    gpus = [i for i in islands if not i.is_cpu]
    if c.best is not None and gpus:
        fastest = max(gpus, key=lambda i: sum(1 / profiles[j].per_sample_s for j in i.devices) / i.size)
        same, same_profiles = homogeneous(islands, profiles, fastest)
        ref = compare(same, same_profiles, options, **kw)
        if ref.best is not None:
            ratio = c.best.samples_per_s / ref.best.samples_per_s
            lines.append(f"against the same {len(profiles)} devices all like {fastest.name}'s "
                         f"({profiles[fastest.devices[0]].gpu}, joined natively, nothing staged): "
                         f"{ref.best.samples_per_s:.1f} samples/s ({ref.best.name}); this cluster reaches {ratio:.0%}")
            out["homogeneous"] = {"like": fastest.name, "samples_per_s": ref.best.samples_per_s,
                                  "layout": ref.best.name, "ratio": ratio}
    if c.cpu_line:
        lines.append(c.cpu_line)
    if c.warning:
        lines.append(c.warning)
    return lines, out
