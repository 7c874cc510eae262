"""Multi-node launch options, checked before anything starts, as torchrun c10d arguments.

torchrun's c10d rendezvous does the work (torch.distributed.elastic): every node's launcher joins
one rendezvous at HOST:PORT; the node at that address hosts its store (a TCPStore in the launcher
process), the others connect to it. We check the options (one line each, exit 2), make node rank 0
the host explicitly (on loopback every node matches the endpoint's address, and torch's guess would
let whichever starts first host it), and before a non-host node launches, wait for the endpoint to
answer, so an unreachable endpoint is one error within --rdzv-timeout that names it, not a
traceback after torch's own 60-second read timeout.

Elastic `--nnodes MIN:MAX` is torchrun's: a failed or lost node stops the round, the others restart
(--max-restarts) in a new round of at least MIN nodes, and a node that starts (or comes back) while
the job runs makes the nodes restart together to take it in. hetrain's part is that each restart
re-plans the shares for the devices present and resumes from the last checkpoint exactly
(runtime/resilience/resume.py); the checkpoint must be on storage every node reads.
"""

from __future__ import annotations

import errno
import socket
import time
from dataclasses import dataclass

from ..errors import UsageError

DEFAULT_PORT = 29400             # torchrun's c10d default
LAST_CALL_S = 30                 # torch's default: how long a round with MIN nodes waits for more


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    min_nodes: int
    max_nodes: int
    node_rank: int
    host: str
    port: int
    run_id: str
    timeout_s: float             # to reach the endpoint, and for the rendezvous to complete
    last_call_s: float = LAST_CALL_S

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def hosts_store(self) -> bool:
        return self.node_rank == 0

    @property
    def nnodes(self) -> str:
        return str(self.max_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"

    def torchrun_args(self) -> list[str]:
        conf = {"is_host": int(self.hosts_store), "join_timeout": int(max(1, self.timeout_s)),
                "read_timeout": int(max(1, self.timeout_s)), "last_call_timeout": int(max(1, self.last_call_s))}
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
                f"--nnodes={self.nnodes}",      # torchrun's --node-rank is for static rendezvous only
                "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items())]

    def describe(self) -> str:
        role = ("hosts the rendezvous (node rank 0)" if self.hosts_store
                else f"joins it as node rank {self.node_rank}")
        nodes = (f"{self.max_nodes} nodes" if self.min_nodes == self.max_nodes
                 else f"{self.min_nodes} to {self.max_nodes} nodes (elastic: a lost node's peers restart on "
                      f"the rest, a returning node joins at the next restart)")
        return (f"rendezvous: torchrun c10d at {self.endpoint}, id {self.run_id!r}, {nodes}; this node {role}; "
                f"waits up to {self.timeout_s:g} s for the endpoint and the other nodes")


def parse_nnodes(text: str) -> tuple[int, int]:
    """'2' or 'MIN:MAX', as torchrun takes it."""
    fix = "give --nnodes N, or --nnodes MIN:MAX for an elastic job (e.g. 1:3), with 1 <= MIN <= MAX"
    parts = str(text).strip().split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise UsageError(f"--nnodes {text!r} is not N or MIN:MAX", fix) from None
    if low < 1 or high < 1:
        raise UsageError(f"--nnodes {text!r}: a job needs at least 1 node", fix)
    if low > high:
        raise UsageError(f"--nnodes {text!r}: MIN {low} is more than MAX {high}", fix)
    return low, high


def parse_endpoint(text: str) -> tuple[str, int]:
    fix = "give --rdzv-endpoint HOST:PORT, the address of node rank 0 (e.g. 10.0.0.5:29400)"
    host, sep, port_text = str(text).strip().rpartition(":")
    if not sep:
        host, port_text = port_text, str(DEFAULT_PORT)
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise UsageError(f"--rdzv-endpoint {text!r}: port {port_text!r} is not a number", fix) from None
    if not host or not 1 <= port <= 65535:
        raise UsageError(f"--rdzv-endpoint {text!r} needs a host and a port from 1 to 65535", fix)
    return host, port


def rendezvous(*, nnodes: str | None, node_rank: int | None, endpoint: str | None, run_id: str | None,
               timeout_s: float, last_call_s: float = LAST_CALL_S) -> Rendezvous | None:
    """The checked options, or None for a one-node job (torchrun --standalone)."""
    if nnodes is None:
        given = [flag for flag, v in (("--node-rank", node_rank), ("--rdzv-endpoint", endpoint),
                                      ("--rdzv-id", run_id)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} without --nnodes",
                             "add --nnodes N (every node's `hetrain run` gives the same N), or drop them")
        return None
    low, high = parse_nnodes(nnodes)
    if not timeout_s > 0:
        raise UsageError(f"--rdzv-timeout {timeout_s:g} must be positive", "give seconds, e.g. --rdzv-timeout 300")
    if not last_call_s > 0:
        raise UsageError(f"--rdzv-last-call {last_call_s:g} must be positive", "give seconds, e.g. 30")
    if endpoint is None:
        if high == 1:
            return None                # one node: the standalone rendezvous
        raise UsageError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT",
                         "give every node the address of node rank 0, e.g. --rdzv-endpoint 10.0.0.5:29400")
    host, port = parse_endpoint(endpoint)
    if node_rank is None:
        raise UsageError(f"--nnodes {nnodes} needs --node-rank",
                         "give --node-rank 0 on the node at the endpoint (it hosts the rendezvous), 1, 2, ... on the others")
    if not 0 <= node_rank < high:
        raise UsageError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}",
                         f"give a node rank from 0 to {high - 1} (0 on the node at {host}:{port})")
    return Rendezvous(min_nodes=low, max_nodes=high, node_rank=node_rank, host=host, port=port,
                      run_id=run_id or f"hetrain-{host}-{port}", timeout_s=float(timeout_s),
                      last_call_s=float(last_call_s))


