"""`hetrain run`: the torchrun command and environment for a job, built from what is here.

Process launching is torchrun's (torch.distributed.run): we choose its arguments, the process
count (one per emulated device, else one per visible GPU, else one) and the environment, and say
why for each. The job's settings reach the workers in one launch file (HETRAIN_LAUNCH), not in a
spray of environment variables.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import HetrainError, Preempted, UsageError, say
from .hardware.cluster import parse_cluster
from .hardware.doctor import launch_env_fixes
from .launching.agent import restarts_only_when_they_can_help
from .launching.nodes import Rendezvous, check_reachable
from .runtime.config import LAUNCH_ENV, METRICS_SUBDIR
from .runtime.config_groups import Checkpoints
from .runtime.resilience.lock import CHECKPOINT_LOCK

HOST_LINGER_S = 3.0     # after a multi-node job: the rendezvous host stays while the others close it
# Checkpoints.preempt_grace_s's default, plus a minute to write the final checkpoint
PREEMPT_SHUTDOWN_S = int(Checkpoints().preempt_grace_s) + 60


@dataclass(frozen=True, kw_only=True)
class Launch:
    argv: tuple[str, ...]
    env: dict[str, str]                          # only what we set on top of the caller's env
    reasons: tuple[str, ...] = field(default=())  # one line per choice, for people
    nproc: int = 1
    temporary_dir: bool = False                  # the run dir is ours to remove after the run
    hosts_rendezvous: bool = False               # this node hosts a multi-node job's rendezvous store
    lock: object = field(default=None, repr=False, compare=False)   # the run dir's (lock.DirLock), until run_launch ends
    shutdown_s: int = PREEMPT_SHUTDOWN_S         # after SIGTERM, the wait for the workers before SIGKILL

    def describe(self) -> str:
        lines = [f"launching {self.nproc} process(es) with torchrun:", "  " + " ".join(self.argv)]
        lines += [f"  {r}" for r in self.reasons]
        return "\n".join(lines)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_launch(*, target: str, target_args: tuple[str, ...] = (), module: bool = False,
                 emulate: str | None = None, nproc: int | None = None, max_restarts: int = 0,
                 config: dict | None = None, run_dir: str | None = None, rdzv: Rendezvous | None = None,
                 node_name: str | None = None, swap: bool = False) -> Launch:
    """The torchrun argv and environment for running `target` (a script path, or a module).
    `swap`: zero-change mode (integrations/swap.py). `config`: what the command line sets, as Config's keywords with a dict per group (e.g.
    {"checkpoints": {"dir": D}}); `emulate` joins it as {"emulation": {"cluster": ...}}. `rdzv`: this
    node's part of a multi-node job (launching/nodes.py), None for one node."""
    if not module and not Path(target).is_file():
        hint = "check the path" + (f" (relative to {os.getcwd()})" if not os.path.isabs(target) else "")
        raise UsageError(f"script {target!r} does not exist", hint + ", or pass -m for a module")
    if module:
        _check_module(target)
    if max_restarts < 0:
        raise UsageError(f"--max-restarts {max_restarts} is negative", "use 0 or more")
    # Every input is checked before any work (the host measurement below, the run dir, a launch).
    if emulate is not None and ("=" in emulate or ";" in emulate):
        from .hardware.islands import is_island_spec

        if not is_island_spec(emulate):
            emulate, node_name = _one_node(emulate, node_name)
        elif rdzv is not None:
            raise UsageError(f"--emulate {emulate!r} names device islands, which are on one machine, on a "
                             "multi-node launch", "give each node its own devices (flat, or its NODE=DEVICES "
                             "item), or run the islands on one machine without --nnodes")
    cluster = parse_cluster(emulate) if emulate is not None else None     # '' is a bad spec, not none
    gpus = _cuda_count() if cluster is None else 0
    _check_nproc(nproc, len(cluster) if cluster is not None else None, gpus)
    if run_dir is not None:
        _check_run_dir(run_dir)
    if rdzv is not None and max_restarts and not ((config or {}).get("checkpoints") or {}).get("dir"):
        raise UsageError("--max-restarts across nodes resumes from a checkpoint that every node must read",
                         "pass --checkpoint-dir DIR on a filesystem every node mounts (the same DIR on every node)")
    reasons: list[str] = []
    if rdzv is not None:
        reasons.append(rdzv.describe())
        reasons.append(check_reachable(rdzv))      # node rank 0: the port is free here; others: it answers
    env: dict[str, str] = {}
    if cluster is not None:
        count = len(cluster)
        reasons.append("processes: one per emulated device" + (" of this node" if rdzv else "") + ": "
                       + ", ".join(f"{d.label} speed {d.speed:.2f}" for d in cluster))
        from .hardware.cluster import parse_cluster_spec
        from .hardware.islands import describe_islands

        islands = describe_islands(parse_cluster_spec(emulate))
        if islands:
            reasons.append(islands + " (every group gloo under emulation)")
        env["OMP_NUM_THREADS"] = "1"
        reasons.append("OMP_NUM_THREADS=1: an emulated device is one CPU thread, throttled to its speed")
        # Measured here, once per host (then cached), before any worker computes: how fast this
        # CPU runs bf16/fp16 decides what the emulated devices compute in (planning/precision.py).
        from .hardware.host import host_facts

        host = host_facts()
        reasons.append(f"host CPU: {host.describe()}: {host.precision_meaning()}")
        if host.note:
            reasons.append(host.note)
    else:
        count = gpus or 1
        if not gpus and nproc is None:     # a Gaudi or Ascend machine whose torch lacks the plugin
            from .hardware.islands import check_real_devices

            check_real_devices()
        if gpus:
            reasons.append(f"processes: one per visible GPU ({gpus})")
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            reasons.append("CUDA_DEVICE_ORDER=PCI_BUS_ID: GPU indices match nvidia-smi")
            # What `hetrain doctor` recommends for these GPUs (e.g. NCCL_P2P_DISABLE=1 when peer
            # copies are broken), the same on every rank since all inherit this environment.
            fixes = launch_env_fixes({**os.environ, **env})
            if rdzv is not None:     # the inter-node link: which interface and transport NCCL uses
                from .hardware.network import link_facts_here, nccl_link_fixes

                fixes += nccl_link_fixes(link_facts_here(), endpoint_host=rdzv.host, environ={**os.environ, **env})
            for fix in fixes:
                if fix.var not in env:
                    env[fix.var] = fix.value
                    reasons.append(fix.reason)
            if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
                env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
                reasons.append("TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a hung or failed collective ends the job "
                               "after the timeout (then --max-restarts) instead of hanging silently")
        else:
            reasons.append("processes: 1 (no GPU and no --emulate; try --emulate a100-80g,rtx3090)")
    if nproc is not None:
        count = nproc
    if rdzv is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        reasons.append("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the rendezvous store shared, a node that joins a "
                       "later round waits forever for an address node 0 writes only in the first round (torch 2.13 "
                       "dynamic_rendezvous); the workers make their own store instead")
    temporary_dir = run_dir is None
    run_dir = run_dir or tempfile.mkdtemp(prefix="hetrain-")
    os.makedirs(run_dir, exist_ok=True)
    lock = _lock_run_dir(run_dir)      # before launch.json: a second job on this run dir changes nothing
    defaults: dict = {}
    if max_restarts:
        defaults["checkpoints"] = {"dir": os.path.join(run_dir, "checkpoints")}
        reasons.append(f"--max-restarts={max_restarts}: a crashed or hung worker restarts the job from its last "
                       f"checkpoint (in {defaults['checkpoints']['dir']} unless the script sets "
                       "Checkpoints(dir=...))")
    launch_file = os.path.join(run_dir, "launch.json")
    node = {"name": node_name or socket.gethostname()}
    if rdzv is not None:
        reasons.append(f"node name {node['name']!r}" + ("" if node_name else " (the host name; --node-name sets it)"))
    with open(launch_file, "w") as f:
        config = dict(config or {})
        config["emulation"] = {"cluster": emulate, **(config.get("emulation") or {})}
        json.dump({"config": config, "defaults": defaults, "run_dir": run_dir,
                   "node": node}, f, indent=2)
    env[LAUNCH_ENV] = launch_file
    if swap:       # the stock Trainer / TRL / Accelerate classes replaced by hetrain's in each worker
        env["PYTHONPATH"] = _swap_path(run_dir)
        reasons.append("zero-change mode: the workers import hetrain's Trainer, TRL trainers and Accelerator in place "
                       "of the stock classes (--no-swap: the stock ones)")

    # After SIGTERM torchrun waits this long for the workers before SIGKILL: the workers' grace to
    # reach the step boundary (runtime/resilience/preempt.py), then time to write the checkpoint.
    shutdown_s = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or PREEMPT_SHUTDOWN_S)
    where = ["--standalone"] if rdzv is None else rdzv.torchrun_args()
    argv = [sys.executable, "-m", "torch.distributed.run", *where,
            f"--nproc-per-node={count}", f"--max-restarts={max_restarts}"]
    if torchrun_takes_shutdown_timeout():
        argv.append(f"--shutdown-timeout={shutdown_s}")
    else:       # torch 2.11's torchrun: hetrain's agent (launching/agent.py) gives its stops this wait
        reasons.append(f"this torch's torchrun has no --shutdown-timeout (torch 2.12+): hetrain's agent waits "
                       f"{shutdown_s} s for the workers after SIGTERM")
    argv += (["-m", target] if module else [target]) + list(target_args)
    return Launch(argv=tuple(argv), env=env, reasons=tuple(reasons), nproc=count, temporary_dir=temporary_dir,
                  lock=lock, hosts_rendezvous=rdzv is not None and rdzv.hosts_store, shutdown_s=shutdown_s)


