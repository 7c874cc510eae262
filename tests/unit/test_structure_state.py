"""Where the job's state is written, as rules a change must keep: integrations go through the
Engine's public methods (never its job record), a Config is changed only by making a new one."""

from __future__ import annotations

import ast
import re

from test_structure import SRC, _code_lines

JOB_RECORD = re.compile(r"\.job\b")
CONFIG_SETATTR = re.compile(r"object\.__setattr__\(")


def _found(pattern: re.Pattern, paths) -> list[str]:
    return [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in paths for i, line in _code_lines(p)
            if pattern.search(line)]


def test_no_integration_touches_the_engines_job_record():
    found = _found(JOB_RECORD, sorted((SRC / "integrations").rglob("*.py")))
    assert not found, "integrations read the job record (use the Engine's public methods):\n" + "\n".join(found)


def test_no_config_is_overwritten_in_place_or_replaced_from_an_integration():
    config_writes = re.compile(r"\bconfig\s*=\s*replace\(|(?<!self)\.config\s*=[^=]")   # (a strategy's own dict)
    found = _found(config_writes, sorted((SRC / "integrations").rglob("*.py")))
    found += [f for f in _found(CONFIG_SETATTR, sorted(SRC.rglob("*.py")))
              if "runtime/config.py" not in f and "onfig" in f]
    assert not found, "a Config changed outside Engine.configure / set_grad_clip:\n" + "\n".join(found)


def test_the_rules_find_what_they_are_for():
    assert JOB_RECORD.search("engine.job.plan") and not JOB_RECORD.search("engine.jobs")
    assert re.search(r"\.config\s*=[^=]", "engine.job.config = replace(c)")


def _plan_writes(path) -> list[int]:
    """Lines that assign an attribute named `plan` (alone or in a tuple), or setattr(..., 'plan', ...)."""
    tree = ast.parse(path.read_text())
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and e.attr == "plan" and not (
                        isinstance(e.value, ast.Name) and e.value.id == "self"):
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "plan":
            lines.append(node.lineno)
    return lines


def test_the_plan_in_force_has_one_writer():
    found = [f"{p.relative_to(SRC)}:{i}" for p in sorted(SRC.rglob("*.py")) for i in _plan_writes(p)]
    assert found == [f"runtime/replan.py:{_plan_writes(SRC / 'runtime' / 'replan.py')[0]}"], \
        "the plan in force is written outside runtime/replan.adopt:\n" + "\n".join(found)


def test_the_plan_write_rule_finds_what_it_is_for(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("job.plan = p\njob.plan, job.profiles = a, b\nsetattr(job, 'plan', p)\nself.plan = p\nx = job.plan\n")
    assert _plan_writes(code) == [1, 2, 3]


def _adopt_calls(path) -> list[str]:
    """The functions (Class.method) that call `adopt(...)` in `path`, one entry per call."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) == "adopt":
                    found.append(where)
            visit(child, where)
    visit(ast.parse(path.read_text()), "")
    return found


# A layout's plan() adopts its plan, complete, once (prepare's one adoption: runtime/layouts/complete.py
# made it whole); a re-plan (resume, rebalance, OOM) goes through replan.replan. HybridSetup runs
# PipelineSetup's plan.
ADOPTERS = {"runtime/layouts/data_setup.py": ["DataSetup.plan", "TensorSetup.plan"],
            "runtime/layouts/pipeline/layout.py": ["PipelineSetup.plan"],
            "runtime/replan.py": ["replan"]}


def test_the_plan_is_adopted_once_by_each_layout_and_by_the_one_replan():
    found = {str(p.relative_to(SRC)): calls for p in sorted(SRC.rglob("*.py")) if (calls := _adopt_calls(p))}
    assert found == ADOPTERS, f"adopt( is called outside a layout's plan() and replan.replan: {found}"


def test_the_adopt_rule_finds_what_it_is_for(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("class A:\n    def plan(self):\n        adopt(j, p, 'x')\n        replan.adopt(j, p, 'y')\n"
                    "def f():\n    persist.adopt_plan(j)\n    def g():\n        adopt(j, p, 'z')\n")
    assert _adopt_calls(code) == ["A.plan", "A.plan", "f.g"]
