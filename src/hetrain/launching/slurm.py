"""`hetrain run --slurm`: the multi-node rendezvous (node count, this node's rank, the endpoint,
the rendezvous id) read from the variables Slurm sets in a job step, each with where it came from.

One `hetrain run` per node (srun --ntasks-per-node=1): it starts one process per GPU itself, so
a step with more tasks per node would start several launchers per node, each with every GPU.

Where each value comes from (a step's own variables first: a step may use fewer nodes than the
job, and SLURM_NODEID counts within the step):
  nnodes     SLURM_STEP_NUM_NODES, else SLURM_NNODES, else SLURM_JOB_NUM_NODES
  node_rank  SLURM_NODEID
  rdzv_id    SLURM_JOB_ID (SLURM_JOBID): the same on every node of the job, and on its requeues
  endpoint   the first host of SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, else SLURM_NODELIST
             (expanded by `scontrol show hostnames` when scontrol is on PATH, else here), and
             the port HETRAIN_RDZV_PORT, else 29500 + SLURM_JOB_ID % 1000: two jobs sharing
             a first node do not collide unless their ids end in the same three digits.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..errors import UsageError

BASE_PORT = 29500
PORT_ENV = "HETRAIN_RDZV_PORT"
NOT_IN_A_JOB = "run inside an sbatch/srun job, or pass --nnodes/--node-rank/--rdzv-endpoint yourself"
ONE_TASK = "srun --ntasks-per-node=1 hetrain run --slurm ... (one launcher per node; it starts one process per GPU)"
_HOST = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True, kw_only=True)
class SlurmRendezvous:
    nnodes: int
    node_rank: int
    endpoint: str                         # "host:port"
    rdzv_id: str
    reasons: tuple[str, ...] = field(default=())   # one line per value: the SLURM_* variable it came from

    def __post_init__(self) -> None:
        if not (isinstance(self.nnodes, int) and self.nnodes >= 1):
            raise UsageError(f"SlurmRendezvous.nnodes {self.nnodes!r} is not a positive node count", NOT_IN_A_JOB)
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes):
            raise UsageError(f"SlurmRendezvous.node_rank {self.node_rank!r} is not in 0..{self.nnodes - 1}",
                             NOT_IN_A_JOB)
        host, _, port = self.endpoint.rpartition(":")
        if not (host and port.isdigit() and 0 < int(port) < 65536):
            raise UsageError(f"SlurmRendezvous.endpoint {self.endpoint!r} is not HOST:PORT", NOT_IN_A_JOB)
        if not self.rdzv_id:
            raise UsageError("SlurmRendezvous.rdzv_id is empty", NOT_IN_A_JOB)

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])

    def flags(self) -> tuple[str, ...]:
        """The equivalent explicit `hetrain run` flags."""
        return ("--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id)


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    return next(((n, environ[n]) for n in names if environ.get(n, "").strip()), None)


def _count(environ: Mapping[str, str], names: tuple[str, ...], *, minimum: int) -> tuple[str, int]:
    got = _first(environ, names)
    if got is None:
        raise UsageError(f"{' / '.join(names)} is not set: not inside a Slurm job", NOT_IN_A_JOB)
    name, text = got
    try:
        value = int(text.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise UsageError(f"{name}={text!r} is not a whole number of at least {minimum}", NOT_IN_A_JOB)
    return name, value


def _ranges(body: str, nodelist: str, var: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'], zero padding kept (the width of the range's start)."""
    out = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            raise UsageError(f"{var}={nodelist!r}: {part!r} in [{body}] is not a number or a range lo-hi",
                             f"give a Slurm host list such as gpu[01-04],cpu7; or {NOT_IN_A_JOB}")
        lo, hi = m[1], m[2] or m[1]
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    return items + [nodelist[start:]]


def hostnames(nodelist: str, var: str = "SLURM_JOB_NODELIST") -> Iterator[str]:
    """Slurm's host list expression expanded, in Slurm's order: 'gpu[01-02],cpu7' -> gpu01, gpu02,
    cpu7; 'a[1-2]b[3-4]' -> a1b3, a1b4, a2b3, a2b4. Raises UsageError naming `var` on junk."""
    bad = f"give a Slurm host list such as gpu[01-04],cpu7; or {NOT_IN_A_JOB}"
    if not nodelist.strip() or nodelist.count("[") != nodelist.count("]"):
        raise UsageError(f"{var}={nodelist!r} is not a Slurm host list", bad)
    for item in _split_top_level(nodelist.strip()):
        pieces = re.findall(r"\[([^\[\]]*)\]|([^\[\]]+)", item)
        if not item or "".join(f"[{b}]" if b else t for b, t in pieces) != item:
            raise UsageError(f"{var}={nodelist!r}: {item!r} is not a host name or prefix[ranges]", bad)
        choices = [_ranges(b, nodelist, var) if b else [t] for b, t in pieces]
        for parts in itertools.product(*choices):
            host = "".join(parts)
            if not _HOST.match(host):
                raise UsageError(f"{var}={nodelist!r}: {host!r} is not a host name", bad)
            yield host


