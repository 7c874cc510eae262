"""The package's structure, as rules a change must keep: no module reaches into another object's
underscore attributes, modules stay small, imports point down the layers, and no two modules of a
unit import each other (directly or round a longer cycle)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hetrain"
# torch / stdlib internals hetrain must use, each for a stated reason:
ALLOWED = {
    "torch._foreach_mul_": "one fused in-place multiply of every gradient (reduce.scale_gradients)",
    "os._exit": "a worker stopping on an error skips teardown: its peers may already be gone",
    "ddp.reducer._reset_state": "DDP has no public way to run a forward again after a broken backward",
    "ddp.reducer._get_zeros_like_grad_buckets": "the buckets an OOM left unsent (their layout, as meta tensors)",
    "torch._utils": "torch's flatten/unflatten of dense tensors (pipeline gradient exchange)",
    "torch.utils._python_dispatch": "TorchDispatchMode (see PRIVATE_IMPORTS)",
    "torch._dynamo": "preloaded by the sweep's fork server (a module name): the first optimizer a trial "
                     "builds imports it, ~2 s of CPU a worker otherwise",
}
ACCESS = re.compile(r"\b((?:\w+\.)*\w+)\.(_[A-Za-z]\w*)")


def _code_lines(path: Path):
    """(line number, text) of code, without comments and docstrings."""
    tree = ast.parse(path.read_text())
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant) \
                and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if i not in doc_lines:
            yield i, line.split("#", 1)[0]


def test_no_module_reads_or_writes_another_objects_underscore_attributes():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for i, line in _code_lines(path):
            for base, attr in ACCESS.findall(line):
                if base in ("self", "cls") or attr.startswith("__") or f"{base}.{attr}" in ALLOWED:
                    continue
                found.append(f"{path.relative_to(SRC)}:{i}: {base}.{attr}")
    assert not found, "private attributes used from outside their object:\n" + "\n".join(found)


def test_every_module_stays_under_600_lines():
    long = [f"{p.relative_to(SRC)}: {n}" for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, long


def test_the_engine_coordinates_in_at_most_250_lines():
    engine = next(SRC.rglob("engine.py"))
    assert len(engine.read_text().splitlines()) <= 250


OUTSIDE = re.compile(r"\.\./shared|TORCH-CPU-FACTS|USER-NEEDS|\bDESIGN\.md")


def test_nothing_in_the_repository_cites_a_file_outside_it():
    repo = SRC.parents[1]
    cited = []
    for folder in ("src", "tests", "benchmarks", "examples", "docs", ".ci"):
        for path in sorted((repo / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".json", ".toml", ".txt", "") and "__pycache__" not in path.parts:
                for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if OUTSIDE.search(line) and path.name != "test_structure.py":
                        cited.append(f"{path.relative_to(repo)}:{i}")
    for name in ("README.md", "pyproject.toml"):
        cited += [f"{name}:{i}" for i, line in enumerate((repo / name).read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not cited, "files outside the repository cited (say the fact where it is used instead):\n" + "\n".join(cited)


# The layers, bottom first: a module imports only from its own layer's unit or a lower layer, at
# module level or inside a function alike (an import inside a function still points somewhere).
LAYERS = (
    {"errors", "version"},
    {"vocabulary", "files", "console", "process_exit"},
    {"layout_spec"},                    # the layout objects prepare(parallel=) takes, in those words
    {"hardware", "report", "reporting"},
    {"planning"},                       # pure: no torch.distributed
    {"runtime", "emulation"},           # inside each rank; its own order below (emulation: one of its parts)
    {"parallel", "integrations", "launching", "demo", "sweeping"},
    {"launch"},
    {"benching"},
    {"cli"},
    {"__main__", "hetrain"},            # the package's face: `import hetrain`
)
# runtime/, bottom first. A subpackage (or top-level module) imports only from those below it. The
# CPU emulator (hetrain/emulation/) is a package of its own that plays a device: it stands on the
# device clock and hooks and under everything that runs a device (planning never imports it).
RUNTIME = ("config_groups", "config", "user_objects", "model", "replan", "ranks", "devices", "emulation", "sharding",
           "memory", "resilience", "job", "loop", "measure", "layouts", "setup", "facts", "engine", "__init__")
# Private names torch makes us import, each with its reason (as ALLOWED above, for attributes).
PRIVATE_IMPORTS = {"torch._utils": "torch's flatten/unflatten of dense tensors (pipeline gradient exchange)",
                   "lightning.fabric.utilities.data": "Fabric's rebuild of a DataLoader around another sampler, "
                                                      "as it rebuilds one for its DistributedSampler",
                   "torch.utils._python_dispatch": "TorchDispatchMode: the bucket layout an OOM completion needs "
                                                   "without its memory, and the emulated meter of what a recovery allocates"}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(line, imported module, names) for every import of the file, wherever it is."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            if node.module is None:          # from . import a, b: each a module of the package
                for n in names:
                    yield node.lineno, f"{target}.{n}", []
            else:
                yield node.lineno, target, names
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []


# A layout's package keeps its pure planning modules beside its runtime ones: they belong to the
# planning layer (and unit), so planning/ may import them and they import nothing above planning.
PIPELINE, TENSOR = "hetrain.runtime.layouts.pipeline", "hetrain.runtime.layouts.tensor"
PURE_LAYOUT_MODULES = {f"{PIPELINE}.profile", f"{PIPELINE}.stage_plan", f"{PIPELINE}.split", f"{TENSOR}.split"}


def _layer_of(module: str) -> tuple[int, int]:
    parts = module.split(".")
    if module in PURE_LAYOUT_MODULES:
        return _layer_of("hetrain.planning")
    top = parts[1] if len(parts) > 1 else "hetrain"
    layer = next(i for i, names in enumerate(LAYERS) if top in names)
    if top == "emulation":
        return layer, RUNTIME.index("emulation")
    if top == "runtime":
        return layer, RUNTIME.index(parts[2] if len(parts) > 2 else "__init__")
    return layer, 0


def _under_type_checking(path: Path) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, inner.end_lineno + 1))
    return lines


def test_the_layer_tables_name_every_package_and_runtime_part():
    tops = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    tops = {"hetrain" if t == "__init__" else t for t in tops}
    assert tops == set().union(*LAYERS), tops ^ set().union(*LAYERS)
    parts = {p.stem if p.is_file() else p.name for p in (SRC / "runtime").iterdir()
             if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts | {"emulation"} == set(RUNTIME), parts ^ set(RUNTIME)


def _unit(module: str) -> str:
    if module in PURE_LAYOUT_MODULES:
        return "hetrain.planning"
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["runtime"] and len(parts) > 2 else ".".join(parts[:2])


def test_imports_point_down_the_layers_and_runtimes_order():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module(path)
        me, typing_only = _layer_of(module), _under_type_checking(path)
        for line, target, _ in _imports(path):
            if not (target == "hetrain" or target.startswith("hetrain.")) or line in typing_only:
                continue
            if _unit(target) != _unit(module) and not _layer_of(target) < me:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert not wrong, "imports that point up or across a layer:\n" + "\n".join(wrong)


# Import cycles still inside a unit, each with why it stays for now (the test fails on any other).
CYCLES_ALLOWED: set[tuple[str, ...]] = set()   # none: a cycle is split into leaves, not listed


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of its own unit it imports, at module level or inside a function
    alike (as the layer rule counts them); not under TYPE_CHECKING, which never runs."""
    modules = {_module(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        typing_only, targets = _under_type_checking(path), set()
        for line, target, names in _imports(path):
            if line in typing_only:
                continue
            targets.update(f"{target}.{n}" for n in names if f"{target}.{n}" in modules)   # from pkg import module
            if target in modules:
                targets.add(target)
        graph[module] = {t for t in targets if t != module and _unit(t) == _unit(module)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_and_not_a_chain():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_inside_a_unit():
    """A cycle means neither module can be read (or imported) without the other: the shared part
    belongs in a leaf both import (planning/rows.py, sharding/optim_slices.py)."""
    cycles = [c for c in _cycles(_import_graph()) if c not in CYCLES_ALLOWED]
    assert not cycles, "import cycles (move what both need into a leaf module):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for line, target, names in _imports(path):
            if target in PRIVATE_IMPORTS:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private or any(part.startswith("_") and not part.startswith("__") for part in target.split(".")):
                found.append(f"{path.relative_to(SRC)}:{line} from {target} import {', '.join(private) or '...'}")
    assert not found, "private names imported across modules (make them public, or move them):\n" + "\n".join(found)


# A layout string compared: `plan.layout == "pp"`, `kind != 'tp'`, `x in ("pp", "dp-pp")`.
LAYOUT_WORD = r"""["'](?:dp|pp|dp-pp|tp)["']"""
LAYOUT_COMPARISON = re.compile(rf"""\.layout\s*(?:==|!=|\bin\b|\bnot in\b)|(?:==|!=)\s*{LAYOUT_WORD}|{LAYOUT_WORD}\s*(?:==|!=)"""
                               rf"""|\bin\s*[(\[{{]\s*{LAYOUT_WORD}""")


def test_no_runtime_code_compares_layout_strings():
    """The runtime asks the layout object (runtime/layouts/) or the plan's record of it
    (Plan.layout_record) which layout runs, never the words of Plan.layout."""
    found = [f"{path.relative_to(SRC)}:{i}: {line.strip()}"
             for path in sorted((SRC / "runtime").rglob("*.py")) for i, line in _code_lines(path)
             if LAYOUT_COMPARISON.search(line)]
    assert not found, "layout strings compared (ask the layout object instead):\n" + "\n".join(found)


def test_the_layout_comparison_rule_finds_what_it_is_for():
    for line in ('if plan.layout == "pp":', "x = kind != 'tp'", 'if job.plan.layout in ("pp", "dp-pp"):',
                 'return "dp" == name'):
        assert LAYOUT_COMPARISON.search(line), line
    for line in ('layout="tp"', 'name = "dp"', 'return {"layout": plan.layout}', 'if parallel == "auto":'):
        assert not LAYOUT_COMPARISON.search(line), line


# runtime/layouts/, bottom first: each module imports only the layout modules below it (no cycle:
# choose imports the layout classes for 'auto', so they check through checks.py, not choose). A
# layout's package (its plan, split, stage or shard, loop, probe and moves: pipeline, tensor) sits
# as one entry, its own modules in their order below.
LAYOUT_MODULES = ("protocol", "checks", "complete", "data", "tensor", "data_setup", "pipeline", "ranking", "choose",
                  "__init__")
PIPELINE_MODULES = ("profile", "stage_plan", "split", "blocks", "stage_hooks", "stage", "move", "schedule", "sizing",
                    "stage_state", "loop", "probe", "block_cache", "resplit", "setup", "layout", "__init__")
TENSOR_MODULES = ("split", "styles", "hf", "uneven", "state", "shard", "probe", "loop", "__init__")


def _wrong_order(folder: Path, package: str, order: tuple[str, ...]) -> list[str]:
    wrong = []
    for path in sorted(folder.glob("*.py")):
        me = order.index(path.stem)
        for line, target, names in _imports(path):
            if not (target == package or target.startswith(package + ".")):
                continue
            rest = target[len(package) + 1:].split(".") if target != package else []
            used = [rest[0]] if rest else names                   # from . import data: the module named
            wrong += [f"{path.relative_to(SRC)}:{line} imports {u}" for u in used if u in order and order.index(u) >= me]
    return wrong


def test_runtime_layouts_modules_import_only_the_ones_below_them():
    folder = SRC / "runtime" / "layouts"
    packages = {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert {p.stem for p in folder.glob("*.py")} | packages == set(LAYOUT_MODULES)
    assert {p.stem for p in (folder / "pipeline").glob("*.py")} == set(PIPELINE_MODULES)
    assert {p.stem for p in (folder / "tensor").glob("*.py")} == set(TENSOR_MODULES)
    wrong = _wrong_order(folder, "hetrain.runtime.layouts", LAYOUT_MODULES)
    wrong += _wrong_order(folder / "pipeline", PIPELINE, PIPELINE_MODULES)
    wrong += _wrong_order(folder / "tensor", TENSOR, TENSOR_MODULES)
    assert not wrong, "runtime/layouts imports that point up or across (a cycle):\n" + "\n".join(wrong)


def test_the_pure_layout_modules_exist_and_import_no_torch():
    """planning/ and a layout package's planning modules run where torch is absent (`hetrain
    simulate`, `hetrain plan` from the catalog): no torch import, at module level or inside a function."""
    pure = [SRC.parent / (m.replace(".", "/") + ".py") for m in sorted(PURE_LAYOUT_MODULES)]
    assert all(p.exists() for p in pure), [str(p) for p in pure if not p.exists()]
    found = [f"{path.relative_to(SRC)}:{line} imports {target}"
             for path in pure + sorted((SRC / "planning").rglob("*.py"))
             for line, target, _ in _imports(path) if target == "torch" or target.startswith("torch.")]
    assert not found, "torch imported by pure planning:\n" + "\n".join(found)
