"""The worker's error hook: installed again (init() before the rank is known, the Engine after),
it replaces the first instead of chaining to it."""

from __future__ import annotations

import sys

from hetrain.runtime.resilience.worker_errors import install_excepthook


def test_a_second_install_replaces_the_first(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[0]))
    original = sys.excepthook
    install_excepthook(0, 1, lambda: None)
    install_excepthook(1, 2, lambda: None)
    assert sys.excepthook.hetrain_previous is original
    sys.excepthook(KeyError, KeyError("k"), None)       # not one hetrain explains: Python's own report
    err = capsys.readouterr().err
    assert seen == [KeyError]
    assert err.count("in the training script") == 1 and "[rank 1]" in err      # the second install's rank
