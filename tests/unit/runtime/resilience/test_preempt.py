"""The preemption record: what a signal sets, the repeat it ignores, and the grace that bounds the wait."""

from __future__ import annotations

import signal
import threading

from hetrain.errors import Preempted
from hetrain.runtime.resilience.preempt import Preemption, stop_message


def expiring(grace_s: float):
    fired: list[Preempted] = []
    done = threading.Event()
    p = Preemption(grace_s=grace_s, on_expiry=lambda e: (fired.append(e), done.set()))
    return p, fired, done


def test_a_signal_is_recorded_once_and_the_grace_expiry_says_what_was_saved():
    p, fired, done = expiring(0.05)
    assert p.requested == 0
    p.last_saved = "step-00000040"
    p._handle(signal.SIGTERM, None)
    p._handle(signal.SIGINT, None)            # a repeat changes nothing
    assert p.requested == signal.SIGTERM
    assert done.wait(5)
    assert isinstance(fired[0], Preempted) and fired[0].exit_code == 75 and not fired[0].restartable
    assert "SIGTERM" in fired[0].what and "preempt_grace_s=0.05" in fired[0].what
    assert "step-00000040" in fired[0].what


def test_no_expiry_once_the_boundary_is_reached_or_after_uninstall():
    p, fired, done = expiring(0.05)
    p._handle(signal.SIGTERM, None)
    p.at_boundary = True                      # the final checkpoint is being written
    assert not done.wait(0.3) and fired == []
    q, fired, done = expiring(0.05)
    q._handle(signal.SIGTERM, None)
    q.uninstall()
    assert not done.wait(0.3) and fired == []


def test_install_catches_sigterm_and_uninstall_restores_the_previous_handler():
    before = signal.getsignal(signal.SIGTERM)
    p, fired, _ = expiring(60)
    p.install()
    try:
        signal.raise_signal(signal.SIGTERM)   # handled: the process lives on
        assert p.requested == signal.SIGTERM
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_stop_message_names_every_signalled_rank_and_the_checkpoint():
    text = stop_message(signals=[0.0, 15.0, 2.0], step=12, saved="/ck/step-00000012")
    assert "SIGTERM on rank 1, SIGINT on rank 2" in text and "/ck/step-00000012 saved after step 12" in text
    assert "nothing saved" in stop_message(signals=[15.0], step=3, saved=None)
