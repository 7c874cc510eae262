"""metrics.jsonl read back (the lines runtime/loop/metrics.py writes), checked line by line.

A bad file is one UsageError naming the line and what is wrong with it. Steps a restarted run
did again appear twice in the file; the later line is the one kept (it is the step that
counted: the first attempt's was lost with the attempt).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..errors import UsageError

FILE = "metrics.jsonl"
HOW_TO_MAKE = ("run the job with --metrics-dir DIR (or hetrain.init(reporting=Reporting(metrics_dir=DIR))); a job "
               "with a checkpoint directory (Checkpoints(dir=D), --checkpoint-dir D) writes D/metrics")
DEVICE_NUMBERS = ("compute_s", "wait_s", "sync_s", "share")


@dataclass(kw_only=True)
class RunLog:
    path: str
    starts: list[dict] = field(default_factory=list)     # one header per attempt (event 'start')
    steps: list[dict] = field(default_factory=list)      # by step index, each step once
    events: list[dict] = field(default_factory=list)     # oom, rebalance, skipped_step, restart

    def devices(self) -> list[str]:
        """Every device's name, in rank order of first appearance."""
        seen: dict[str, None] = {}
        for s in self.steps:
            for d in s["devices"]:
                seen.setdefault(d["device"], None)
        return list(seen)

    def series(self, device: str, key: str) -> tuple[list[int], list]:
        """(steps, values) of one device's field, where the device took part and the value is known."""
        xs, ys = [], []
        for s in self.steps:
            for d in s["devices"]:
                if d["device"] == device and d.get(key) is not None:
                    xs.append(s["step"])
                    ys.append(d[key])
        return xs, ys

    def header(self) -> dict:
        return self.starts[-1] if self.starts else {}


def find(run_dir: str) -> str:
    """RUN_DIR/metrics.jsonl, or RUN_DIR/metrics/metrics.jsonl (RUN_DIR a checkpoint_dir)."""
    candidates = [os.path.join(run_dir, FILE), os.path.join(run_dir, "metrics", FILE)]
    for path in candidates:
        if os.path.isfile(path):
            return path
    if not os.path.isdir(run_dir):
        raise UsageError(f"report: {run_dir!r} is not a directory", HOW_TO_MAKE + ", then `hetrain report DIR`")
    raise UsageError(f"report: no {FILE} in {run_dir!r} (looked for {' and '.join(map(repr, candidates))})",
                     HOW_TO_MAKE)


def read(path: str) -> RunLog:
    log, by_step = RunLog(path=path), {}
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            line = _parse(text, n, path)
            if "event" in line:
                (log.starts if line["event"] == "start" else log.events).append(line)
            else:
                by_step[line["step"]] = line          # a step done again after a restart: the later
    log.steps = [by_step[k] for k in sorted(by_step)]
    if not log.steps:
        raise UsageError(f"report: {path} has no step lines yet", "run at least one optimizer step, then report")
    return log


def _parse(text: str, n: int, path: str) -> dict:
    def bad(why: str) -> UsageError:
        return UsageError(f"report: {path} line {n} is malformed: {why}",
                          "remove or repair that line (each line is one JSON object hetrain wrote)")

    try:
        line = json.loads(text)
    except ValueError as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(line, dict):
        raise bad(f"a JSON {type(line).__name__}, not an object")
    if "event" in line:
        if not isinstance(line["event"], str):
            raise bad("'event' is not a string")
        return line
    if not isinstance(line.get("step"), int) or isinstance(line.get("step"), bool):
        raise bad("no whole-number 'step' (and no 'event')")
    devices = line.get("devices")
    if not isinstance(devices, list) or not devices or not all(isinstance(d, dict) for d in devices):
        raise bad("'devices' is not a list of objects")
    for d in devices:
        if not isinstance(d.get("device"), str):
            raise bad("a device without a 'device' name")
        for key in DEVICE_NUMBERS:
            if not isinstance(d.get(key), (int, float)) or isinstance(d.get(key), bool):
                raise bad(f"device {d['device']!r} has no number '{key}'")
    return line
