"""The GPU check's facts: versions; what NCCL does in a world of one; a real `hetrain run` launch
(and LOCAL_RANK past the visible GPUs); the GPU tests (tests/gpu)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, Claims, gib, main, nccl_version, remaining, run_group, skipped

PACKAGES = ("transformers", "accelerate", "lightning", "peft", "pytest", "nvidia-ml-py", "numpy")


def versions(args) -> dict:
    import importlib.metadata as md
    import platform

    import torch

    import hetrain

    c = Claims()
    c.note("python", platform.python_version())
    c.note("torch", torch.__version__)
    c.note("hetrain", hetrain.__version__)
    for name in PACKAGES:
        try:
            c.note(name, md.version(name))
        except md.PackageNotFoundError:
            c.note(name, "not installed")
    declared = _declared_torch()
    c.note("pyproject torch", declared)
    inside = _within(torch.__version__, declared)
    if inside is not None:
        c.expect(inside, f"the installed torch {torch.__version__} is inside pyproject's {declared}")
    figure = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        c.note("cuda", torch.version.cuda)
        c.note("cudnn", torch.backends.cudnn.version())
        c.note("nccl", nccl_version())
        c.note("gpu", f"{props.name}, cc {props.major}.{props.minor}, {gib(props.total_memory)} total, "
                      f"{gib(free)} free of {gib(total)} (mem_get_info, with this process's context)")
        c.note("devices", torch.cuda.device_count())
        c.note("bf16 in hardware", torch.cuda.is_bf16_supported(including_emulation=False))
        figure += f", CUDA {torch.version.cuda}, {props.name} cc {props.major}.{props.minor}"
    else:
        c.note("cuda", "not available")
    rc, text = run_group([sys.executable, "-m", "hetrain", "doctor", "--json"], timeout=remaining(args, 2.0),
                         echo=False)
    if rc is None:
        c.expect(False, f"`hetrain doctor --json` finished within the step's {args.limit:.0f} s")
        return c.outcome(figure)
    try:
        found = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]
        levels = [f["level"] for f in found.get("findings", [])]
        c.note("doctor", {lv: levels.count(lv) for lv in sorted(set(levels))} or "no findings")
        for f in found.get("findings", []):
            if f["level"] == "error":
                print(f"  doctor error: {f['message']} (fix: {f['fix']})")
    except ValueError:
        c.expect(False, f"`hetrain doctor --json` printed JSON (exit {rc}: "
                        f"{(text.strip().splitlines() or [''])[-1][:160]})")
    return c.outcome(figure)


def _declared_torch() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"torch\s*([^"]*)"', text)
    return m.group(1).strip() if m else "?"


def _within(version: str, spec: str):
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return None
    try:
        return Version(version.split("+")[0]) in SpecifierSet(spec)
    except ValueError:
        return None


def read_backend(ht) -> str:
    """The backend of the group hetrain joined (internal: the engine's context)."""
    return ht.ctx.backend


def nccl(args) -> dict:
    """World-1 NCCL: what a CUDA job's collectives meet, group made as hetrain makes it."""
    if args.rehearse:
        return skipped("rehearsal: NCCL needs a GPU")
    import torch
    import torch.distributed as dist

    c = Claims()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    c.note("init_process_group(nccl, world 1)", f"{time.perf_counter() - t0:.2f} s")
    t = torch.arange(4.0, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    c.expect(t.tolist() == [0.0, 1.0, 2.0, 3.0], "all_reduce of a CUDA tensor (SUM over one rank)")
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    c.expect(t.tolist() == [0.0, 1.0, 2.0, 3.0], "all_reduce AVG (NCCL only)")
    objs = [None]
    dist.all_gather_object(objs, {"rank": 0, "name": "x"})
    c.expect(objs == [{"rank": 0, "name": "x"}], "all_gather_object (pickled through a CUDA tensor)")
    box = [{"plan": [1, 2]}]
    dist.broadcast_object_list(box, src=0)
    c.expect(box == [{"plan": [1, 2]}], "broadcast_object_list")
    out = torch.empty(4, device=device)
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(out, t)
    c.expect(out.tolist() == t.tolist(), "all_gather_into_tensor and reduce_scatter_tensor")
    c.note("dist.all_gather_single / reduce_scatter_single in this torch",
           f"{hasattr(dist, 'all_gather_single')} / {hasattr(dist, 'reduce_scatter_single')}")
    for what, run in (("all_reduce of a CPU tensor", lambda: dist.all_reduce(torch.ones(2))),
                      ("barrier", lambda: dist.barrier())):
        try:
            run()
            torch.cuda.synchronize()
            c.note(what, "runs")
        except Exception as e:
            c.note(what, f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    try:
        mixed = dist.new_group([0], backend="cpu:gloo,cuda:nccl")
        cpu = torch.ones(2)
        dist.all_reduce(cpu, group=mixed)
        c.note("a cpu:gloo,cuda:nccl group", f"runs a CPU tensor's all_reduce ({cpu.tolist()})")
    except Exception as e:
        c.note("a cpu:gloo,cuda:nccl group", f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    t0 = time.perf_counter()
    dist.destroy_process_group()
    c.note("destroy_process_group", f"{time.perf_counter() - t0:.2f} s")
    import hetrain
    from hetrain import Reporting

    ht = hetrain.init(global_batch=8, reporting=Reporting(verbose=False))
    backend = read_backend(ht)
    c.expect(ht.device == device and backend == "nccl",
             f"hetrain.init in a world of one joins NCCL on cuda:0 (got {backend} on {ht.device})")
    ht.close()
    return c.outcome(f"world-1 NCCL {nccl_version()}: "
                     f"CPU tensor {'raises' if 'raises' in str(c.details.get('all_reduce of a CPU tensor')) else 'runs'}")


def launch(args) -> dict:
    """A user's first command: `hetrain run` of the demo on this GPU (torchrun's flags on this
    torch); and LOCAL_RANK past the visible GPUs, which must be one line naming the fix."""
    if args.rehearse:
        return skipped("rehearsal: `hetrain run` on a GPU")
    import torch

    c = Claims()
    scratch = Path(args.scratch)
    result = scratch / "launch-train.json"
    cmd = [sys.executable, "-m", "hetrain", "run", "--run-dir", str(scratch / "launch-run"), "-m",
           "hetrain.demo.train_gpt", "--steps", "6", "--global-batch", "32", "--json", str(result)]
    print("  $ " + " ".join(cmd), flush=True)
    rc, _ = run_group(cmd, timeout=remaining(args, 12.0))
    c.expect(rc == 0, f"`hetrain run -m hetrain.demo.train_gpt` exits 0 "
                      f"({'got ' + str(rc) if rc is not None else 'still running at the limit: killed'})")
    figure = f"hetrain run exit {rc}"
    if result.exists():
        r = json.loads(result.read_text())
        c.note("demo", {k: r.get(k) for k in ("steps", "first_loss", "last_loss", "samples_per_s")})
        c.expect(r.get("steps") == 6 and r.get("last_loss") is not None and r["last_loss"] == r["last_loss"],
                 "the demo ran its 6 steps to a finite loss")
        figure += f", 6 steps, {r.get('samples_per_s') or 0:.0f} samples/s"
    n = torch.cuda.device_count()
    env = {**os.environ, "LOCAL_RANK": str(n), "RANK": "0", "WORLD_SIZE": "1"}
    bad = subprocess.run([sys.executable, "-c", "import hetrain; hetrain.init(global_batch=8)"], env=env,
                         capture_output=True, text=True, timeout=min(30.0, remaining(args)))
    lines = [ln for ln in bad.stderr.strip().splitlines() if ln.strip() and "Warning" not in ln]
    c.note(f"LOCAL_RANK={n} with {n} GPU(s)", f"exit {bad.returncode}: {lines[-1][:200] if lines else '(nothing)'}")
    c.expect(bad.returncode != 0 and len(lines) == 1 and "Traceback" not in bad.stderr,
             f"LOCAL_RANK={n} past the visible GPUs is one line naming the fix, no traceback "
             f"(got {len(lines)} lines, exit {bad.returncode})")
    return c.outcome(figure)


def gpu_tests(args) -> dict:
    """pytest tests/gpu, every test (no -x); on a CPU they skip with their reasons, which still
    checks that they import and collect."""
    c = Claims()
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "gpu"), "-v", "-rs", "-p", "no:cacheprovider",
           "--durations=5"]
    print("  $ " + " ".join(cmd), flush=True)
    rc, out = run_group(cmd, timeout=remaining(args, 4.0), cwd=ROOT)
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", out.splitlines()[-1]
                                                                                  if out.strip() else "")}
    figure = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary"
    if rc is None:
        done = len(re.findall(r" (PASSED|FAILED|SKIPPED|ERROR)", out))
        c.expect(False, f"tests/gpu finished within the step's limit ({done} tests done when it was stopped)")
        return c.outcome(f"stopped after {done} tests")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    c.expect(rc in (0, 5), f"pytest tests/gpu exits 0 (got {rc}{': ' + ', '.join(failed[:4]) if failed else ''})")
    return c.outcome(figure)


STEPS = {
    "versions": (versions, None),
    "nccl": (nccl, "an NCCL group needs a GPU"),
    "launch": (launch, "`hetrain run` on the real GPU, and LOCAL_RANK against its device count"),
    "gpu-tests": (gpu_tests, None),
}

if __name__ == "__main__":
    main(STEPS)
