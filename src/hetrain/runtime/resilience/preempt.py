"""Preemption: SIGTERM or SIGINT (what Slurm and Kubernetes send before SIGKILL, and Ctrl-C) stops
the job at the next step boundary, with a final checkpoint, instead of killing it mid-step.

    signal on any rank      the handler only records it (it may run while the rank waits in a
                            collective: nothing else is safe there)
    the step's agreement    each rank reports the signal it got in the step's table (ranks/agree.py,
                            "stop"); every rank sees every row, so all stop after the same step
    the next boundary       the checkpoint is written (resilience/resume.py), then every rank raises
                            Preempted: exit code 75, one line naming the step saved
    no boundary in time     preempt_grace_s after the signal, a rank that has not reached the
                            boundary (a peer is gone, a step is longer than the grace) exits with
                            the same code, saying what it could not save; a rank already writing
                            the checkpoint is left to finish it

Under `hetrain run`, torchrun forwards a signal sent to the launcher to every worker and waits
`--shutdown-timeout` seconds (launch.py sets it above the grace) before SIGKILL; a signal sent to
one worker reaches the others through the agreement. Repeated signals (a terminal's Ctrl-C reaches
every process, then torchrun forwards it again) change nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from ...errors import Preempted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """This rank's record of a stop signal, and the grace timer that bounds the wait for the boundary."""

    def __init__(self, *, grace_s: float, on_expiry: Callable[[Preempted], None] | None = None):
        self.grace_s = grace_s
        self.signum = 0                # the first signal received (0: none)
        self.at_boundary = False       # the agreed stop reached the boundary: the save is under way
        self.last_saved: str | None = None   # the newest checkpoint this job holds, for the expiry message
        self._on_expiry = on_expiry or _exit_now
        self._previous: dict = {}
        self._timer: threading.Timer | None = None

    # -- the signal handlers -------------------------------------------------------------------
    def install(self) -> None:
        """Catch SIGTERM and SIGINT (main thread only: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        if self.signum:
            return                     # a repeat (Ctrl-C reaches every process, torchrun forwards it)
        self.signum = signum
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    @property
    def requested(self) -> int:
        """The signal number this rank received, or 0: its value in the step's table."""
        return self.signum

    # -- the grace -----------------------------------------------------------------------------
    def _expire(self) -> None:
        if self.at_boundary:
            return                     # writing the final checkpoint: torchrun's timeout bounds it
        saved = (f"the newest checkpoint is {self.last_saved}" if self.last_saved
                 else "no checkpoint was saved in this run")
        self._on_expiry(Preempted(
            f"stopped by {signal_name(self.signum)}, but the step boundary was not reached within "
            f"Checkpoints(preempt_grace_s={self.grace_s:g}); {saved}",
            "raise Checkpoints(preempt_grace_s=...) above one step's time (and torchrun's "
            "--shutdown-timeout above that), or look for a rank that stopped responding"))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stop_message(*, signals: list[float], step: int, saved: str | None) -> str:
    """What every rank says when the agreed stop is done (the same text on every rank)."""
    who = ", ".join(f"{signal_name(int(s))} on rank {r}" for r, s in enumerate(signals) if s)
    where = (f"checkpoint {saved} saved after step {step}; run the same command to resume from it" if saved
             else f"after step {step}, with nothing saved (no checkpoint directory: pass --checkpoint-dir "
                  "or checkpoints=Checkpoints(dir=...) so a preempted job can resume)")
    return f"preempted ({who}): stopped at the step boundary, {where}"


def _exit_now(error: Preempted) -> None:
    """The grace expired: leave now, the way the error hook does (worker_errors.py)."""
    from .worker_errors import report_and_exit

    report_and_exit(error, rank=int(os.environ.get("RANK", "0") or 0))