def check_reachable(rdzv: Rendezvous, *, poll_s: float = 0.25) -> str:
    """Node rank 0: the endpoint must be an address of this machine with the port free (it will
    host the store there). The others: wait until the endpoint accepts a connection, for up to
    the timeout. Returns a line for the launch's reasons; raises UsageError otherwise."""
    if rdzv.hosts_store:
        with socket.socket(socket.AF_INET6 if ":" in rdzv.host else socket.AF_INET) as s:
            try:
                s.bind((rdzv.host, rdzv.port))
            except socket.gaierror as e:
                raise UsageError(f"--rdzv-endpoint {rdzv.endpoint}: host {rdzv.host!r} is not known ({e.strerror})",
                                 "give this machine's address or name") from None
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UsageError(f"--rdzv-endpoint {rdzv.endpoint}: port {rdzv.port} is in use on this machine",
                                     "give a free port (every node the same), or stop what holds it") from None
                raise UsageError(
                    f"node rank 0 hosts the rendezvous at {rdzv.endpoint}, but {rdzv.host!r} is not an address of "
                    f"this machine ({e.strerror})",
                    f"run node rank 0 on {rdzv.host}, or give --rdzv-endpoint with this machine's address") from None
        return f"rendezvous endpoint {rdzv.endpoint}: an address of this machine, port free (this node hosts it)"
    deadline = time.monotonic() + rdzv.timeout_s
    why = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((rdzv.host, rdzv.port), timeout=max(0.1, min(5.0, left))):
                return f"rendezvous endpoint {rdzv.endpoint} answered"
        except socket.gaierror as e:
            raise UsageError(f"--rdzv-endpoint {rdzv.endpoint}: host {rdzv.host!r} is not known ({e.strerror})",
                             "give node rank 0's address or name, the same on every node") from None
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() + poll_s >= deadline:
            raise UsageError(
                f"the rendezvous endpoint {rdzv.endpoint} could not be reached within {rdzv.timeout_s:g} s ({why})",
                f"start node rank 0 (it hosts the rendezvous) on {rdzv.host}, check the host and port and that "
                f"TCP port {rdzv.port} is open between the nodes; --rdzv-timeout S waits longer")
        time.sleep(poll_s)