def torchrun_takes_shutdown_timeout() -> bool:
    """Whether the installed torchrun has --shutdown-timeout (torch 2.12 on; 2.11's refuses it as an
    unrecognized argument), asked of its own argument parser."""
    from torch.distributed.run import get_args_parser

    known, _ = get_args_parser().parse_known_args(["--shutdown-timeout=1", "script.py"])
    return getattr(known, "shutdown_timeout", None) == 1


def _swap_path(run_dir: str) -> str:
    """The workers' PYTHONPATH with a folder holding hetrain's sitecustomize.py first (integrations/swap.py)."""
    from .integrations.swap import SITE, SITE_NAME

    folder = os.path.join(run_dir, "swap")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, SITE_NAME), "w") as f:
        f.write(SITE)
    return os.pathsep.join([folder] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _one_node(emulate: str, node_name: str | None) -> tuple[str, str | None]:
    """A node's `NODE=DEVICES[/LINK]` part (hardware/cluster.py) as this node's flat --emulate, and
    NODE as its name unless --node-name gives one. The workers see only the flat devices."""
    from .hardware.cluster import parse_cluster_spec

    topology = parse_cluster_spec(emulate).topology
    nodes = topology.nodes
    if len(nodes) != 1:
        raise UsageError(f"--emulate {emulate!r} names {len(nodes)} nodes ({', '.join(n.name for n in nodes)})",
                         "on each node, give that node's own part, e.g. --emulate node1=4xrtx3090/pcie4 "
                         "(`hetrain simulate --cluster` takes the whole cluster)")
    if topology.net is not None:
        raise UsageError(f"--emulate {emulate!r} gives net=, the link between nodes",
                         "drop net= here: the emulated link between nodes is --emulate-link-gbs GB/s")
    return nodes[0].part, node_name or nodes[0].name


def _lock_run_dir(run_dir: str):
    """The run dir's lock, held by this (launcher) process for the launch's life; the kernel frees
    it if the process dies. A run dir in use by another job is a one-line UsageError."""
    from .runtime.resilience.lock import RUN_LOCK, try_lock

    try:
        lock, held_by = try_lock(run_dir, RUN_LOCK)
    except OSError as e:
        raise UsageError(f"run dir {run_dir!r} is not writable: {e.strerror or e}",
                         "pass a --run-dir you can write to") from None
    if held_by is not None:
        raise UsageError(f"run dir {run_dir!r} is in use by another hetrain job: {held_by}",
                         "wait for that job to finish, or give this one another --run-dir")
    return lock


def _check_module(name: str) -> None:
    """`-m NAME` must be importable as the workers' `python -m` will import it (from the cwd too)."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):      # a missing parent package; '' or a relative name
        found = False
    finally:
        sys.path.remove(os.getcwd())
    if not found:
        raise UsageError(f"module {name!r} cannot be found", "check the module name and PYTHONPATH, or drop -m "
                         "to run a script path")


def _check_nproc(nproc: int | None, emulated: int | None, gpus: int) -> None:
    if nproc is None:
        return
    if nproc < 1:
        raise UsageError(f"--nproc {nproc} must be at least 1", "give a positive process count")
    if emulated is not None and nproc != emulated:
        raise UsageError(f"--nproc {nproc} but --emulate names {emulated} devices",
                         "drop --nproc: with --emulate there is one process per device")
    if gpus and nproc > gpus:          # one process per GPU at most (none: CPU processes, any number)
        raise UsageError(f"--nproc {nproc} but {gpus} GPU(s) are visible",
                         f"give --nproc {gpus} or less (or drop it: one process per GPU)")


def _check_run_dir(run_dir: str) -> None:
    """--run-dir must be (or become) a directory we can write, said before anything is launched."""
    path = Path(run_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise UsageError(f"--run-dir {run_dir!r}: {str(existing)!r} is not a directory", "give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--run-dir {run_dir!r}: {str(existing)!r} is not writable", "give a directory you can write")


def run_launch(launch: Launch) -> int:
    """Run torchrun's own launcher in this process, so a failed worker becomes one clear line
    here instead of the launcher's traceback. Returns 0, or the workers' error's exit code after
    printing it once (2 for a usage error); otherwise raises HetrainError naming the rank.
    A run dir made here in the temp folder is removed afterwards (its checkpoints stay after a failure)."""
    run_dir = os.path.dirname(launch.env[LAUNCH_ENV])
    code = None
    try:
        code = _run_in_process(launch, run_dir)
        return code
    finally:
        if launch.temporary_dir:
            _remove_run_dir(run_dir, keep_checkpoints=code != 0)
        if launch.lock is not None:
            launch.lock.release()


def _remove_run_dir(run_dir: str, *, keep_checkpoints: bool) -> None:
    """A run dir we made in the temp folder goes; after a failure its checkpoints (and the metrics
    beside them) stay to resume from."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    if keep_checkpoints and os.path.isdir(checkpoints) and any(
            name not in (CHECKPOINT_LOCK, METRICS_SUBDIR) for name in os.listdir(checkpoints)):   # a checkpoint
        print(f"hetrain: checkpoints kept in {checkpoints} (resume with --checkpoint-dir {checkpoints})",
              file=sys.stderr)
        return
    shutil.rmtree(run_dir, ignore_errors=True)


