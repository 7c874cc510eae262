"""Cluster specs: `a100-80g,rtx3090` or `a100-80g:1.0,rtx3090:0.67@1GiB`.

Grammar, one item per device, comma separated:  [COUNTx]NAME[:SPEED][@MEMORY]
  NAME    a catalog GPU ('a100-80g', '3090', 'NVIDIA GeForce RTX 3090')
  SPEED   relative training speed in (0.01, 100], overriding the catalog's speed index
  MEMORY  memory cap from 1KiB to 1PiB, e.g. 2GiB or 512MiB (default: the catalog card's memory)
  COUNTx  that many identical devices, e.g. 2xrtx3090 (at most 1024 devices in all)

Nodes and links (the multi-node form), items separated by `;`:
    NODE=DEVICES[/LINK]; NODE=DEVICES[/LINK]; ...; net=LINK
  e.g. node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE
  NODE    a node's name: a letter or digit, then letters, digits, '-', '_' or '.' (not 'net'); each once
  DEVICES that node's devices in the flat grammar above (comma separated)
  LINK    after DEVICES: the link joining the node's devices (default: from the catalog, as for a
          flat spec); after `net=`: the link between nodes (needed with two nodes or more). A name
          (nvlink, pcie3, pcie4, pcie5, 10GbE, 25GbE, 100GbE, ib-hdr, ...) or a number with a unit
          (12GB/s, 100Gb/s, 25Gbit): see links.py
A flat spec is one node (named 'node0') whose link comes from the catalog. Devices are numbered
in node order, and speeds are rescaled over the whole cluster, as for a flat spec.

Islands and their bridge (the island form, one machine; hardware/islands.py), items separated by `;`:
    ISLAND=DEVICES[/LINK]; ISLAND=DEVICES[/LINK]; ...; bridge=[host:]LINK
  e.g. nv=2xa100-80g/nvlink; amd=2xmi300x/xgmi; bridge=host:25GbE
  ISLAND  named as a node is (not 'net' or 'bridge'); its devices share one vendor and torch device
          type (NVIDIA, AMD, Intel Gaudi, Intel XPU, Huawei Ascend, the CPU) and so one collective
          library; every device gets `island=ISLAND`
  LINK    after DEVICES: the link inside the island (nvlink, xgmi, hccs, pcie4, ...); after
          `bridge=`: the link between islands, staged through host memory (`host:25GbE`; `host` alone
          is the cards' own PCIe). Needed with two islands or more; net= is the nodes form's.
A flat spec is one island, except that `cpu` items (`2xa100-80g,cpu`) are an island of their own
('cpu', beside one named after the cards' vendor, bridged by host memory); a flat spec or island
mixing two GPU vendors is an error that shows the island form.

Used by the planning commands (`hetrain simulate --cluster`, `hetrain doctor --cluster`) and by
`hetrain run` given a spec, which runs one CPU process per device at that device's speed and
memory. On a multi-node job each node's `hetrain run` names that node's devices: a flat spec, or
that node's one `NODE=DEVICES[/LINK]` item (NODE becomes the node's name unless --node-name is given).

Speeds are on the catalog's scale (A100-80GB SXM = 1.0), and one CPU thread plays an A100: an
RTX 3090 (0.67) computes at 0.67 of the thread's pace, alone or beside others. Only a cluster with
a device faster than 1.0 is rescaled, so that its fastest device runs at the thread's full pace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError
from . import catalog
from .devices import Device, from_cluster_device
from .links import LinkSpec, parse_link
from .units import format_bytes, parse_bytes

FORMS = ("NAME", "NAME:SPEED", "NAME@MEMORY", "NAME:SPEED@MEMORY", "COUNTxNAME")
EXAMPLE = "a100-80g,rtx3090  or  a100-80g:1.0,rtx3090:0.67@1GiB"
MAX_DEVICES = 1024              # per item and in all: a spec is expanded device by device
SPEEDS = (0.01, 100.0)          # a slower device would sleep ~forever per step; a faster one is a typo
MEMORY = (1024, 1024**5)        # 1 KiB (tests use caps of a few KiB) to 1 PiB
NODE_EXAMPLE = "node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE"
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")   # safe as a --node-name and in output
_ITEM = re.compile(r"^(?:(?P<count>\d+)[x*])?(?P<name>[^:@]+?)(?::(?P<speed>[^@]*))?(?:@(?P<mem>.*))?$")


@dataclass(frozen=True, kw_only=True)
class ClusterDevice:
    """One device of a cluster spec; `speed` is the fraction of one CPU thread's pace it runs at."""

    index: int
    gpu: catalog.GpuSpec
    speed: float
    speed_source: str          # 'catalog speed index 0.67' or 'given' (in the spec)
    memory_bytes: int
    memory_source: str         # 'catalog: 24 GiB card' or 'given cap'
    island: str = ""           # the device island it belongs to ('' : the job is one island)

    @property
    def label(self) -> str:
        return f"{self.gpu.key}#{self.index}"

    def to_device(self) -> Device:
        """This device as a `devices.Device` record (kind 'planned')."""
        return from_cluster_device(self)


