"""torchrun's elastic agent with hetrain's restart rules, put in place while `hetrain run` runs it.

torchrun restarts a failed worker group up to --max-restarts times and restarts a healthy one,
without using a restart, when a node waits to join. Two things it cannot know, the workers'
error records (runtime/resilience/worker_errors.py) tell: an error a restart cannot fix (bad
input, a model that does not fit, a preemption) ends the job at once, and workers that stopped
together at a saved step because a node is joining are that membership change, not a failure.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import sys
import time

from ..errors import Preempted
from ..runtime.resilience.worker_errors import clear_errors, read_errors

# torch's rendezvous state holder serves num_nodes_waiting() from a copy up to 1 s old
# (_BackendRendezvousStateHolder cache_duration=1). Asking again over a longer span gets a fresh one.
RDZV_STATE_CACHE_S = 1.0
WAITING_CHECK_S = 2.5 * RDZV_STATE_CACHE_S
TORCHRUN_STOP_WAIT_S = 30    # torchrun's own wait between SIGTERM and SIGKILL
FAILED_STOP_GRACE_S = 5


def nodes_waiting(rdzv_handler, *, within_s: float = WAITING_CHECK_S, poll_s: float = 0.25) -> bool:
    """Whether a node waits to join, read fresh. Our workers can stop because another node's agent
    saw a joiner and stopped its own (they stop together at the step boundary), sooner than the
    cached copy this agent reads shows the joiner: one read could say 0. The joiner stays on the
    wait list until every participant, this node included, has left the round, so a fresh read
    sees it. Costs up to `within_s` when nobody waits (a real preemption), once, at the job's end."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if rdzv_handler.num_nodes_waiting() > 0:
                return True
        except Exception:      # noqa: BLE001 — a rendezvous that cannot say: treat as a failure
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


@contextlib.contextmanager
def restarts_only_when_they_can_help(run_dir: str, *, shutdown_s: int = TORCHRUN_STOP_WAIT_S):
    """While torchrun runs here: its agent, except that a worker error a restart cannot fix
    (`restartable` in the worker's error record) ends the job instead of using up --max-restarts
    on the same failure. torchrun builds its agent by name in launcher.api; we put ours there for
    the duration, and put torchrun's back after. `shutdown_s`: the wait after SIGTERM that
    --shutdown-timeout gives a torchrun that has it; on one without it (torch 2.11) the agent's
    own stops wait this long."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.api import WorkerState

    original = launcher_api.LocalElasticAgent

    class Agent(original):
        # A group with a failed member is stopped with SIGTERM, then SIGKILL after a wait: torchrun
        # waits a fixed 30 s (not --shutdown-timeout), both when its process context closes itself
        # on the first failed worker (PContext._poll calls close() with no timeout) and in
        # _stop_workers. Nothing can be saved then: the checkpoint is collective and a member is
        # gone, so the next attempt resumes from the last one anyway. A live survivor's collective
        # fails on the dead peer's closed sockets and it exits on its own within this grace; a hung
        # (SIGSTOPped) one never answers SIGTERM, and waiting for it only delays the restart or the
        # job's end. Workers that stopped at a step boundary (Preempted: a signal, or a node
        # joining) keep torchrun's wait: the others may still be writing that checkpoint.
        failed_stop_grace_s = FAILED_STOP_GRACE_S
        stop_timeout_s: int | None = None        # the wait the next close is given (torch 2.11's _shutdown)

        def _shutdown(self, death_sig=signal.SIGTERM, timeout=None):
            # torch 2.12 gave the agent's _shutdown a timeout (and torchrun --shutdown-timeout);
            # 2.11's takes the signal alone, and its process context's close waits its own 30 s.
            parent = super()._shutdown
            if "timeout" in inspect.signature(parent).parameters:
                return parent(death_sig, **({} if timeout is None else {"timeout": timeout}))
            # Without the parameter the wait goes to the process context's close, below: what the
            # caller asked, else --shutdown-timeout's (torch's own calls: the end, a signal, a stop).
            self.stop_timeout_s = shutdown_s if timeout is None else timeout
            try:
                return parent(death_sig)
            finally:
                self.stop_timeout_s = None

        def _start_workers(self, worker_group):
            started = super()._start_workers(worker_group)
            pcontext = self._pcontext
            close = pcontext.close

            def close_after_a_failure(death_sig=None, timeout=None):
                if timeout is None and self.stop_timeout_s is not None:    # _shutdown's, above
                    timeout = self.stop_timeout_s
                if timeout is None:      # the context's own close: all workers done, or one failed
                    codes = [f.exitcode for f in getattr(pcontext, "_failures", {}).values()]
                    failed = any(code != Preempted.exit_code for code in codes)
                    timeout = self.failed_stop_grace_s if failed else TORCHRUN_STOP_WAIT_S
                return close(death_sig, timeout)

            pcontext.close = close_after_a_failure
            return started

        def _initialize_workers(self, worker_group):
            # Error records belong to one attempt. Cleared here, after the old workers are stopped:
            # a worker stopped for a restart writes its record while it stops, and read in the
            # next attempt that record would be taken for the new workers' own.
            clear_errors(run_dir)
            return super()._initialize_workers(worker_group)

        def _stop_workers(self, worker_group):
            if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                self._shutdown(timeout=self.failed_stop_grace_s)
            else:
                super()._stop_workers(worker_group)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                errors = read_errors(run_dir)
                if (errors and all(e.get("kind") == "Preempted" for e in errors)
                        and nodes_waiting(worker_group.spec.rdzv_handler)):
                    # Another node's agent took in a waiting node and stopped its workers; ours
                    # stopped with them at the same saved step. Not a failure: the membership
                    # change torchrun handles for a healthy group (restart, no restart used).
                    result.state = WorkerState.HEALTHY
                elif self._remaining_restarts > 0 and any(not e.get("restartable", True) for e in errors):
                    self._remaining_restarts = 0
            return result

        def _restart_workers(self, worker_group):
            # A membership change (a node waiting to join: the group is healthy) or a failure.
            if worker_group.state == WorkerState.HEALTHY:
                print("hetrain: a node is waiting to join: every node restarts its workers to take it in "
                      "(they save at the next step boundary; the shares are planned again)", file=sys.stderr)
            else:
                print(f"hetrain: a worker failed or a node was lost: restarting on the nodes present "
                      f"({self._remaining_restarts} restart(s) left after this one)", file=sys.stderr)
            super()._restart_workers(worker_group)

    launcher_api.LocalElasticAgent = Agent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original
