"""Guard: a tensor handed to a collective is made on the job's device.

A CUDA job's group is NCCL only (docs/architecture.md, "Collectives and devices"): a CPU tensor in a
collective raises there, and passes every gloo test here. So in any function that calls a
torch.distributed tensor collective, every tensor it creates names its device, and that device is
the job's: a variable named for it (`device`, `job_device`, a parameter), an attribute `.device` of
the job's own objects (self, job, engine, ctx, sharding) or `collective_device(...)`. Not
`v.device` of some tensor: beside host-side state (an offloaded optimizer's) that is the CPU. The
exceptions are listed with their reason. tests/collective_check.py checks the same at run time."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hetrain"
COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "all_gather_single", "reduce_scatter_single", "batch_isend_irecv"}
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "eye", "linspace", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}
NEW_METHODS = {"new_tensor", "new_zeros", "new_ones", "new_empty", "new_full"}
JOB_ROOTS = {"self", "job", "engine", "ctx", "sharding"}
# (module, function): why its tensors need no job device
# torch_compat's stand-ins for collectives that torch < 2.13 lacks, called by their bare names
COMPAT = {"all_gather_single", "reduce_scatter_single"}
ALLOWED = {
    ("emulation/pipeline.py", "_time_messages"):
        "runs for emulated devices only (speed given), which are CPU ranks over gloo: host tensors by design",
    ("runtime/sharding/fsdp_guard.py", "complete_missing"):
        "re-issues recorded collectives with zeros on the device each recorded one ran on",
}


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _own_nodes(fn):
    """The function's nodes, not those of functions or classes defined inside it (checked on their own)."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _is_collective(call: ast.Call) -> bool:
    name = _dotted(call.func) or ""
    head, _, last = name.rpartition(".")
    if head == "" and last in COMPAT:       # runtime/ranks/torch_compat.py's version-proof collectives
        return True
    return last in COLLECTIVES and head in ("dist", "torch.distributed")


def _creation(call: ast.Call) -> str | None:
    name = _dotted(call.func) or ""
    if name.startswith("torch.") and name.count(".") == 1 and name.split(".")[1] in FACTORIES:
        return name
    if isinstance(call.func, ast.Attribute) and call.func.attr in NEW_METHODS:
        return "." + call.func.attr
    return None


def _job_device(value) -> bool:
    if isinstance(value, ast.Name):
        return value.id.endswith("device")
    if isinstance(value, ast.Call):
        return (_dotted(value.func) or "").rpartition(".")[2] == "collective_device"
    name = _dotted(value)
    return name is not None and name.endswith(".device") and name.split(".")[0] in JOB_ROOTS


def findings(src: Path = SRC) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        module = path.relative_to(src).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (module, fn.name) in ALLOWED:
                continue
            calls = [n for n in _own_nodes(fn) if isinstance(n, ast.Call)]
            if not any(_is_collective(c) for c in calls):
                continue
            for call in calls:
                made = _creation(call)
                if made is None:
                    continue
                device = next((k.value for k in call.keywords if k.arg == "device"), None)
                if device is None or not _job_device(device):
                    said = "no device=" if device is None else f"device={ast.unparse(device)}"
                    found.append(f"{module}:{call.lineno} {fn.name}: {made}(..., {said})")
    return found


def test_tensors_made_in_a_function_that_calls_a_collective_are_made_on_the_job_device():
    found = findings()
    assert not found, ("tensor created beside a collective without the job's device (make it with "
                       "device=<the job's device>, or list the function in ALLOWED with the reason):\n"
                       + "\n".join(found))


def test_every_allowed_function_exists_and_calls_a_collective():
    for module, name in ALLOWED:
        tree = ast.parse((SRC / module).read_text())
        fns = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == name]
        assert fns, f"{module}: {name} is gone; drop it from ALLOWED"
        assert any(_is_collective(c) for f in fns for c in _own_nodes(f) if isinstance(c, ast.Call)), (module, name)


def test_the_guard_flags_the_defects_it_was_written_for(tmp_path):
    """The shapes of the defects the CUDA reading found (a CPU tensor by default; one made beside
    host state), each in a function that calls a collective; the fixed shapes pass."""
    (tmp_path / "old.py").write_text(
        "import torch\nimport torch.distributed as dist\n\n"
        "def store_flos(self):\n    flos = torch.tensor([1.0], dtype=torch.float64)\n    dist.all_reduce(flos)\n\n"
        "def clip(self, grads):\n    sq = sum(grads, torch.zeros(()))\n    dist.all_reduce(sq)\n\n"
        "def save(held, sharding):\n    for v in held.values():\n"
        "        t = torch.zeros(3, device=v.device)\n        dist.reduce(t, dst=0)\n\n"
        "def fixed(self, sharding):\n    a = torch.zeros((), device=self.device)\n"
        "    b = torch.zeros(3, device=sharding.device)\n    dist.all_reduce(a)\n    dist.reduce(b, dst=0)\n")
    assert [f.split(" ", 1)[1] for f in findings(tmp_path)] == [
        "store_flos: torch.tensor(..., no device=)", "clip: torch.zeros(..., no device=)",
        "save: torch.zeros(..., device=v.device)"]
