"""A group trial as the scheduler sees it: a hetrain data-parallel job over the group's devices,
started through torchrun (as `hetrain run` starts one), polled, and read back.

The job's ranks run group_rank.py. What they need comes in one task file; on devices that are
not CUDA GPUs their target writes the launch file (runtime.config.LAUNCH_ENV, as `hetrain run`
writes it) that gives `hetrain.init` in the trial the group's devices and the sweep's clock. Rank
0 writes the trial's outcome to the result file; a job that ends without one failed (torchrun stops every rank when one fails).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from ..runtime.config import LAUNCH_ENV
from .groups import GroupFit
from .objective import on_gpu

STOP_S = 15.0     # torchrun's grace to stop its ranks before it is killed


class GroupJob:
    def __init__(self, setup, fit: GroupFit, *, trial_id: int, number: int, params: dict, lead: int):
        self.fit, self.number, self.lead = fit, number, lead
        self.dir = tempfile.mkdtemp(prefix="hetrain-sweep-group-")
        self.result_path = os.path.join(self.dir, "result.json")
        members = [s.index for s in fit.members]
        targets = [setup.targets[i] for i in members]
        other = None if any(on_gpu(t) for t in targets) else targets[0]     # a group is of one kind
        task = {"objective": setup.objective, "url": setup.url, "study": setup.study, "pruner": setup.pruner,
                "trial_id": trial_id, "number": number, "params": params,
                "device": other.torch_device if other is not None else "cuda",
                "enter": other.enter_ref if other is not None else None,
                "labels": [s.label for s in fit.members], "speeds": [s.speed for s in fit.members],
                "sharding": fit.sharding, "sample_s": setup.sample_s, "parent": os.getpid(),
                "result": self.result_path, "entry": setup.entry,
                "parts": base64.b64encode(setup.parts).decode() if setup.parts is not None else None}
        task_path = os.path.join(self.dir, "task.json")
        with open(task_path, "w") as f:
            json.dump(task, f)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if other is not None:
            launch = other.group_launch([s.spec for s in fit.members], sample_s=setup.sample_s, run_dir=self.dir)
            launch_path = os.path.join(self.dir, "launch.json")
            with open(launch_path, "w") as f:
                json.dump(launch, f)
            env[LAUNCH_ENV] = launch_path
        else:
            env.pop(LAUNCH_ENV, None)
            env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"] = ",".join(targets), "PCI_BUS_ID"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(members)}",
                "--max-restarts=0", "-m", "hetrain.sweeping.group_rank", task_path]
        self.log = open(os.path.join(self.dir, "job.log"), "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def pid(self) -> int:
        return self.proc.pid

    def poll(self):
        """None while the job runs; then (lead index, number, state, value, note, busy, reports,
        peak bytes), as a worker reports a trial."""
        code = self.proc.poll()
        if code is None:
            return None
        busy = time.perf_counter() - self.started
        self.log.close()
        try:
            with open(self.result_path) as f:
                r = json.load(f)
            out = (self.lead, self.number, r["state"], r["value"], r["note"], busy, r["reports"], r["peak"])
        except (OSError, ValueError, KeyError):
            out = (self.lead, self.number, "failed", None,
                   f"the group job over {self.fit.label} exited with code {code}: {self.last_line()}", busy, 0, None)
        if out[2] == "failed":
            sys.stderr.write(self.tail())
        shutil.rmtree(self.dir, ignore_errors=True)
        return out

    def last_line(self) -> str:
        lines = [line for line in self.tail().splitlines() if line.strip() and "Traceback" not in line]
        return (lines[-1].strip() if lines else "no output")[:300]

    def tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "job.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """The sweep stops on an error: torchrun told to stop its ranks, then killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_S)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
