"""One job per directory: a checkpoint_dir or run dir held by another live process is refused in
one line naming it, and nothing in it is touched; a killed holder's lock is free at once."""

from __future__ import annotations

import json
import os

import pytest
from lock_holder import hold

from hetrain.errors import UsageError
from hetrain.launch import build_launch
from hetrain.runtime.resilience.lock import CHECKPOINT_LOCK, RUN_LOCK
from hetrain.runtime.resilience.store import Checkpointer


class Log:
    def warn_job(self, message):
        raise AssertionError(message)


def test_a_checkpoint_dir_in_use_is_refused_naming_the_holder_and_left_as_it_is(tmp_path):
    stale = tmp_path / "step-00000004.tmp"
    stale.mkdir()
    holder = hold(tmp_path, CHECKPOINT_LOCK)
    try:
        with pytest.raises(UsageError) as e:
            Checkpointer(str(tmp_path), keep=2, rank=0, log=Log())
        assert f"in use by another hetrain job: pid {holder.pid} on host" in e.value.what
        assert "another Checkpoints(dir=...)" in e.value.fix
        assert stale.is_dir()
    finally:
        holder.kill()
        holder.wait()
    ck = Checkpointer(str(tmp_path), keep=2, rank=0, log=Log())   # the kernel freed a killed holder's lock
    ck.close()


def test_a_run_dir_in_use_is_refused_before_launch_json_is_written(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "launch.json").write_text('{"the other job": true}')
    holder = hold(run_dir, RUN_LOCK)
    try:
        with pytest.raises(UsageError) as e:
            build_launch(target=str(script), run_dir=str(run_dir))
        assert f"run dir {str(run_dir)!r} is in use by another hetrain job: pid {holder.pid}" in e.value.what
        assert json.loads((run_dir / "launch.json").read_text()) == {"the other job": True}
    finally:
        holder.kill()
        holder.wait()
    launch = build_launch(target=str(script), run_dir=str(run_dir))   # free again: this launch takes it
    assert json.loads((run_dir / "launch.json").read_text())["run_dir"] == str(run_dir)
    assert json.loads((run_dir / RUN_LOCK).read_text())["pid"] == os.getpid()   # the record names its holder
    launch.lock.release()
