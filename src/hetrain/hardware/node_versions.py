"""Before a multi-node job trains: do torch, CUDA, NCCL and the driver match across the nodes?

NCCL refuses to connect (or hangs) between different NCCL versions (nccl#1267), and nodes on
different torch builds compute differently, so a mismatch is an error that names the odd node and
the install that fixes it. A driver difference alone is a warning: NCCL runs across drivers.

`versions_here` is one rank's versions, cheaply (no full machine query, no peer-copy child);
the lead gathers them (one all_gather_object) and `check_node_versions` compares them. A job of
several device islands (vendors: runtime/ranks/island_facts.py) compares them within each island
only: an NVIDIA island's CUDA torch and an AMD island's ROCm torch differ by nature, and only the
host-staged bridge (gloo) joins them. Pure but
for versions_here. With HETRAIN_MACHINE naming a recorded machine description, versions_here
reads that file instead: the recorded-machine boundary tests feed mismatches through.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Mapping, Sequence

from ..errors import UsageError
from .ranks import FIELDS, rank_versions

MACHINE_ENV = "HETRAIN_MACHINE"
ERROR_FIELDS = ("torch", "torch_cuda", "nccl")
LABELS = {"torch": "torch", "torch_cuda": "CUDA", "nccl": "NCCL", "driver": "driver"}
NONE_IS_A_VALUE = ("torch", "torch_cuda")   # a CPU torch build beside CUDA builds is a mismatch
NCCL_WHY = "NCCL cannot connect nodes with different versions (nccl#1267)"
TORCH_WHY = "ranks on different torch builds compute, and exchange state, differently"


def versions_here(environ: Mapping[str, str] | None = None) -> dict:
    """This rank's `ranks.rank_versions`-shaped dict: FIELDS, hostname, gpus."""
    environ = os.environ if environ is None else environ
    path = environ.get(MACHINE_ENV)
    if path:
        from . import driver

        try:
            return rank_versions(driver.load_machine(path))
        except UsageError as e:
            raise UsageError(f"{MACHINE_ENV}={path}: {e.what}", e.fix) from None
    from . import driver

    # torch's part of the full machine query (driver.py), so live and recorded versions are read
    # alike; not the rest of it (NVML's GPU table, the peer-copy child)
    facts: dict = {"versions": {k: None for k in FIELDS}, "torch": {}, "host": {"hostname": socket.gethostname()}}
    facts["gpus"] = driver.torch_part(facts)
    facts["versions"]["driver"] = _nvml_driver()
    return rank_versions(facts)


