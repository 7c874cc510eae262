"""What the accuracy benchmarks share about the host: the CPU the whole host and our own children
have used (so a run can say how much other work shared it), and a cluster spec slowed D times."""

from __future__ import annotations

import os
import resource


def host_busy_s() -> float:
    """CPU seconds the whole host has been busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def dilate(spec: str, factor: float) -> str:
    """'a100-80g:1.0,t4:0.35@24MiB' with every speed divided by `factor`."""
    out = []
    for item in spec.split(","):
        name, rest = item.split(":", 1)
        speed, _, mem = rest.partition("@")
        out.append(f"{name}:{float(speed) / factor:.4g}" + (f"@{mem}" if mem else ""))
    return ",".join(out)
