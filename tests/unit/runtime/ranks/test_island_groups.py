"""The islands' groups (runtime/ranks/islands.py), and a guard: device tensors stay off the bridge
unless staged through host memory.

The bridge between device islands is gloo on host memory (runtime/ranks/islands.py): a device
tensor handed to it fails on a real GPU (gloo cannot read HPU/NPU/XPU memory, and a CUDA one would
bypass the pinned copy), and passes every CPU test. So `bridge_all_reduce` is the one place that
hands a bridge group to a collective; it stages a device tensor through a host copy. Any other call
that passes a group named for the bridge is flagged here. The bridge groups themselves are made
over gloo, whatever the islands' native backends."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[4] / "src" / "hetrain"
STAGING = ("runtime/ranks/islands.py", "bridge_all_reduce")
COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "all_gather_single", "reduce_scatter_single", "batch_isend_irecv", "P2POp"}


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join(reversed([*parts, node.id]))
    return None


def _collective(call: ast.Call) -> bool:
    name = _dotted(call.func) or ""
    head, _, last = name.rpartition(".")
    return last in COLLECTIVES and head in ("", "dist", "torch.distributed")


def _functions(tree):
    """(function name, node) for every call, the innermost function that holds it."""
    out = []

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call):
                out.append((inner, child))
            visit(child, inner)
    visit(tree, None)
    return out


def findings(src: Path = SRC) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        module = path.relative_to(src).as_posix()
        for fn, call in _functions(ast.parse(path.read_text())):
            if not _collective(call):
                continue
            args = [*call.args, *(k.value for k in call.keywords)]
            if any("bridge" in ast.unparse(a).lower() for a in args) and (module, fn) != STAGING:
                found.append(f"{module}:{call.lineno} {fn}: {ast.unparse(call)}")
    return found


def test_only_the_staging_function_hands_the_bridge_to_a_collective():
    found = findings()
    assert not found, ("a collective on the bridge outside islands.bridge_all_reduce (which stages device "
                       "tensors through host memory); call it instead:\n" + "\n".join(found))


def test_the_staging_function_exists_and_calls_a_collective_on_a_host_tensor():
    module, name = STAGING
    tree = ast.parse((SRC / module).read_text())
    fn = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name)
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and _collective(c)]
    assert {ast.unparse(c) for c in calls} == {"dist.all_reduce(host, group=groups.bridge)"}


def test_the_bridge_groups_are_gloo_whatever_the_islands_backends(monkeypatch):
    import torch.distributed as dist

    from hetrain.runtime.ranks import islands as isl

    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, **_: made.append((tuple(ranks), backend)) or object())
    layout = isl.Islands(island_of=("nv", "nv", "amd", "amd"), backends={"nv": "nccl", "amd": "nccl"})
    groups = isl.make_groups(layout, rank=1)
    assert made == [((0, 1), "nccl"), ((2, 3), "nccl"), ((0, 2), "gloo"), ((1, 3), "gloo")]
    assert groups.native_ranks == (0, 1) and groups.bridge_ranks == (1, 3) and groups.index == 1
    made.clear()
    on_host = isl.Islands(island_of=layout.island_of, backends={"nv": "gloo", "amd": "gloo"})
    isl.make_groups(on_host, rank=1)                     # host tensors: every group gloo
    assert {b for _, b in made} == {"gloo"}
    uneven = isl.Islands(island_of=("nv", "nv", "amd"), backends={"nv": "nccl", "amd": "nccl"})
    made.clear()
    assert isl.make_groups(uneven, rank=1).bridge is None     # not a leader: never crosses
    assert made[-1] == ((0, 2), "gloo") and len(made) == 3


def test_the_guard_flags_a_bridge_collective_outside_the_staging_function(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import torch.distributed as dist\n\n"
        "def shortcut(grad, groups):\n    dist.all_reduce(grad, group=groups.bridge)\n\n"
        "def fine(grad, groups):\n    dist.all_reduce(grad, group=groups.native)\n")
    assert [f.split(" ", 1)[1].split(":")[0] for f in findings(tmp_path)] == ["shortcut"]


def test_dp_x_pp_across_islands_keeps_each_stage_s_replicas_on_one_island(monkeypatch):
    import pytest
    import torch.distributed as dist

    from hetrain.errors import UsageError
    from hetrain.runtime.ranks import islands as isl

    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, **_: made.append((tuple(ranks), backend)) or object())
    grid = [[0, 1], [2, 3]]        # replica r, stage s: rank 2r + s
    apart = isl.Islands(island_of=("nv", "amd", "nv", "amd"), backends={"nv": "nccl", "amd": "hccl"})
    isl.pipeline_groups(apart, grid, rank=0, timeout=None)
    # pipelines cross the islands over gloo; each stage's replicas sum on their island's backend
    assert made == [((0, 1), "gloo"), ((2, 3), "gloo"), ((0, 2), "nccl"), ((1, 3), "hccl")]
    together = isl.Islands(island_of=("nv", "nv", "amd", "amd"), backends={"nv": "nccl", "amd": "hccl"})
    with pytest.raises(UsageError, match="stage 0's replicas .ranks 0, 2. are on islands amd, nv"):
        isl.pipeline_groups(together, grid, rank=0, timeout=None)


def test_a_job_of_one_island_makes_no_groups_and_asks_no_rank(monkeypatch):
    """Today's path untouched: the islands are those every rank gathered at start (nodes.join_nodes),
    read without a second gather, whether the devices are real or a cluster spec's."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from hetrain.hardware.cluster import parse_cluster_spec
    from hetrain.runtime.ranks import islands as isl
    from hetrain.runtime.ranks.island_facts import job_islands, rank_device

    asked = []
    monkeypatch.setattr(dist, "all_gather_object", lambda table, mine: asked.append(mine))
    flat = parse_cluster_spec("3xa100-80g")       # a flat spec names no island: one island
    found = job_islands([rank_device(spec_device=d) for d in flat.devices], held=["gloo"] * 3)
    assert isl.for_job(SimpleNamespace(world_size=3, nodes=SimpleNamespace(islands=found))) is None
    assert isl.for_job(SimpleNamespace(world_size=3, nodes=None)) is None and asked == []
    # Real devices: the islands found at start, on their own libraries.
    one = job_islands([{"vendor": "nvidia", "device_type": "cuda", "backend": "nccl"}] * 3)
    assert isl.for_job(SimpleNamespace(world_size=3, nodes=SimpleNamespace(islands=one))) is None
    two = job_islands([{"vendor": v, "device_type": "cuda", "backend": "nccl"} for v in ("nvidia", "amd", "amd")],
                      bridge="host 25GbE", bridge_gbs=2.8, held=["nccl"] * 3)
    real = isl.for_job(SimpleNamespace(world_size=3, nodes=SimpleNamespace(islands=two)))
    assert real.island_of == ("nvidia", "amd", "amd") and real.leaders == (0, 1) and asked == []
    assert real.backends == {"nvidia": "nccl", "amd": "nccl"} and real.link is None
    # An island spec's devices holding host tensors: the spec's islands, every group on gloo, and the
    # spec's links with what carries a collective over them.
    spec = parse_cluster_spec("nv=2xa100-80g/12GB/s; amd=mi300x; bridge=host:25GbE")
    link = object()
    held = [rank_device("cpu")["backend"]] * 3
    islands = job_islands([rank_device(spec_device=d) for d in spec.devices], bridge="host 25GbE",
                          bridge_gbs=spec.topology.bridge.bandwidth_gbs, links_gbs={"nv": 12.0}, held=held)
    assert [(i.backend, i.group_backend) for i in islands.islands] == [("nccl", "gloo"), ("nccl", "gloo")]
    from dataclasses import replace
    layout = isl.for_job(SimpleNamespace(world_size=3, nodes=SimpleNamespace(islands=replace(islands, link=link))))
    assert asked == [] and layout.island_of == ("nv", "nv", "amd") and layout.leaders == (0, 2) and not layout.sharded
    assert layout.backends == {"nv": "gloo", "amd": "gloo"} and layout.links_gbs == {"nv": 12.0}
    assert layout.bridge_gbs == spec.topology.bridge.bandwidth_gbs and layout.link is link


def test_the_emulated_links_come_from_the_spec_s_bridge_and_each_island_s_own_link():
    from dataclasses import replace

    from hetrain.hardware.cluster import ClusterSpec, Node, Topology, parse_cluster
    from hetrain.hardware.links import parse_link
    from hetrain.runtime.ranks.islands import spec_links

    devices = parse_cluster("4xa100-80g")
    devices = tuple(replace(d, island="nv" if d.index < 2 else "amd") for d in devices)
    nodes = (Node(name="nv", devices=(0, 1), part="2xa100-80g", link=parse_link("12GB/s", where="test")),
             Node(name="amd", devices=(2, 3), part="2xa100-80g", link=None))
    cluster = ClusterSpec(devices=devices, topology=Topology(nodes=nodes, net=None, named=True,
                                                            bridge=parse_link("25GbE", where="test")))
    bridge, links = spec_links(cluster)
    assert links == {"nv": 12.0}                  # amd names no link of its own: not slowed
    assert bridge == parse_link("25GbE", where="test").bandwidth_gbs and 2 < bridge < 4
    assert spec_links(replace(cluster, topology=replace(cluster.topology, bridge=None)))[0] is None