def _bad(item: str, why: str) -> UsageError:
    return UsageError(
        f"bad device {item!r} in cluster spec: {why}" if item.strip() else why,
        f"write devices as {' | '.join(FORMS)}, comma separated, e.g. {EXAMPLE}",
    )


@dataclass(frozen=True, kw_only=True)
class Node:
    """One node of a cluster spec: its devices (indices into the spec's devices) and its link."""

    name: str
    devices: tuple[int, ...]
    part: str                    # its devices in the flat grammar, as its own node's spec
    link: LinkSpec | None        # None: from the catalog (planning/cost.py catalog_link)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Which node each device is on, each node's own link, and the link between nodes."""

    nodes: tuple[Node, ...]
    net: LinkSpec | None         # None: one node
    named: bool                  # the spec named its nodes (the node form)
    bridge: LinkSpec | None = None   # the host bridge joining device islands (None: one island)
    islands: tuple = ()          # hardware/islands.Island per island ((): one island, or a flat spec)

    def node_of(self, device: int) -> Node:
        return next(n for n in self.nodes if device in n.devices)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A parsed cluster spec: the devices (in node order) and where they are."""

    devices: tuple[ClusterDevice, ...]
    topology: Topology

    @property
    def flat(self) -> str:
        """Every node's devices in the flat grammar, in node order."""
        return ",".join(n.part for n in self.topology.nodes)


def _bad_node(item: str, why: str) -> UsageError:
    return UsageError(f"bad node {item!r} in cluster spec: {why}",
                      "write nodes as NODE=DEVICES[/LINK] items and the link between them as net=LINK, "
                      f"separated by ';', e.g. {NODE_EXAMPLE}")


def device_items(spec: str) -> tuple[str, ...]:
    """The spec's items, one per device with its count expanded ('2xrtx3090@1GiB' gives
    'rtx3090@1GiB' twice): a node's part of a multi-node job's spec, joined with the other
    nodes' parts (runtime/ranks/nodes.py). The spec is checked first."""
    flat = parse_cluster_spec(spec).flat
    out: list[str] = []
    for item in (part.strip() for part in flat.split(",")):
        m = _ITEM.match(item)
        body = item[len(m["count"]) + 1:] if m["count"] else item
        out.extend([body] * int(m["count"] or 1))
    return tuple(out)


def parse_cluster(spec: str) -> tuple[ClusterDevice, ...]:
    """The devices of a cluster spec (either form), in node order; every problem is a UsageError
    naming the bad item and the forms."""
    return parse_cluster_spec(spec).devices