def _nvml_driver() -> str | None:
    """The NVIDIA driver version from NVML, None when NVML does not load (no driver, no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:     # noqa: BLE001 — ImportError, 'Driver Not Loaded', 'Library Not Found'
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:     # noqa: BLE001
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _known(field: str, values):
    """The values that take part in a comparison: None is 'unknown' except for torch and CUDA."""
    return [x for x in values if x is not None or field in NONE_IS_A_VALUE]


def _show(field: str, value) -> str:
    if value is None:
        return "none (CPU build)" if field == "torch_cuda" else "none"
    return str(value)


def _node(i: int, names: Sequence[str]) -> str:
    return f"node {i} '{names[i]}'"


def _nodes(ids: Sequence[int], names: Sequence[str]) -> str:
    return ("node " if len(ids) == 1 else "nodes ") + ", ".join(f"{i} '{names[i]}'" for i in ids)


def _odd_text(ids: Sequence[int], names: Sequence[str]) -> str:
    return f"{_nodes(ids, names)} {'is the odd one' if len(ids) == 1 else 'are the odd ones'}"


def _reference(field: str, per_node: dict[int, dict]):
    """The majority value of `field` across nodes; on a tie, node 0's (the first node's)."""
    first = next(iter(per_node))
    counts = Counter(_known(field, [v[field] for v in per_node.values()]))
    top = max(counts.values())
    tied = [x for x, c in counts.items() if c == top]
    return per_node[first][field] if per_node[first][field] in tied else tied[0]


def _within_nodes(per_rank, node_of, names) -> list[str]:
    """Ranks of one node come from one install: a difference there is its own mistake."""
    warnings = []
    for node in sorted(set(node_of)):
        ranks = [r for r, n in enumerate(node_of) if n == node]
        for field in ERROR_FIELDS + ("driver",):
            if len(set(_known(field, [per_rank[r].get(field) for r in ranks]))) > 1:
                side = ", ".join(f"rank {r} {_show(field, per_rank[r].get(field))}" for r in ranks)
                what = f"ranks on {_node(node, names)} run different {LABELS[field]}: {side}"
                if field == "driver":
                    warnings.append(what + " (containers with different drivers?)")
                    continue
                raise UsageError(what, "start every rank of a node from the same Python environment "
                                       "(one hetrain run per node starts them all)")
    return warnings


def check_node_versions(per_rank: list[dict], node_of: list[int], node_names: list[str],
                        island_of: list[str] | None = None) -> list[str]:
    """Compare every rank's `versions_here` across nodes (rank r runs on node node_of[r], named
    node_names[node_of[r]]). Raises UsageError, one line, when torch, CUDA or NCCL differ;
    returns warnings (one line each) for a driver difference, [] when everything matches.
    `island_of`: each rank's device island; versions are then compared within each island, and
    the error names it."""
    if len(per_rank) != len(node_of) or any(not 0 <= n < len(node_names) for n in node_of):
        raise ValueError(f"check_node_versions: {len(per_rank)} ranks, node_of {node_of!r}, "
                         f"{len(node_names)} node names do not fit together")
    if island_of is not None and len(island_of) != len(per_rank):
        raise ValueError(f"check_node_versions: {len(per_rank)} ranks but {len(island_of)} islands")
    if island_of is None or len(set(island_of)) < 2:
        return _check(per_rank, node_of, node_names)
    warnings = []
    for island in dict.fromkeys(island_of):
        ranks = [r for r, i in enumerate(island_of) if i == island]
        try:
            found = _check([per_rank[r] for r in ranks], [node_of[r] for r in ranks], node_names)
        except UsageError as e:
            raise UsageError(f"in device island {island!r} (ranks {','.join(map(str, ranks))}): {e.what}",
                             e.fix) from None
        warnings += [f"in device island {island!r}: {w}" for w in found]
    return warnings


def _check(per_rank: list[dict], node_of: list[int], node_names: list[str]) -> list[str]:
    """check_node_versions over one island's ranks (node indices still into node_names)."""
    warnings = _within_nodes(per_rank, node_of, node_names)
    per_node: dict[int, dict] = {}
    for r, n in enumerate(node_of):        # a node's value: its first rank's (known) value
        mine = per_node.setdefault(n, {k: per_rank[r].get(k) for k in ERROR_FIELDS + ("driver",)})
        for k, x in mine.items():
            if x is None and per_rank[r].get(k) is not None:
                mine[k] = per_rank[r][k]
    per_node = dict(sorted(per_node.items()))
    differ = [f for f in ERROR_FIELDS + ("driver",) if len(set(_known(f, [v[f] for v in per_node.values()]))) > 1]
    if not differ:
        return warnings
    ref = {f: _reference(f, per_node) for f in differ}

    def odd_in(fields):
        return [n for n, v in per_node.items()
                if any(_known(f, [v[f]]) and v[f] != ref[f] for f in fields)]

    side = "; ".join(f"{_node(n, node_names)} " + ", ".join(f"{LABELS[f]} {_show(f, v[f])}" for f in differ)
                     for n, v in per_node.items())
    errors = [f for f in differ if f in ERROR_FIELDS]
    if not errors:
        odd = odd_in(["driver"])
        fine = [n for n in per_node if n not in odd]
        return warnings + [f"the NVIDIA driver differs across nodes: {side} ({_odd_text(odd, node_names)}): "
                           f"NCCL runs across drivers, but a driver bug or speed difference "
                           f"may show on one node; install driver {ref['driver']} on {_nodes(odd, node_names)}"
                           + (f" (as on {_node(fine[0], node_names)})" if fine else "") + " to rule it out"]
    odd = odd_in(errors)
    fine = [n for n in per_node if n not in odd]
    want = {f: ref[f] if f in ref else per_node[fine[0] if fine else next(iter(per_node))][f] for f in ERROR_FIELDS}
    build = f"CUDA {want['torch_cuda']}" if want["torch_cuda"] else "CPU build"
    build += f", NCCL {want['nccl']}" if want["nccl"] else ""
    fix = (f"install torch {want['torch']} ({build}) on {_nodes(odd, node_names)}"
           + (f", as on {_node(fine[0], node_names)}" if fine else ", as on the other nodes"))
    if "nccl" in errors and "torch" not in errors and want["nccl"]:
        fix += (f"; with the same torch, NCCL comes from the nvidia-nccl-cu* package: "
                f"pip install nvidia-nccl-cu{str(want['torch_cuda'] or '12').split('.')[0]}=={want['nccl']}")
    labels = [LABELS[f] for f in errors]
    names = labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]
    raise UsageError(f"{names} differ{'s' if len(labels) == 1 else ''} across nodes: {side} "
                     f"({_odd_text(odd, node_names)}); {NCCL_WHY if 'nccl' in errors else TORCH_WHY}", fix)
