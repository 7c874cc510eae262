"""The pipeline measurement of a model (its blocks' costs and how much longer a stage runs them,
layouts/pipeline/setup.measure_blocks) kept in $HETRAIN_CACHE/pipelines, as profiles are
(profiler.py): `hetrain plan` measures, and the job that follows sizes its stages from the same
figures, so the layout the ranking costed is the one that runs (measured twice, two splits within
a few percent of each other can each win once: the ranking's 2/2 against the runtime's 3/1 on
the demo GPT, and a peak memory 25% off the ranking's).

Only devices whose blocks are timed on this host's CPU (StageHooks.blocks_on_host): rank 0
measures every block at speed 1.0 on this CPU, which the key names (the model's signature with the
micro-batch's shape, the precision, the CPU and its threads, and the cluster's speeds, which the
fixed cost's median is over). Devices that time their own work (GPUs) measure every time, each on
its own device. A cache file that cannot be read is measured again; writing one never fails a job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ....errors import HetrainError
from ....files import cache_dir, write_json_atomic
from .split import PipelineProfile

VERSION = 6             # 4: a factor and a fixed cost per block, from two sizes; 5: the stages' host; 6: its
                        # figures in one field (PipelineProfile.host)


def path_for(parts, example, job, devices) -> Path | None:
    """Where this model's pipeline measurement on this CPU and cluster is kept (None: caching off)."""
    from .blocks import StageModule
    from ...measure.profiler import device_key, model_signature

    root = cache_dir("pipelines")
    if root is None:
        return None
    whole = StageModule(parts, 0, len(parts.blocks), is_first=True, is_last=True)
    signature = model_signature(whole, None, example, precision=job.precision.compute, max_size=int(example.shape[0]))
    speeds = ",".join(f"{d.speed:.6g}" for d in devices)
    key = f"v{VERSION} {device_key(job.device)} speeds {speeds} rows {int(example.shape[0])}"
    return root / f"{signature}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def read(path: Path | None) -> PipelineProfile | None:
    """The cached measurement, or None (absent, unreadable, or from another version)."""
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            return None
        profile = PipelineProfile.from_dict(data["profile"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError, HetrainError):
        return None
    return dataclasses.replace(profile, source=profile.source + " (cached)")


def write(path: Path | None, profile: PipelineProfile) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"version": VERSION, "profile": profile.to_dict()})
    except OSError:
        pass                    # a read-only home is not a reason to fail a run