def _scontrol_hostnames(environ: Mapping[str, str], nodelist: str) -> list[str] | None:
    """`scontrol show hostnames`, as Slurm itself expands the list; None without scontrol or when it fails."""
    exe = shutil.which("scontrol", path=environ.get("PATH"))
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = out.stdout.split()
    return hosts if out.returncode == 0 and hosts else None


def _tasks_per_node(environ: Mapping[str, str]) -> tuple[str, str, int] | None:
    """The most tasks on one node this step starts: SLURM_STEP_TASKS_PER_NODE ('2(x3),1'), else
    SLURM_NTASKS_PER_NODE."""
    got = _first(environ, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"))
    if got is None:
        return None
    counts = [int(n) for n in re.findall(r"(?:^|,)\s*(\d+)", got[1])]
    return (got[0], got[1], max(counts)) if counts else None


def from_slurm(environ: Mapping[str, str]) -> SlurmRendezvous:
    """The rendezvous for this node of a Slurm job step, from `environ` (os.environ in a job)."""
    job = _first(environ, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if job is None:
        raise UsageError("--slurm: SLURM_JOB_ID is not set: not inside a Slurm job", NOT_IN_A_JOB)
    job_var, job_id = job[0], job[1].strip()
    if not job_id.isdigit():
        raise UsageError(f"{job_var}={job[1]!r} is not a Slurm job id (a number)", NOT_IN_A_JOB)
    tasks = _tasks_per_node(environ)
    if tasks is not None and tasks[2] > 1:
        raise UsageError(f"{tasks[0]}={tasks[1]}: {tasks[2]} tasks per node would start {tasks[2]} "
                         "hetrain launchers on one node, each with every GPU", ONE_TASK)
    step = bool(environ.get("SLURM_STEP_NUM_NODES", "").strip())
    nn_var, nnodes = _count(environ, ("SLURM_STEP_NUM_NODES",) if step else ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
                            minimum=1)
    rank_var, node_rank = _count(environ, ("SLURM_NODEID",), minimum=0)
    if node_rank >= nnodes:
        raise UsageError(f"SLURM_NODEID={node_rank} is not below {nn_var}={nnodes}", NOT_IN_A_JOB)
    lists = ("SLURM_STEP_NODELIST",) if step else ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
    got = _first(environ, lists)
    if got is None:
        raise UsageError(f"{' / '.join(lists)} is not set: no host list for the rendezvous", NOT_IN_A_JOB)
    list_var, nodelist = got[0], got[1].strip()
    hosts = _scontrol_hostnames(environ, nodelist)
    how = "as `scontrol show hostnames` expands it"
    if hosts is None:
        hosts = list(hostnames(nodelist, list_var))
        how = "expanded by hetrain (" + ("scontrol failed" if shutil.which("scontrol", path=environ.get("PATH"))
                                         else "no scontrol on PATH") + ")"
    if len(hosts) != nnodes:
        raise UsageError(f"{list_var}={nodelist!r} lists {len(hosts)} host(s) but {nn_var}={nnodes}",
                         f"run hetrain run --slurm in one srun step over the job's nodes, or {NOT_IN_A_JOB}")
    port_text = environ.get(PORT_ENV, "").strip()
    if port_text:
        if not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise UsageError(f"{PORT_ENV}={port_text!r} is not a TCP port",
                             f"set {PORT_ENV} to a free port in 1024-65535 on the first node, or unset it")
        port, port_why = int(port_text), f"port {port_text} from {PORT_ENV}"
    else:
        port = BASE_PORT + int(job_id) % 1000
        port_why = f"port {BASE_PORT} + {job_var} % 1000 (set {PORT_ENV} to choose another)"
    endpoint = f"{hosts[0]}:{port}"
    return SlurmRendezvous(
        nnodes=nnodes, node_rank=node_rank, endpoint=endpoint, rdzv_id=job_id,
        reasons=(f"--nnodes {nnodes}: {nn_var}={environ[nn_var].strip()}",
                 f"--node-rank {node_rank}: {rank_var}={environ[rank_var].strip()}",
                 f"--rdzv-endpoint {endpoint}: the first host of {list_var}={nodelist}, {how}; {port_why}",
                 f"--rdzv-id {job_id}: {job_var} (the same on every node and on a requeue)"))