def parse_cluster_spec(spec: str) -> ClusterSpec:
    """A cluster spec's devices and topology (the grammar: this module's docstring)."""
    if not spec or not spec.strip():
        raise _bad(spec, "the cluster spec is empty")
    from . import islands

    if "=" not in spec and ";" not in spec:
        raw = _devices(spec, 0)
        names, bridge = islands.flat_islands(tuple(g for g, _, _ in raw), spec)
        devices = _build(raw, names)
        node = Node(name="node0", devices=tuple(range(len(devices))), part=spec.strip(), link=None)
        return ClusterSpec(devices=devices, topology=Topology(nodes=(node,), net=None, named=False, bridge=bridge))
    if islands.is_island_spec(spec):
        devices, found, bridge, flat = islands.parse_islands(spec, _devices, _build)
        if len(found) > 1 and bridge is None:
            raise islands.no_bridge(spec, {i.name: i.devices for i in found})
        node = Node(name="node0", devices=tuple(range(len(devices))), part=flat, link=None)
        return ClusterSpec(devices=devices, topology=Topology(nodes=(node,), net=None, named=False,
                                                              bridge=bridge, islands=found))
    raw: list[tuple[catalog.GpuSpec, float | None, int | None]] = []
    nodes: list[Node] = []
    net: str | None = None
    for item in (part.strip() for part in spec.split(";")):
        if not item:
            continue                                # a trailing ';' is harmless
        name, eq, body = (p.strip() for p in item.partition("="))
        if not eq:
            raise _bad_node(item, "an item without NODE= (in the node form every item is NODE=DEVICES or net=LINK)")
        if name.lower() == "net":
            if net is not None:
                raise _bad_node(item, "net= is given twice")
            net = body
            continue
        if not _NODE_NAME.match(name):
            raise _bad_node(item, f"the node name {name!r} is not a letter or digit followed by letters, "
                            "digits, '-', '_' or '.'")
        if any(n.name.lower() == name.lower() for n in nodes):
            raise _bad_node(item, f"the node {name!r} is named twice")
        part, slash, link = (p.strip() for p in body.partition("/"))
        if not part:
            raise _bad_node(item, "the node names no devices")
        node_raw = _devices(part, len(raw))
        link_spec = (parse_link(link, where=f"of node {name!r}", gpus=tuple(g for g, _, _ in node_raw))
                     if slash else None)
        nodes.append(Node(name=name, devices=tuple(range(len(raw), len(raw) + len(node_raw))), part=part,
                          link=link_spec))
        raw.extend(node_raw)
    if not nodes:
        raise _bad_node(spec.strip(), "no node is named")
    net_link = parse_link(net, where="between nodes (net=)") if net is not None else None
    if len(nodes) > 1 and net_link is None:
        if len({islands.default_name(raw[d][0]) for n in nodes for d in n.devices}) > 1:
            # two vendors' devices and no link: the island form (with its bridge) was meant
            raise islands.no_bridge(spec, {n.name: n.devices for n in nodes})
        raise _bad_node(spec.strip(), f"{len(nodes)} nodes but no net=LINK between them")
    # nodes of different vendors are islands by vendor, and the network between nodes their bridge
    names = [islands.default_name(g) for g, _, _ in raw]
    mixed = len(set(names)) > 1
    bridge = (net_link or islands.host_bridge("host", tuple(g for g, _, _ in raw))) if mixed else None
    return ClusterSpec(devices=_build(raw, names if mixed else None),
                       topology=Topology(nodes=tuple(nodes), net=net_link, named=True, bridge=bridge))


def _devices(spec: str, before: int) -> list[tuple[catalog.GpuSpec, float | None, int | None]]:
    """The devices of a flat spec, expanded; `before`: devices already named (for the cap in all)."""
    raw: list[tuple[catalog.GpuSpec, float | None, int | None]] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise _bad(spec, "an empty item (two commas in a row, or a trailing comma)")
        m = _ITEM.match(item)
        if not m:
            raise _bad(item, "not of the accepted forms")
        try:
            gpu = catalog.resolve(m["name"].strip())
        except UsageError as e:
            raise _bad(item, e.what) from None
        speed = None
        if m["speed"] is not None:
            try:
                speed = float(m["speed"])
            except ValueError:
                raise _bad(item, f"speed {m['speed']!r} is not a number") from None
            if not SPEEDS[0] < speed <= SPEEDS[1]:     # also NaN and inf
                raise _bad(item, f"speed {m['speed']!r} must be a positive number in ({SPEEDS[0]:g}, {SPEEDS[1]:g}]")
        memory = None
        if m["mem"] is not None:
            try:
                memory = parse_bytes(m["mem"], what="memory")
            except UsageError as e:
                raise _bad(item, e.what) from None
            if not MEMORY[0] <= memory <= MEMORY[1]:
                raise _bad(item, f"memory {m['mem']!r} must be from 1KiB to 1PiB")
        # Checked before expanding (and before int() of a thousand digits): 1000000000xa100 is a typo.
        digits = (m["count"] or "1").lstrip("0") or "0"
        count = int(digits) if len(digits) <= len(str(MAX_DEVICES)) else MAX_DEVICES + 1
        if not 1 <= count <= MAX_DEVICES:
            raise _bad(item, f"the count must be from 1 to {MAX_DEVICES}")
        if before + len(raw) + count > MAX_DEVICES:
            raise _bad(item, f"a cluster spec names at most {MAX_DEVICES} devices in all")
        raw.extend([(gpu, speed, memory)] * count)
    return raw


def _build(raw: list[tuple[catalog.GpuSpec, float | None, int | None]],
           islands: list[str] | None = None) -> tuple[ClusterDevice, ...]:
    speeds = [s if s is not None else gpu.speed_index for gpu, s, _ in raw]
    scale = max(1.0, max(speeds))
    return tuple(
        ClusterDevice(
            index=i, gpu=gpu, speed=speeds[i] / scale,
            speed_source=("given" if s is not None else f"catalog speed index {gpu.speed_index:g}"),
            memory_bytes=mem if mem is not None else gpu.memory_bytes,
            memory_source=("given cap" if mem is not None
                           else f"catalog: {format_bytes(gpu.memory_bytes)} card"),
            island=islands[i] if islands else "",
        )
        for i, (gpu, s, mem) in enumerate(raw)
    )