def _run_in_process(launch: Launch, run_dir: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .runtime.resilience.worker_errors import clear_errors, read_errors

    os.environ.update(launch.env)
    clear_errors(run_dir)
    # Our own line below reports a failed worker; torchrun's duplicate log line would only add noise.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").setLevel(logging.ERROR)
    try:
        with restarts_only_when_they_can_help(run_dir, shutdown_s=launch.shutdown_s):
            run(parse_args(list(launch.argv[3:])))   # argv minus 'python -m torch.distributed.run'
        if launch.hosts_rendezvous:
            # The other nodes' agents close the rendezvous after the exit barrier, through the
            # store this process hosts: leaving at once makes them print connection errors.
            time.sleep(HOST_LINGER_S)
    except SignalException as e:
        # This process was signalled (Slurm, Kubernetes, Ctrl-C): torchrun forwarded the signal to
        # the workers and waited for them; they say what they saved (runtime/resilience/preempt.py).
        return _report_stop(read_errors(run_dir), e.sigval)
    except ChildFailedError as e:
        errors = read_errors(run_dir)
        if errors:   # workers stopped on an error hetrain explained: say it once
            return _report_error(errors[0], launch.nproc)
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        rank, first = e.get_first_failure()
        how = (f"was killed by {first.signal_name()}" if first.exitcode < 0
               else f"exited with code {first.exitcode}")
        raise HetrainError(
            f"the job failed: rank {rank} {how} (exit codes by rank: {codes})",
            "see the rank's error above; for crashes, --max-restarts N restarts from the last checkpoint",
        ) from None
    return 0


def _report_error(first: dict, nproc: int) -> int:
    say(first["what"], first["fix"], tag="" if first["agreed"] or nproc == 1 else f" (rank {first['rank']})",
        error=first["kind"] != "Preempted")
    return int(first["exit_code"])


def _report_stop(errors: list[dict], signum) -> int:
    """The launcher was signalled: the workers' own account of the stop, or what we know."""
    from .runtime.resilience.preempt import signal_name

    if errors:
        return _report_error(errors[0], 1)
    print(f"hetrain: stopped by {signal_name(signum)} before the workers reported a step "
          "boundary (they were starting, or did not answer in time): nothing new was saved", file=sys.stderr)
    return Preempted.exit_code
